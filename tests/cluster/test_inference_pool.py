"""spec.inferencePool on the real control plane with the Gateway API Inference Extension's CRDs installed
(from its Go module at hack/versions.env's GIE_VERSION): the API server accepts the rendered InferencePool
and InferenceObjective, and the pool holds exactly the engine pods whose readiness gate is open.

"In the pool" is what GIE's endpoint picker takes from the pool (v1.5.0 pkg/epp/controller/
pod_reconciler.go): a pod matching the pool's selector and Ready (IsPodReady: the Ready condition True,
no deletionTimestamp). The engine pods are kwok's fakes, each mapped to its own simulator on 127.0.0.1
(the per-pod endpoint override); one simulator answers every chat with a 500, so its pod's gate stays
closed and it is left out of the pool while it matches the selector like the others. A second
ServedModel joins the pool on a simulator with the older /metrics names (--sim-metric-names old): its pod
serves and is in the pool, and MetricsCompatible names it and vllm:kv_cache_usage_perc.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, crds_installed, golden_dry_run, served_model

import controlplane
import olm_tools
from rollout_rig import write_override
from servedmodel.api import names
from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster
WAIT_S = 120.0
ROOT = Path(__file__).resolve().parents[2]
SIM_ARGS = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
CRDS = ("inferencepools.inference.networking.k8s.io", "inferenceobjectives.inference.networking.x-k8s.io")
PROBE = {"interval": 5, "readinessGate": True, "firstByteTimeout": 2, "timeout": 10, "checkLimits": False}


@pytest.fixture
def gie_crds(control_plane: controlplane.ControlPlane) -> Iterator[None]:
    """InferencePool and InferenceObjective CRDs, removed afterwards so the rest of the session discovers
    no inference.networking.k8s.io."""
    fetch = lambda: [olm_tools.gie_crd(p) for p in ("inferencepools", "inferenceobjectives")]  # noqa: E731
    with crds_installed(control_plane, fetch, CRDS, "Gateway API Inference Extension CRDs"):
        yield


def test_gie_crds_accept_the_rendered_golden_objects(
    control_plane: controlplane.ControlPlane, namespace: str, gie_crds: None
) -> None:
    docs, out = golden_dry_run(
        control_plane, namespace, "inference-pool", lambda d: d["kind"].startswith("Inference")
    )
    assert {d["kind"] for d in docs} == {"InferencePool", "InferenceObjective"}
    assert out.count("serverside-applied (server dry run)") == 2, out


def condition_of(pod: dict[str, Any], type_: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("status"))
    return None


def pool_members(cp: controlplane.ControlPlane, namespace: str, pool: dict[str, Any]) -> dict[str, bool]:
    """pod name -> whether the endpoint picker keeps it: every pod the pool's selector matches, True
    where it is Ready and not being deleted (GIE's IsPodReady)."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(pool["spec"]["selector"]["matchLabels"].items()))
    pods = cp.get_json("pods", "-n", namespace, "-l", selector)["items"]
    return {p["metadata"]["name"]: is_pod_ready(p) for p in pods}


def is_pod_ready(pod: dict[str, Any]) -> bool:
    """GIE's IsPodReady: not being deleted, and the Ready condition True."""
    return not pod["metadata"].get("deletionTimestamp") and condition_of(pod, "Ready") == "True"


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = cp.get_json("servedmodel", name, "-n", namespace)
    return got


def running_pods(cp: controlplane.ControlPlane, namespace: str, name: str) -> list[str]:
    pods = cp.get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return sorted(p["metadata"]["name"] for p in live if (p.get("status") or {}).get("phase") == "Running")


def test_the_pool_holds_exactly_the_gated_pods_of_two_served_models(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    gie_crds: None,
) -> None:
    cp = control_plane
    override = tmp_path / "endpoints"
    override.write_text("# filled once the pods exist\n")
    sim_args = [*SIM_ARGS, "--sim-step-base-ms", "2"]
    with (
        SimulatorProcess(sim_args, ready_timeout=60) as a0,
        SimulatorProcess(sim_args, ready_timeout=60) as a1,
        SimulatorProcess(sim_args, ready_timeout=60) as a2,
        # b0 exposes the older /metrics names: the probe (and so the gate) works, the picker would not.
        SimulatorProcess([*sim_args, "--sim-metric-names", "old"], ready_timeout=60) as b0,
    ):
        # a2's pod answers /health but every chat with a 500: its gate never opens.
        httpx.post(
            f"{a2.base_url}/admin/faults", json={"error_rate": 1.0, "error_status": 500}, timeout=5
        ).raise_for_status()
        op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")
        pool = {"name": "qwen", "endpointPickerRef": {"name": "qwen-epp"}, "objective": {"priority": 5}}
        apply(
            cp,
            namespace,
            served_model("qwen-a", replicas=3, servedModelName="qwen", probe=PROBE, inferencePool=pool),
        )
        # A second ServedModel joins the pool the first one creates.
        apply(
            cp,
            namespace,
            served_model(
                "qwen-b",
                replicas=1,
                servedModelName="qwen",
                probe=PROBE,
                inferencePool={"name": "qwen", "create": False},
            ),
        )
        pods_a = cluster_support.wait_for(
            "three qwen-a pods running",
            lambda: p if len(p := running_pods(cp, namespace, "qwen-a")) == 3 else None,
            WAIT_S,
            detail=op.log,
        )
        pods_b = cluster_support.wait_for(
            "one qwen-b pod running",
            lambda: p if len(p := running_pods(cp, namespace, "qwen-b")) == 1 else None,
            WAIT_S,
            detail=op.log,
        )
        # Accepted by the API server with GIE's CRDs (schema and CEL), owned by qwen-a.
        pool_obj = cluster_support.wait_for(
            "the InferencePool applied",
            lambda: cluster_support.get(cp, namespace, "inferencepool", "qwen"),
            WAIT_S,
            detail=op.log,
        )
        assert pool_obj["metadata"]["ownerReferences"][0]["name"] == "qwen-a"
        assert pool_obj["spec"]["selector"]["matchLabels"] == {names.INFERENCE_POOL_LABEL: "qwen"}
        assert pool_obj["spec"]["targetPorts"] == [{"number": names.ENGINE_PORT}]
        objective = cluster_support.get(cp, namespace, "inferenceobjective", "qwen")
        assert objective is not None
        assert objective["spec"]["priority"] == 5
        # Before any probe: every pod matches the selector, none is in the pool (no gate open).
        assert pool_members(cp, namespace, pool_obj) == dict.fromkeys(pods_a + pods_b, False)

        write_override(
            override,
            [
                *(f"{namespace}/qwen-a/{n}={s.base_url}" for n, s in zip(pods_a, (a0, a1, a2), strict=True)),
                f"{namespace}/qwen-b/{pods_b[0]}={b0.base_url}",
            ],
        )
        expected = {pods_a[0]: True, pods_a[1]: True, pods_a[2]: False, pods_b[0]: True}
        members = cluster_support.wait_for(
            "the pool: the three gated pods in, the failing one out",
            lambda: m if (m := pool_members(cp, namespace, pool_obj)) == expected else None,
            WAIT_S,
            detail=op.log,
        )
        # The pool's members are exactly the pods whose gate the probe opened.
        pods = cp.get_json("pods", "-n", namespace, "-l", f"{names.INFERENCE_POOL_LABEL}=qwen")["items"]
        gated = {p["metadata"]["name"] for p in pods if condition_of(p, READINESS_GATE_CONDITION) == "True"}
        assert {n for n, kept in members.items() if kept} == gated
        assert condition_of(next(p for p in pods if p["metadata"]["name"] == pods_a[2]), "Ready") == "False"

        # MetricsCompatible: qwen-a's three engines have vLLM 0.33's names; qwen-b's names the pod and
        # the series the endpoint picker would miss.
        def judged(name: str) -> dict[str, Any] | None:
            c = cluster_support.condition(sm(cp, namespace, name), "MetricsCompatible")
            return c if c.get("status") in ("True", "False") else None

        def conditions(name: str) -> str:
            return str((sm(cp, namespace, name).get("status") or {}).get("conditions"))

        compat_a = cluster_support.wait_for(
            "qwen-a MetricsCompatible judged",
            lambda: judged("qwen-a"),
            WAIT_S,
            detail=lambda: conditions("qwen-a"),
        )
        assert (compat_a["status"], compat_a["reason"]) == ("True", "SeriesPresent"), compat_a
        compat_b = cluster_support.wait_for(
            "qwen-b MetricsCompatible judged", lambda: judged("qwen-b"), WAIT_S, detail=op.log
        )
        assert (compat_b["status"], compat_b["reason"]) == ("False", "SeriesMissing"), compat_b
        assert compat_b["message"].startswith(
            f"pod {pods_b[0]} is missing vllm:kv_cache_usage_perc (only the older vllm:gpu_cache_usage_perc"
        )

        # Removing spec.inferencePool from the creator prunes the pool and its objective.
        cp.kubectl(
            "patch", "servedmodel", "qwen-a", "-n", namespace, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/inferencePool"}]',
        )  # fmt: skip
        cluster_support.wait_for(
            "the InferencePool pruned",
            lambda: cluster_support.get(cp, namespace, "inferencepool", "qwen") is None,
            WAIT_S,
            detail=op.log,
        )
        assert cluster_support.get(cp, namespace, "inferenceobjective", "qwen") is None
        for served in ("qwen-a", "qwen-b"):
            cp.kubectl("delete", "servedmodel", served, "-n", namespace, "--wait=true", "--timeout=60s")

"""The local control plane honours readiness gates as a kubelet does (hack/kwok's stages), and the
operator's probe drives the gate of each engine pod: one of three replicas made to stall, error or die
turns NotReady and leaves the Service's EndpointSlice while the others keep serving, and comes back when
it recovers.

The engine pods are kwok's fakes: each is mapped to its own simulator on 127.0.0.1 through the per-pod
endpoint override (a file the test writes once the pods exist; the operator reads it every cycle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cluster_support
import httpx
import pytest
from cluster_support import apply, condition, served_model

import controlplane
from rollout_rig import write_override
from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster
WAIT_S = 120.0
SIM_ARGS = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]


def ready_of(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return str(c.get("status"))
    return None


def test_kwok_holds_a_gated_pod_until_its_gate_is_true(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """No operator: a bare pod with a readiness gate and a Service. kwok makes its containers ready but
    not the pod; setting the gate condition (pods/status, as the operator does) flips Ready and the
    EndpointSlice, both ways."""
    cp = control_plane
    gate = "example.com/gate"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated", "labels": {"app": "gated"}},
        "spec": {
            "containers": [
                {"name": "c", "image": "busybox", "ports": [{"name": "http", "containerPort": 8000}]}
            ],
            "readinessGates": [{"conditionType": gate}],
        },
    }
    plain = {**pod, "metadata": {"name": "plain", "labels": {"app": "gated"}}}
    plain["spec"] = {k: v for k, v in pod["spec"].items() if k != "readinessGates"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gated"},
        "spec": {"selector": {"app": "gated"}, "ports": [{"name": "http", "port": 8000}]},
    }
    for obj in (pod, plain, service):
        apply(cp, namespace, obj)

    def pod_state(name: str) -> dict[str, Any]:
        got: dict[str, Any] = cp.get_json("pod", name, "-n", namespace)
        return got

    def running(name: str) -> dict[str, Any] | None:
        p = pod_state(name)
        return p if (p.get("status") or {}).get("phase") == "Running" else None

    gated = cluster_support.wait_for("the gated pod running", lambda: running("gated"), WAIT_S)
    cluster_support.wait_for("the plain pod Ready", lambda: ready_of(pod_state("plain")) == "True", WAIT_S)
    conds = {c["type"]: c for c in gated["status"]["conditions"]}
    assert conds["ContainersReady"]["status"] == "True"
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "ReadinessGatesNotReady")
    assert gate not in conds  # kwok sets no gate condition itself
    cluster_support.wait_for(
        "the plain pod's endpoint ready, the gated one's not",
        lambda: cp.endpoint_ready(namespace, "gated") == {"plain": True, "gated": False},
        WAIT_S,
    )

    def set_gate(status: str) -> None:
        patch = {"status": {"conditions": [{"type": gate, "status": status, "reason": "Test"}]}}
        cp.kubectl(
            "patch",
            "pod",
            "gated",
            "-n",
            namespace,
            "--subresource=status",
            "--type=strategic",
            "-p",
            json.dumps(patch),
        )

    set_gate("True")
    cluster_support.wait_for("Ready after the gate", lambda: ready_of(pod_state("gated")) == "True", WAIT_S)
    cluster_support.wait_for(
        "its endpoint ready", lambda: cp.endpoint_ready(namespace, "gated").get("gated") is True, WAIT_S
    )
    set_gate("False")
    cluster_support.wait_for("NotReady again", lambda: ready_of(pod_state("gated")) == "False", WAIT_S)
    cluster_support.wait_for(
        "its endpoint not ready", lambda: cp.endpoint_ready(namespace, "gated").get("gated") is False, WAIT_S
    )
    assert ready_of(pod_state("plain")) == "True"  # a pod without gates is left alone


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = cp.get_json("servedmodel", name, "-n", namespace)
    return got


def engine_pods(cp: controlplane.ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    pods = cp.get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
    live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    return sorted(live, key=lambda p: str(p["metadata"]["name"]))


def gate_of(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == READINESS_GATE_CONDITION:
            return str(c.get("status"))
    return None


def set_faults(sim: SimulatorProcess, **faults: Any) -> None:
    httpx.post(f"{sim.base_url}/admin/faults", json=faults, timeout=5).raise_for_status()


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"engine_stalled": True}, "EngineStalled"),
        ({"error_rate": 1.0, "error_status": 500}, "UnexpectedStatus"),
        ({"dead": True}, "EngineUnhealthy"),
    ],
    ids=["stall", "error", "die"],
)
def test_one_replica_of_three_fails_and_leaves_the_endpoint_slice(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    tmp_path: Path,
    fault: dict[str, Any],
    reason: str,
) -> None:
    cp = control_plane
    override = tmp_path / "endpoints"
    override.write_text("# filled once the pods exist\n")
    with (
        SimulatorProcess([*SIM_ARGS, "--sim-step-base-ms", "2"], ready_timeout=60) as s0,
        SimulatorProcess([*SIM_ARGS, "--sim-step-base-ms", "2"], ready_timeout=60) as s1,
        SimulatorProcess([*SIM_ARGS, "--sim-step-base-ms", "2"], ready_timeout=60) as s2,
    ):
        sims = [s0, s1, s2]
        op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")
        probe = {
            "interval": 5,
            "readinessGate": True,
            "firstByteTimeout": 2,
            "timeout": 10,
            "checkLimits": False,
        }
        apply(cp, namespace, served_model("qwen", replicas=3, servedModelName="qwen", probe=probe))

        def three_pods() -> list[dict[str, Any]] | None:
            pods = engine_pods(cp, namespace, "qwen")
            running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
            return running if len(running) == 3 else None

        pods = cluster_support.wait_for("three engine pods running", three_pods, WAIT_S, detail=op.log)
        names = [p["metadata"]["name"] for p in pods]
        # Held back by the gate: running, containers ready, but no traffic before a real generation.
        assert all(ready_of(p) == "False" for p in pods)
        assert all(gate_of(p) is None for p in pods)
        write_override(
            override, [f"{namespace}/qwen/{n}={s.base_url}" for n, s in zip(names, sims, strict=True)]
        )

        def all_ready() -> dict[str, bool] | None:
            eps = cp.endpoint_ready(namespace, "qwen-engine")
            return eps if eps == dict.fromkeys(names, True) else None

        cluster_support.wait_for(
            "all three endpoints ready after their probes", all_ready, WAIT_S, detail=op.log
        )
        obj = cluster_support.wait_for(
            "Serving 3/3",
            lambda: (
                (o := sm(cp, namespace, "qwen"))
                and ((o.get("status") or {}).get("probe") or {}).get("serving") == "3/3"
                and o
            ),
            WAIT_S,
        )
        assert [p["serving"] for p in obj["status"]["probe"]["pods"]] == ["True"] * 3
        cluster_support.wait_for(
            "phase Ready",
            lambda: sm(cp, namespace, "qwen")["status"].get("phase") == "Ready",
            WAIT_S,
            detail=op.log,
        )

        set_faults(sims[2], **fault)

        def third_out() -> dict[str, bool] | None:
            eps = cp.endpoint_ready(namespace, "qwen-engine")
            return eps if eps == {names[0]: True, names[1]: True, names[2]: False} else None

        cluster_support.wait_for(f"{names[2]} out of the EndpointSlice", third_out, WAIT_S, detail=op.log)
        obj = sm(cp, namespace, "qwen")
        bad = next(p for p in obj["status"]["probe"]["pods"] if p["name"] == names[2])
        assert (bad["serving"], bad["reason"]) == ("False", reason)
        serving = condition(obj, "Serving")
        assert (serving["status"], serving["reason"]) == ("True", "ReplicasFailing")
        assert f"pod {names[2]}: {reason}" in serving["message"]
        if reason == "EngineStalled":
            stalled = condition(obj, "EngineStalled")
            assert stalled["status"] == "True"
            assert "running" in stalled["message"]
            assert "waiting" in stalled["message"]
        cluster_support.wait_for(
            "phase Degraded (ReplicasFailing)",
            lambda: condition(sm(cp, namespace, "qwen"), "Degraded").get("reason") == "ReplicasFailing",
            WAIT_S,
            detail=op.log,
        )
        events = cp.get_json("events", "-n", namespace, "--field-selector", f"involvedObject.name={names[2]}")
        assert "ReplicaNotServing" in {e["reason"] for e in events["items"]}

        set_faults(sims[2], reset=True)
        cluster_support.wait_for(f"{names[2]} back in the EndpointSlice", all_ready, WAIT_S, detail=op.log)
        cluster_support.wait_for(
            "phase Ready again",
            lambda: sm(cp, namespace, "qwen")["status"].get("phase") == "Ready",
            WAIT_S,
            detail=op.log,
        )
        cp.kubectl("delete", "servedmodel", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")
        # No per-object daemon any more: nothing for kopf to cancel (or escalate) at deletion.
        assert "escalat" not in op.log().lower()

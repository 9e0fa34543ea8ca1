"""The operator against the real control plane (kube-apiserver, controller-manager, scheduler, kwok).

What is real: the API server (CRD schema, CEL, SSA, scale subresource, printer columns), the Deployment
controller, the garbage collector, the scheduler, and `servedmodel run` as its own process. What is
fake: the GPU node and its pods (kwok marks them Running/Ready; no engine process runs). So "Ready"
below is the Deployment's availability as kwok reports it, not a served model.

Waits are bounded polls (`wait_for`); nothing here asserts on elapsed time.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cluster_support
import pytest
from cluster_support import apply, condition, get
from prometheus_client.parser import text_string_to_metric_families

import controlplane
from servedmodel.api import names

# The `operator` fixture's OperatorProcess (tests/cluster/conftest.py; conftests are not importable).
OperatorProcess = Any

pytestmark = pytest.mark.cluster
WAIT_S = 90.0


def wait_for(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll `probe` until it returns something truthy; return it, or fail saying what was last seen."""
    return cluster_support.wait_for(what, probe, timeout)


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    obj = get(cp, namespace, "servedmodel", name)
    assert obj is not None, f"ServedModel {name} is gone"
    return obj


def served_model(name: str, **spec: Any) -> dict[str, Any]:
    """A vLLM ServedModel for the fake GPU node. Probing is off unless a test turns it on: kwok's pods
    serve nothing, and a failing probe (Serving=False) would rightly make a Ready model Degraded."""
    return cluster_support.served_model(name, **{"probe": {"enabled": False}, **spec})


def phase_is(cp: controlplane.ControlPlane, namespace: str, name: str, phase: str) -> Callable[[], Any]:
    def probe() -> Any:
        obj = sm(cp, namespace, name)
        status = obj.get("status") or {}
        return obj if status.get("phase") == phase else status.get("phase")

    return lambda: r if isinstance(r := probe(), dict) else None


def ready(cp: controlplane.ControlPlane, namespace: str, name: str = "qwen") -> dict[str, Any]:
    """Applies served_model(name) and waits for phase Ready: the ServedModel then."""
    apply(cp, namespace, served_model(name))
    obj: dict[str, Any] = wait_for("phase Ready", phase_is(cp, namespace, name, "Ready"))
    return obj


def deployed(cp: controlplane.ControlPlane, namespace: str) -> dict[str, Any]:
    """Applies served_model("qwen") and waits for its engine Deployment: that Deployment."""
    apply(cp, namespace, served_model("qwen"))
    dep: dict[str, Any] = wait_for("the engine Deployment", lambda: get(cp, namespace, "deployment", "qwen"))
    return dep


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(
        r["uid"] == owner["metadata"]["uid"] and r["kind"] == "ServedModel" and r.get("controller")
        for r in refs
    )


def events(cp: controlplane.ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    res = cp.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    )
    return list(json.loads(res.stdout)["items"])


def metric(op: OperatorProcess, sample: str, **labels: str) -> float:
    """One sample of the operator's /metrics, read with prometheus_client's parser."""
    for family in text_string_to_metric_families(op.metrics()):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"{sample}{labels} not in the operator's /metrics")


def test_apply_children_ready_printer_columns_events(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    apply(cp, namespace, served_model("qwen", servedModelName="qwen-small"))
    owner = sm(cp, namespace, "qwen")

    dep = wait_for("the engine Deployment", lambda: get(cp, namespace, "deployment", "qwen"))
    svc = wait_for("the engine Service", lambda: get(cp, namespace, "service", names.service_name("qwen")))
    assert owned_by(dep, owner)
    assert owned_by(svc, owner)
    managers = {m["manager"] for m in dep["metadata"]["managedFields"] if m["operation"] == "Apply"}
    assert managers == {"servedmodel-operator"}

    ready = wait_for("phase Ready", phase_is(cp, namespace, "qwen", "Ready"))
    status = ready["status"]
    assert condition(ready, "Ready")["status"] == "True"
    assert condition(ready, "Progressing")["status"] == "False"
    assert condition(ready, "Degraded")["status"] == "False"
    assert status["ready"] == "1/1"
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert status["endpoint"] == f"http://qwen-engine.{namespace}.svc:8000"
    assert status["servedModelName"] == "qwen-small"
    assert status["selector"] == names.selector_string("qwen")

    table = cp.kubectl("get", "sm", "qwen", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    columns = dict(zip(header.split(), row.split(), strict=False))
    assert (columns["NAME"], columns["READY"], columns["PHASE"]) == ("qwen", "1/1", "Ready")

    got = wait_for(
        "a Ready event", lambda: [e for e in events(cp, namespace, "qwen") if e["reason"] == "Ready"]
    )
    assert got[0]["type"] == "Normal"
    assert got[0]["involvedObject"]["kind"] == "ServedModel"


def test_cache_pvc_is_owned(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    apply(cp, namespace, served_model("cached", cache={"size": "20Gi"}))
    owner = sm(cp, namespace, "cached")
    pvc = wait_for("the cache PVC", lambda: get(cp, namespace, "pvc", names.cache_claim_name("cached")))
    assert owned_by(pvc, owner)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"


def test_spec_edit_rolls_the_deployment(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    ready(cp, namespace)
    before = get(cp, namespace, "deployment", "qwen")
    assert before is not None

    cp.kubectl(
        "patch",
        "sm",
        "qwen",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"engine":{"maxModelLen":8192}}}',
    )

    def new_args() -> list[str] | None:
        dep = get(cp, namespace, "deployment", "qwen")
        args: list[str] = (dep or {})["spec"]["template"]["spec"]["containers"][0].get("args", [])
        joined = " ".join(args)
        return args if ("--max-model-len 8192" in joined or "--max-model-len=8192" in joined) else None

    wait_for("--max-model-len 8192 in the pod template", new_args)
    after = get(cp, namespace, "deployment", "qwen")
    assert after is not None
    assert after["metadata"]["generation"] > before["metadata"]["generation"]

    # The rollout finishes on kwok and the status follows the new generation.
    def caught_up() -> dict[str, Any] | None:
        obj = sm(cp, namespace, "qwen")
        st = obj.get("status") or {}
        current = st.get("observedGeneration") == obj["metadata"]["generation"] and st.get("phase") == "Ready"
        return obj if current else None

    wait_for("status of the new generation, Ready", caught_up)


def test_scale_subresource(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    ready(cp, namespace)

    cp.kubectl("scale", "sm", "qwen", "-n", namespace, "--replicas=2")
    wait_for(
        "Deployment replicas 2",
        lambda: ((get(cp, namespace, "deployment", "qwen") or {}).get("spec") or {}).get("replicas") == 2,
    )

    def two_ready() -> dict[str, Any] | None:
        st = sm(cp, namespace, "qwen").get("status") or {}
        return st if (st.get("replicas"), st.get("ready"), st.get("phase")) == (2, "2/2", "Ready") else None

    wait_for("status replicas 2, ready 2/2", two_ready)
    scale = json.loads(
        cp.kubectl(
            "get",
            "--raw",
            f"/apis/inference.servedmodel.io/v1alpha1/namespaces/{namespace}/servedmodels/qwen/scale",
        ).stdout
    )
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == names.selector_string("qwen")


def test_delete_garbage_collects_children(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    deployed(cp, namespace)
    wait_for("the engine Service", lambda: get(cp, namespace, "service", "qwen-engine"))

    cp.kubectl("delete", "sm", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for("Deployment gone", lambda: get(cp, namespace, "deployment", "qwen") is None)
    wait_for("Service gone", lambda: get(cp, namespace, "service", "qwen-engine") is None)
    assert operator.alive()


def test_deleted_deployment_is_recreated(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    first = deployed(cp, namespace)
    cp.kubectl("delete", "deployment", "qwen", "-n", namespace, "--wait=true", "--timeout=60s")

    def recreated() -> dict[str, Any] | None:
        dep = get(cp, namespace, "deployment", "qwen")
        return dep if dep and dep["metadata"]["uid"] != first["metadata"]["uid"] else None

    wait_for("a new engine Deployment", recreated)


def test_external_mode_has_no_children(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    endpoint = "http://vllm-qwen.inference.svc.cluster.local:8000"
    manifest = {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "ext"},
        "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", "endpoint": endpoint, "probe": {"enabled": False}},
    }
    apply(cp, namespace, manifest)
    ready = wait_for("phase Ready", phase_is(cp, namespace, "ext", "Ready"))
    assert ready["status"]["endpoint"] == endpoint
    assert condition(ready, "Ready")["reason"] == "ExternalEndpoint"
    assert "replicas" not in ready["status"]
    for kind in ("deployments", "services", "persistentvolumeclaims"):
        items = json.loads(cp.kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]
        assert [i["metadata"]["name"] for i in items] == [], kind


def test_switch_to_external_prunes_children(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    deployed(cp, namespace)
    # Replace the whole spec (a merge would keep engine/resources, which external mode forbids).
    external = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "endpoint": "http://elsewhere.example:8000",
        "probe": {"enabled": False},
    }
    patch = [{"op": "replace", "path": "/spec", "value": external}]
    cp.kubectl("patch", "sm", "qwen", "-n", namespace, "--type=json", "-p", json.dumps(patch))
    wait_for("Deployment pruned", lambda: get(cp, namespace, "deployment", "qwen") is None)
    wait_for("Service pruned", lambda: get(cp, namespace, "service", "qwen-engine") is None)
    ready = wait_for("phase Ready", phase_is(cp, namespace, "qwen", "Ready"))
    assert ready["status"]["endpoint"] == "http://elsewhere.example:8000"
    assert "ready" not in ready["status"]


def test_unrenderable_spec_is_invalid_spec_not_a_crash(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    bad = served_model("qwen", engine={"maxModelLen": 4096, "extraArgs": ["--max-model-len=9999"]})
    apply(cp, namespace, bad)  # the schema lets it through: the conflict is between two fields' meanings

    def invalid() -> dict[str, Any] | None:
        obj = sm(cp, namespace, "qwen")
        return obj if condition(obj, "InvalidSpec").get("status") == "True" else None

    obj = wait_for("the InvalidSpec condition", invalid)
    assert "--max-model-len" in condition(obj, "InvalidSpec")["message"]
    assert obj["status"]["phase"] == "Failed"
    assert condition(obj, "Ready")["reason"] == "InvalidSpec"
    assert get(cp, namespace, "deployment", "qwen") is None
    assert operator.alive()
    assert operator.healthy()

    # Fixing the spec clears it and the model is served.
    fixed = ready(cp, namespace)
    assert condition(fixed, "InvalidSpec") == {}


def test_noop_resync_writes_no_status(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    # (Probing is off: the probe writes status.probe every cycle with its own field manager.)
    before = ready(cp, namespace)
    writes = metric(operator, "servedmodel_status_writes_total")
    refreshed = metric(operator, "servedmodel_reconcile_total", result="refreshed")

    # A change to the Deployment that changes nothing the status is made of: the operator refreshes.
    cp.kubectl("label", "deployment", "qwen", "-n", namespace, "example.com/touched=1")
    wait_for(
        "a status refresh after the Deployment event",
        lambda: metric(operator, "servedmodel_reconcile_total", result="refreshed") > refreshed,
    )
    after = sm(cp, namespace, "qwen")
    assert metric(operator, "servedmodel_status_writes_total") == writes
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["metadata"]["managedFields"] == before["metadata"]["managedFields"]


def test_generation_bump_without_rollout_does_not_flap(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    # (Probing is off: the probe writes status.probe every cycle with its own field manager.)
    before = ready(cp, namespace)
    refreshed = metric(operator, "servedmodel_reconcile_total", result="refreshed")
    generation = (get(cp, namespace, "deployment", "qwen") or {})["metadata"]["generation"]

    # Annotations bump a Deployment's generation (a legacy of rollbacks) but roll nothing out.
    cp.kubectl("annotate", "deployment", "qwen", "-n", namespace, "example.com/note=hello")
    wait_for(
        "the Deployment controller to observe the new generation",
        lambda: (
            ((get(cp, namespace, "deployment", "qwen") or {}).get("status") or {}).get(
                "observedGeneration", 0
            )
            > generation
        ),
    )
    wait_for(
        "a status refresh after the Deployment event",
        lambda: metric(operator, "servedmodel_reconcile_total", result="refreshed") > refreshed,
    )
    after = sm(cp, namespace, "qwen")
    assert after["status"]["phase"] == "Ready"
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    progressing = [e for e in events(cp, namespace, "qwen") if e["reason"] == "Progressing"]
    assert sum(e.get("count") or 1 for e in progressing) <= 1  # at most the initial rollout's


def test_no_gpu_to_spare_is_degraded_unschedulable(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    # The fake node has 8 GPUs; 16 per replica can never be scheduled.
    apply(cp, namespace, served_model("huge", resources={"gpus": 16}))
    degraded = wait_for("phase Degraded", phase_is(cp, namespace, "huge", "Degraded"))
    cond = condition(degraded, "Degraded")
    assert (cond["status"], cond["reason"]) == ("True", "Unschedulable")
    assert "nvidia.com/gpu" in cond["message"]
    assert condition(degraded, "Ready")["reason"] == "Unschedulable"
    assert degraded["status"]["ready"] == "0/1"
    warnings = wait_for(
        "a Warning event",
        lambda: [
            e for e in events(cp, namespace, "huge") if e["type"] == "Warning" and e["reason"] == "Degraded"
        ],
    )
    assert "Unschedulable" in warnings[0]["message"]


def test_operator_restart_is_a_noop(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    operator: OperatorProcess,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    cp = control_plane
    before = ready(cp, namespace)
    operator.stop()

    second = start_operator(namespaces=[namespace])
    # The first listings (the ServedModel, then its children) enqueue it; counted, not timed: wait until
    # the restarted operator has reconciled, has nothing queued or in process, and two reads in a row
    # see the same number of reconciles, so a write that a later pass would make cannot be missed by
    # looking too early. The passes then found children and status current.
    seen: list[float] = []

    def settled() -> bool:
        reconciles = metric(second, "servedmodel_controller_reconciles_total")
        busy = sum(
            cluster_support.metric_sum(second, "servedmodel_workqueue_depth", state=state)
            for state in ("queued", "in_process")
        )
        seen.append(reconciles)
        return reconciles >= 1 and busy == 0 and seen[-2:] == [reconciles, reconciles]

    cluster_support.wait_for("the restarted operator's passes done", settled, WAIT_S, interval=1.0)
    after = sm(cp, namespace, "qwen")
    assert metric(second, "servedmodel_controller_failures_total") == 0
    assert metric(second, "servedmodel_status_writes_total") == 0
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    # The old kopf finalizer is gone, and nothing put a new one there.
    assert not after["metadata"].get("finalizers")


def test_refused_apply_is_degraded_apply_failed(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    apply(cp, namespace, served_model("cached", cache={"size": "20Gi"}))
    wait_for("the cache PVC", lambda: get(cp, namespace, "pvc", names.cache_claim_name("cached")))
    # The schema allows any size, the API server refuses to shrink a claim: a 422 on apply.
    cp.kubectl(
        "patch", "sm", "cached", "-n", namespace, "--type=merge", "-p", '{"spec":{"cache":{"size":"10Gi"}}}'
    )

    def apply_failed() -> dict[str, Any] | None:
        obj = sm(cp, namespace, "cached")
        return obj if condition(obj, "Degraded").get("reason") == "ApplyFailed" else None

    obj = wait_for("Degraded ApplyFailed", apply_failed)
    message = condition(obj, "Degraded")["message"]
    assert message.startswith(f"PersistentVolumeClaim/{names.cache_claim_name('cached')}: ")
    assert obj["status"]["phase"] == "Degraded"
    assert operator.alive()


def _watch_servedmodels(cp: controlplane.ControlPlane, namespace: str, out: Path) -> subprocess.Popen[bytes]:
    """`kubectl get servedmodels -w`: every version of every ServedModel of the namespace, in order."""
    cmd = [
        str(cp.bin_dir / "kubectl"),
        f"--kubeconfig={cp.kubeconfig}",
        "get",
        "servedmodels",
        "-n",
        namespace,
    ]
    with out.open("wb") as sink:
        return subprocess.Popen(
            [*cmd, "--watch", "--output-watch-events", "-o", "json"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _versions(stream: str, name: str) -> list[dict[str, Any]]:
    """The watched objects named `name`, oldest first (kubectl writes one JSON document per event)."""
    decoder, at, out = json.JSONDecoder(), 0, []
    while (at := stream.find("{", at)) != -1:
        event, at = decoder.raw_decode(stream, at)
        if event.get("object", {}).get("metadata", {}).get("name") == name:
            out.append(event["object"])
    return out


def test_failing_probe_degrades_a_ready_model_at_once(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """The probe's Serving=False reaches phase/Degraded in the reconciler's next status write, with the
    safety resync off: the probe's status write is a ServedModel event the control loop acts on.

    Counted, not timed: the first version of the object whose phase is Degraded still carries the first
    failed probe (consecutiveFailures 1), so no second probe cycle, let alone a resync, was needed."""
    cp = control_plane
    op = start_operator(namespaces=[namespace], env={"SERVEDMODEL_RESYNC_INTERVAL": "0"})
    watch = _watch_servedmodels(cp, namespace, tmp_path / "watch.json")
    try:
        # External mode, probe on: the operator fixture points every probe at a closed loopback port.
        manifest = {
            "apiVersion": "inference.servedmodel.io/v1alpha1",
            "kind": "ServedModel",
            "metadata": {"name": "ext"},
            "spec": {
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "endpoint": "http://vllm.example:8000",
                "probe": {"interval": 10},
            },
        }
        apply(cp, namespace, manifest)
        degraded = wait_for("phase Degraded", phase_is(cp, namespace, "ext", "Degraded"))
    finally:
        watch.terminate()
        watch.wait(timeout=15)
    serving = condition(degraded, "Serving")
    assert serving["status"] == "False"
    cond = condition(degraded, "Degraded")
    assert (cond["status"], cond["reason"]) == ("True", serving["reason"])
    assert condition(degraded, "Ready")["status"] == "True"  # Kubernetes-ready; the chat request fails

    versions = _versions((tmp_path / "watch.json").read_text(), "ext")
    phases = [(v.get("status") or {}).get("phase") for v in versions]
    first = phases.index("Degraded")
    failures = ((versions[first].get("status") or {}).get("probe") or {}).get("consecutiveFailures")
    assert failures == 1, f"Degraded only after {failures} failed probes; phases in order: {phases}"
    assert op.alive()

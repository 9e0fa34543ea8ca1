"""status.startup on the real control plane: one engine pod (kwok's, with the readiness gate) is mapped to
a simulator started after the pod exists with `--sim-startup-delay`, so its /health answers 503 for that
long. The operator records the pod's start: the stages kwok and the scheduler said (PodScheduled,
Initialized, the container's startedAt, ContainersReady), the probe's first /health 200 and its first
real token; in STARTUP_STAGES order, adding up to the total, the total within one probe interval of the
pod's Ready (the gate the same first token opened), and once in servedmodel_cold_start_seconds.
Counts, orderings and sums only: the one lower bound (the engine healthy no sooner than its delay after
the pod's creation) holds on any machine, the simulator having started after the pod.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import cluster_support
import pytest
from cluster_support import apply, engine_pods, metric_sum, ready_since, served_model

import controlplane
from rollout_rig import write_override
from servedmodel.api.names import ENGINE_CONTAINER
from servedmodel.api.startup import STARTUP_STAGES, StartupStatus
from servedmodel.probe.startup import stage_field, stage_seconds
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster
WAIT_S = 150.0
INTERVAL_S = 5
STARTUP_DELAY_S = 6.0
SIM_ARGS = ["Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]


def when(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def pulled_event(cp: controlplane.ControlPlane, namespace: str, pod: dict[str, Any]) -> str:
    """Post the engine container's Pulled Event as the kubelet does, stamped at the container's start
    (kwok's, once it says so); its time."""

    def started() -> str | None:
        live = cp.get_json("pod", pod["metadata"]["name"], "-n", namespace)
        running = [
            ((c.get("state") or {}).get("running") or {}).get("startedAt")
            for c in (live.get("status") or {}).get("containerStatuses") or []
            if c.get("name") == ENGINE_CONTAINER
        ]
        return running[0] if running and running[0] else None

    at = cluster_support.wait_for("the engine container started", started, WAIT_S)
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod['metadata']['name']}.pulled", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod["metadata"]["name"],
            "namespace": namespace,
            "uid": pod["metadata"]["uid"],
            "fieldPath": f"spec.containers{{{ENGINE_CONTAINER}}}",
        },
        "reason": "Pulled",
        "message": "Successfully pulled image in 1.2s",
        "type": "Normal",
        "source": {"component": "kubelet", "host": pod["spec"].get("nodeName", "")},
        "firstTimestamp": at,
        "lastTimestamp": at,
        "count": 1,
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(event))
    return str(at)


def test_a_slow_engine_start_is_timed_stage_by_stage(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Any, tmp_path: Path
) -> None:
    cp = control_plane
    override = tmp_path / "endpoints"
    override.write_text("# filled once the pod exists\n")
    op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")
    probe = {
        "interval": INTERVAL_S,
        "readinessGate": True,
        "firstByteTimeout": 2,
        "timeout": 10,
        "checkLimits": False,
    }
    apply(cp, namespace, served_model("qwen", replicas=1, servedModelName="qwen", probe=probe))
    [pod] = cluster_support.wait_for(
        "the engine pod", lambda: engine_pods(cp, namespace) or None, WAIT_S, detail=op.log
    )
    name = pod["metadata"]["name"]
    # kwok pulls nothing and records no Pulled Event: post the one a kubelet would (at the container's
    # start), which the operator's Events watch (a field selector) brings to the prober.
    pulled_at = pulled_event(cp, namespace, pod)
    # Started after the pod was created: its /health answers 503 for STARTUP_DELAY_S from now on.
    delayed = [*SIM_ARGS, "--sim-step-base-ms", "2", "--sim-startup-delay", str(STARTUP_DELAY_S)]
    with SimulatorProcess(delayed, ready_timeout=60) as sim:
        write_override(override, [f"{namespace}/qwen/{name}={sim.base_url}"])

        def recorded() -> dict[str, Any] | None:
            obj = cp.get_json("servedmodel", "qwen", "-n", namespace)
            startup = (obj.get("status") or {}).get("startup") or {}
            return startup if (startup.get("last") or {}).get("pod") == name else None

        written = cluster_support.wait_for("status.startup of the pod", recorded, WAIT_S, detail=op.log)
        [pod] = cluster_support.wait_for(
            "the pod Ready (its gate opened)",
            lambda: [p for p in engine_pods(cp, namespace) if ready_since(p)] or None,
            WAIT_S,
            detail=op.log,
        )
        metrics = op.metrics()

    status = StartupStatus.model_validate(written)
    last = status.last
    assert last is not None
    assert (last.pod, last.created, last.restarts) == (name, pod["metadata"]["creationTimestamp"], 0)
    assert (status.starts, [t.pod for t in status.recent]) == (1, [name])
    # What kwok, the scheduler, the Pulled Event and the probe each said
    said = [s for s in STARTUP_STAGES if getattr(last, stage_field(s)) is not None]
    assert said == [
        "scheduled",
        "initialized",
        "imagePulled",
        "containerStarted",
        "containersReady",
        "engineHealthy",
        "firstToken",
    ]
    created = when(pod["metadata"]["creationTimestamp"])
    assert last.image_pulled_seconds == (when(pulled_at) - created).total_seconds()
    moments = [getattr(last, stage_field(s)) for s in said]
    assert moments == sorted(moments)  # in the order a start passes them
    assert last.engine_healthy_seconds is not None
    assert last.engine_healthy_seconds >= STARTUP_DELAY_S  # /health said 503 until the delay was over
    assert last.total_seconds == last.first_token_seconds
    stages = stage_seconds(last)
    assert [s for s, _ in stages] == said
    assert last.total_seconds is not None
    assert sum(seconds for _, seconds in stages) == pytest.approx(last.total_seconds, abs=0.01)
    # The first token opened the gate and the pod turned Ready: the total is the pod's Ready time within
    # one probe interval (the API's timestamps are whole seconds: Ready may read up to 1 s early).
    ready_ready = (when(ready_since(pod) or "") - when(pod["metadata"]["creationTimestamp"])).total_seconds()
    assert -1.0 <= ready_ready - last.total_seconds <= INTERVAL_S
    assert status.p50 is not None
    assert status.p50.total_seconds == last.total_seconds  # one start: its own median

    # servedmodel_cold_start_seconds: the start counted once, its stages adding up to its total
    labels = {"namespace": namespace, "name": "qwen"}
    assert metric_sum(op, "servedmodel_cold_start_seconds_count", stage="total", **labels) == 1
    total = metric_sum(op, "servedmodel_cold_start_seconds_sum", stage="total", **labels)
    assert total == pytest.approx(last.total_seconds, abs=0.01)
    parts = sum(metric_sum(op, "servedmodel_cold_start_seconds_sum", stage=s, **labels) for s in said)
    assert parts == pytest.approx(total, abs=0.01)
    assert "servedmodel_cold_start_seconds_bucket" in metrics

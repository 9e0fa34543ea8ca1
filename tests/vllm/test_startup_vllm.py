"""status.startup with real vLLM: the engine pod (kwok's, with the readiness gate) exists first, its address
is a loopback port where nothing listens yet, then vLLM's CPU engine is started on that port. The probe
sees connection refused, then vLLM's /health 200 once its API server and EngineCore are up, then its first
streamed token: the same stages as the simulator's start (tests/cluster/test_startup_timeline_cluster.py),
in order, adding up to the total, the engine healthy no sooner than vLLM's process was spawned.
Orderings, sums and lower bounds only: how long vLLM takes to start is the machine's business.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cluster_support
import pytest
from cluster_support import apply, engine_pods, metric_sum, ready_since, served_model

import controlplane
import summary
from rollout_rig import write_override
from servedmodel.api.startup import STARTUP_STAGES, StartupStatus
from servedmodel.probe.startup import stage_field, stage_seconds
from vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.own_engines, pytest.mark.timeout(900)]
WAIT_S = 300.0
INTERVAL_S = 5


def when(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_real_vllms_start_is_timed_stage_by_stage(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    start_operator: Any,
    start_vllm: Any,
    tmp_path: Path,
) -> None:
    cp = control_plane
    override = tmp_path / "endpoints"
    override.write_text("# filled once the pod exists\n")
    op = start_operator(namespaces=[namespace], endpoint_override=f"@{override}")
    probe = {"interval": INTERVAL_S, "readinessGate": True, "firstByteTimeout": 5, "timeout": 20}
    apply(cp, namespace, served_model("qwen", replicas=1, servedModelName="qwen", probe=probe))
    [pod] = cluster_support.wait_for(
        "the engine pod", lambda: engine_pods(cp, namespace) or None, WAIT_S, detail=op.log
    )
    name = pod["metadata"]["name"]
    port = controlplane.free_ports(1)[0]
    # The pod's engine address before its engine exists: the probe meets a closed port.
    write_override(override, [f"{namespace}/qwen/{name}=http://127.0.0.1:{port}"])
    spawned = datetime.now(UTC)
    time.sleep(1.0)  # the API's timestamps are whole seconds: keep `spawned` clear of the pod's creation
    server: VLLMServer = start_vllm("qwen2.5", served_model_name="qwen", port=port)

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

    status = StartupStatus.model_validate(written)
    last = status.last
    assert last is not None
    assert (last.pod, last.restarts, status.starts) == (name, 0, 1)
    said = [s for s in STARTUP_STAGES if getattr(last, stage_field(s)) is not None]
    assert said == [
        "scheduled",
        "initialized",
        "containerStarted",
        "containersReady",
        "engineHealthy",
        "firstToken",
    ]
    moments = [getattr(last, stage_field(s)) for s in said]
    assert moments == sorted(moments)
    created = when(pod["metadata"]["creationTimestamp"])
    # vLLM's /health answered no sooner than its process was spawned (nothing listened on the port before)
    assert last.engine_healthy_seconds is not None
    assert last.engine_healthy_seconds >= (spawned - created).total_seconds()
    assert server.startup_s is not None
    assert server.startup_s > 0
    assert last.total_seconds == last.first_token_seconds
    stages = stage_seconds(last)
    assert [s for s, _ in stages] == said
    assert last.total_seconds is not None
    assert sum(seconds for _, seconds in stages) == pytest.approx(last.total_seconds, abs=0.01)
    # The first token opened the gate: the pod's Ready within one probe interval of the total.
    ready_after = (when(ready_since(pod) or "") - created).total_seconds()
    assert -1.0 <= ready_after - last.total_seconds <= INTERVAL_S
    summary.LINES.append(
        f"real vLLM start (status.startup, {name}): "
        + ", ".join(f"{s} {seconds:.1f} s" for s, seconds in stages)
        + f"; total {last.total_seconds:.1f} s (vLLM's own start {server.startup_s:.1f} s)"
    )
    labels = {"namespace": namespace, "name": "qwen"}
    assert metric_sum(op, "servedmodel_cold_start_seconds_count", stage="total", **labels) == 1

"""The probe scheduler's part in autoscaling: the TTFT p95 gauge it exports (the probe TTFT target's
signal), and, while the autoscaler holds the engine at zero, no chat and Serving Unknown (ScaledToZero)."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry
from replica_support import Cluster, scheduler

from servedmodel.sim.process import SimulatorProcess


def _requests(sim: SimulatorProcess) -> int:
    return len(httpx.get(f"{sim.base_url}/debug/requests?limit=100000", timeout=5).json())


def test_ttft_p95_gauge_follows_the_window(faults: SimulatorProcess) -> None:
    async def main() -> None:
        kube, registry = Cluster(), CollectorRegistry()
        body = {
            "metadata": {"name": "a", "namespace": "ns", "generation": 1},
            "spec": {
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "servedModelName": "qwen",
                "endpoint": faults.base_url,
            },
        }
        kube.objects[("ns", "a")] = body
        sched = scheduler(kube, registry=registry, seed=1)
        sched.track(body)
        try:
            for _ in range(2):
                result = await sched.run_cycle(("ns", "a"))
                assert result.probed
        finally:
            await sched.stop()
        window = body["status"]["probe"]["window"]
        got = registry.get_sample_value(
            "servedmodel_probe_ttft_p95_seconds", {"namespace": "ns", "name": "a"}
        )
        assert got == window["ttftP95Ms"] / 1000
        sched.forget("ns", "a")
        assert (
            registry.get_sample_value("servedmodel_probe_ttft_p95_seconds", {"namespace": "ns", "name": "a"})
            is None
        )

    asyncio.run(main())


def test_no_chat_at_zero_and_serving_unknown(faults: SimulatorProcess) -> None:
    async def main() -> None:
        kube, registry = Cluster(), CollectorRegistry()
        serving = {"type": "Serving", "status": "True", "reason": "ChatCompletionSucceeded", "message": ""}
        template = {"type": "TemplateOK", "status": "True", "reason": "Pass", "message": ""}
        probe = {"result": "Success", "window": {"samples": 3, "ttftP95Ms": 12.0}}
        body = {
            "metadata": {"name": "z", "namespace": "ns", "generation": 2},
            "spec": {
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "servedModelName": "qwen",
                "autoscaling": {
                    "maxReplicas": 2,
                    "targets": {"waitingRequestsPerReplica": 2},
                    "scaleToZero": True,
                    "prometheus": {"url": "http://prometheus:9090"},
                },
            },
            "status": {
                "phase": "Pending",
                "readyReplicas": 0,
                "autoscaling": {"autoscaler": "KEDA", "reason": "ScaledToZero"},
                "conditions": [serving, template],
                "probe": probe,
            },
        }
        kube.objects[("ns", "z")] = body
        sched = scheduler(kube, f"ns/z={faults.base_url}", registry=registry, seed=1)
        sched.metrics.ttft_p95.labels("ns", "z").set(0.012)  # from before it went to zero
        sched.track(body)
        before = await asyncio.to_thread(_requests, faults)
        try:
            first = await sched.run_cycle(("ns", "z"))
            second = await sched.run_cycle(("ns", "z"))
        finally:
            await sched.stop()
        assert not first.probed
        assert first.written
        assert not second.written  # said once
        assert await asyncio.to_thread(_requests, faults) == before  # no chat reached the engine
        ((_, _, patch),) = kube.writes
        assert patch["probe"] == probe  # status.probe kept (server-side apply would drop what is omitted)
        conds = {c["type"]: c for c in patch["conditions"]}
        assert (conds["Serving"]["status"], conds["Serving"]["reason"]) == ("Unknown", "ScaledToZero")
        assert conds["TemplateOK"]["status"] == "True"
        assert (
            registry.get_sample_value("servedmodel_probe_ttft_p95_seconds", {"namespace": "ns", "name": "z"})
            is None
        )

    asyncio.run(main())

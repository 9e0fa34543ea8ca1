"""The probe scheduler's part in autoscaling: the TTFT p95 gauge it exports (the probe TTFT target's
signal), and, while the autoscaler holds the engine at zero, no chat and Serving Unknown (ScaledToZero)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from servedmodel.config import OperatorConfig
from servedmodel.k8s import NotFoundError
from servedmodel.probing import ProbeMetrics, ProbeScheduler
from servedmodel.sim.process import SimulatorProcess


class Kube:
    """The scheduler's view of the API server: ServedModels it answers for, status writes it records."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.writes: list[dict[str, Any]] = []

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        return self.objects.get((namespace or "", name)) if plural == "servedmodels" else None

    async def list(self, api_version: str, plural: str, namespace: str | None = None, **_: Any) -> list[Any]:
        return []

    async def apply_status(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        status: dict[str, Any],
        field_manager: str,
        **_: Any,
    ) -> dict[str, Any]:
        key = (namespace or "", name)
        if key not in self.objects:
            raise NotFoundError(404, "NotFound", name)
        self.writes.append(status)
        obj = self.objects[key]
        obj["status"] = {**(obj.get("status") or {}), **status}
        return obj


def _scheduler(kube: Kube, registry: CollectorRegistry, **config: Any) -> ProbeScheduler:
    return ProbeScheduler(
        kube=kube, config=OperatorConfig(**config), metrics=ProbeMetrics(registry), rng=random.Random(1)
    )


def _requests(sim: SimulatorProcess) -> int:
    return len(httpx.get(f"{sim.base_url}/debug/requests?limit=100000", timeout=5).json())


def test_ttft_p95_gauge_follows_the_window(faults: SimulatorProcess) -> None:
    async def main() -> None:
        kube, registry = Kube(), CollectorRegistry()
        body = {
            "metadata": {"name": "a", "namespace": "ns", "generation": 1},
            "spec": {
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "servedModelName": "qwen",
                "endpoint": faults.base_url,
            },
        }
        kube.objects[("ns", "a")] = body
        sched = _scheduler(kube, registry)
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
        kube, registry = Kube(), CollectorRegistry()
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
        sched = _scheduler(kube, registry, endpoint_override=f"ns/z={faults.base_url}")
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
        (patch,) = kube.writes
        assert patch["probe"] == probe  # status.probe kept (server-side apply would drop what is omitted)
        conds = {c["type"]: c for c in patch["conditions"]}
        assert (conds["Serving"]["status"], conds["Serving"]["reason"]) == ("Unknown", "ScaledToZero")
        assert conds["TemplateOK"]["status"] == "True"
        assert (
            registry.get_sample_value("servedmodel_probe_ttft_p95_seconds", {"namespace": "ns", "name": "z"})
            is None
        )

    asyncio.run(main())

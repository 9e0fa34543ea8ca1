"""Helpers of the probe scheduler tests (tests/probe, tests/vllm): a recorder of what the probe scheduler
reads from and writes to Kubernetes, fake engine pods, a managed ServedModel, a scheduler on them."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.config import OperatorConfig
from servedmodel.k8s import KNOWN_RESOURCES, NotFoundError, Resource
from servedmodel.k8s.cache import Cache
from servedmodel.prober import ProbeMetrics, ProbeScheduler

LOOPBACK_TARGETS = "*.svc,*.svc.cluster.local,127.0.0.1"


def pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {
            "phase": "Running",
            "podIP": ip,  # never contacted: the override maps each pod to its simulator
            "conditions": [{"type": "ContainersReady", "status": "True"}],
        },
    }


def selector(name: str) -> str:
    """The label selector of a ServedModel's engine pods, as the scheduler must ask for it."""
    return ",".join(
        (
            "app.kubernetes.io/component=engine",
            f"app.kubernetes.io/instance={name}",
            "app.kubernetes.io/name=servedmodel",
        )
    )


class Cluster:
    """The probe scheduler's view of the API server: what it reads (ServedModels in `objects`, one
    ServedModel's engine pods in `pods`) and records what it writes (status in `writes`, pod conditions in
    `gate_writes`, Events in `events`). `body`, when given, is the ServedModel a test looks at."""

    def __init__(self, body: dict[str, Any] | None = None, pods: list[dict[str, Any]] | None = None) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.body: dict[str, Any] = body or {}
        if body is not None:
            self.add(body)
        self.pods = {p["metadata"]["name"]: p for p in pods or []}
        self.writes: list[tuple[str, str, dict[str, Any]]] = []
        self.gate_writes: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str, str, str]] = []

    def resource(self, api_version: str, kind_or_plural: str) -> Resource:
        """As KubeClient's: the registered kind (the Reader asks which kind a plural is)."""
        return next(
            r
            for r in KNOWN_RESOURCES
            if r.api_version == api_version and kind_or_plural in (r.kind, r.plural)
        )

    def add(self, body: dict[str, Any]) -> dict[str, Any]:
        self.objects[(body["metadata"]["namespace"], body["metadata"]["name"])] = body
        return body

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        return self.objects.get((namespace or "", name)) if plural == "servedmodels" else None

    async def list(self, api_version: str, plural: str, namespace: str | None = None, **kw: Any) -> list[Any]:
        if plural == "events":  # a pod's start reads its Events (prober/cycle._pod_events): none here
            return []
        assert plural == "pods"
        assert kw["label_selector"] in {selector(name) for _, name in self.objects}
        return list(self.pods.values())

    async def apply_status(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        status: dict[str, Any],
        field_manager: str,
        *,
        force: bool = True,
    ) -> dict[str, Any]:
        assert field_manager == "servedmodel-probe"
        if plural == "pods":
            (cond,) = status["conditions"]
            self.gate_writes.append((name, cond))
            conds = [c for c in self.pods[name]["status"]["conditions"] if c["type"] != cond["type"]]
            self.pods[name]["status"]["conditions"] = [*conds, cond]
            _next_version(self.pods[name])
            return self.pods[name]
        key = (namespace or "", name)
        if key not in self.objects:
            raise NotFoundError(404, "NotFound", f"servedmodels {name} not found")
        self.writes.append((*key, status))
        obj = self.objects[key]
        obj["status"] = {**(obj.get("status") or {}), **status}
        _next_version(obj)
        return obj

    async def apply_status_unread(self, *args: Any, encoded: bytes | None = None, **kwargs: Any) -> None:
        assert encoded is None or json.loads(encoded) == args[4]  # the status, as the client would send it
        await self.apply_status(*args, **kwargs)

    async def create_event(self, involved: dict[str, Any], *, type: str, reason: str, message: str) -> Any:
        self.events.append((involved["kind"], involved["metadata"]["name"], reason, message))
        return {}

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.body["status"]["conditions"] if c["type"] == type_)

    def gate(self, pod_name: str) -> str | None:
        """The pod's gate status ("True"/"False"), which an assertion's diff shows with its reason."""
        conds = self.pods[pod_name]["status"]["conditions"]
        cond = next((c for c in conds if c["type"] == READINESS_GATE_CONDITION), None)
        return None if cond is None else Gate(cond)


class Gate(str):
    """A gate condition's status that compares as the plain string and reprs with its reason and message,
    so a failed `[gate(n) for n in PODS] == [...]` says why a gate is what it is."""

    def __new__(cls, cond: dict[str, Any]) -> Gate:
        gate = super().__new__(cls, str(cond["status"]))
        gate.why = f"{cond.get('reason')}: {cond.get('message')}"
        return gate

    why: str

    def __repr__(self) -> str:
        return f"{str.__repr__(self)} ({self.why})"


def served_model(**probe: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "qwen", "namespace": "ns", "generation": 2, "uid": "uid-qwen"},
        "spec": {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "servedModelName": "qwen",
            "resources": {"gpus": 1},
            "probe": {"interval": 5, "checkLimits": False, **probe},
        },
        "status": {"phase": "Ready", "readyReplicas": 3},
    }


def _next_version(obj: dict[str, Any]) -> None:
    """A write moves the object's resourceVersion on, as the API server's does (the cache keeps a write's
    answer only when it is newer than what it holds)."""
    meta = obj.get("metadata") or {}
    if str(meta.get("resourceVersion", "")).isdigit():
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)


def scheduler(
    cluster: Cluster,
    override: str | None = None,
    *,
    registry: CollectorRegistry | None = None,
    enqueue: Callable[[str, str], None] | None = None,
    cache: Cache | None = None,
    seed: int = 3,
    **config: Any,
) -> ProbeScheduler:
    """A ProbeScheduler on `cluster` (cycles driven by the test unless it starts it); `override` is
    SERVEDMODEL_ENDPOINT_OVERRIDE, `config` OperatorConfig's other fields."""
    if override is not None:
        config["endpoint_override"] = override
    # The tests' engines listen on loopback: the operator's allow-list must name it (servedmodel.access).
    config.setdefault("allowed_targets", LOOPBACK_TARGETS)
    return ProbeScheduler(
        kube=cluster,
        config=OperatorConfig(**config),
        metrics=ProbeMetrics(registry or CollectorRegistry()),
        cache=cache,
        enqueue=enqueue,
        rng=random.Random(seed),
    )


async def _chats(url: str, stop: asyncio.Event, max_tokens: int, timeout_s: float) -> None:
    """Long chats, one after the other, against `url` until `stop` is set."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        while not stop.is_set():
            body = {
                "model": "qwen",
                "messages": [{"role": "user", "content": f"a long story, part {random.random()}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            try:
                await client.post(f"{url}/v1/chat/completions", json=body)
            except httpx.HTTPError:
                await asyncio.sleep(0.1)


def kv_pressure_under_load(
    cluster: Cluster,
    url: str,
    *,
    streams: int,
    cycles: int,
    pause_s: float,
    max_tokens: int,
    timeout_s: float,
) -> dict[str, Any]:
    """The KVCachePressure condition after probe cycles of the cluster's ServedModel (its one pod on the
    engine at `url`), `pause_s` apart, while `streams` long chats load that engine: at most `cycles` of
    them (bounded: the gauges are sampled, so a cycle may miss the peak), ending at the first
    KVCachePressure=True. The load and the scheduler are stopped before it returns."""
    (pod_name,) = cluster.pods

    async def main() -> None:
        sched = scheduler(cluster, f"ns/qwen/{pod_name}={url}")
        sched.track(cluster.body)
        stop = asyncio.Event()
        load = [asyncio.create_task(_chats(url, stop, max_tokens, timeout_s)) for _ in range(streams)]
        try:
            for _ in range(cycles):
                await sched.run_cycle(("ns", "qwen"))
                if cluster.condition("KVCachePressure")["status"] == "True":
                    break
                await asyncio.sleep(pause_s)
        finally:
            stop.set()
            for t in load:
                t.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            await sched.stop()

    asyncio.run(main())
    return cluster.condition("KVCachePressure")

"""One probe cycle of one ServedModel, its I/O from start to end: read the object and its engine pods,
plan whom to probe, probe them on the ProbeLoop (probe/client.run_probe), compose the status once
(probe/compose.compose, pure), then write what it composed: the pods' readiness gates, one status patch
with the probe's field manager, and the Events. The scheduler (scheduler.py) decides when a cycle runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import httpx
from pydantic import ValidationError

from servedmodel import scaling
from servedmodel.api import API_GROUP_VERSION, PLURAL
from servedmodel.api.base import Key, Obj
from servedmodel.api.conditions import (
    ADAPTERS_SERVING,
    ENGINE_STALLED,
    KV_CACHE_PRESSURE,
    PROBE_UNRELIABLE,
    ROLLOUT_BLOCKED,
    SERVING,
)
from servedmodel.api.conditions import find as find_condition
from servedmodel.api.names import (
    LEADER_WORKER_INDEX,
    LWS_GROUP_INDEX_LABEL,
    LWS_WORKER_INDEX_LABEL,
    ROLLED_BACK_FROM_ANNOTATION,
    deployment_name,
    selector_labels,
)
from servedmodel.api.probe import ProbeSpec, ProbeStatus, RolloutStatus, rollout_verdict
from servedmodel.api.spec import ServedModelSpec
from servedmodel.api.startup import StartupTimeline
from servedmodel.config import OperatorConfig
from servedmodel.k8s import ApiError, Cache, KubeClient, NotFoundError
from servedmodel.k8s.cache import EVENT
from servedmodel.k8s.reader import Reader
from servedmodel.probe import errors, startup
from servedmodel.probe.client import (
    PROBE_LOOP_STALLED,
    MetricsReader,
    PathMemo,
    PodMetrics,
    ProbeOutcome,
    http_client,
    probe_transport,
    run_probe,
)
from servedmodel.probe.compat import Compatibility, compat_condition, scrape_and_judge
from servedmodel.probe.compose import (
    Composed,
    Cycle,
    Pods,
    compose,
    keep_rollout,
    keep_startup,
    previous_probe_status,
    previous_rollout,
)
from servedmodel.probe.endpoints import parse_override, parse_pod_overrides, pod_base_url, resolve_override
from servedmodel.probe.errors import ProbeFailure
from servedmodel.probe.group import WorkerWindow, check_worker, group_verdicts
from servedmodel.probe.loop import ProbeLoop
from servedmodel.probe.replicas import (
    TEMPLATE_CHANGED,
    PodResult,
    Window,
    aggregate,
    known_fingerprints,
    kv_pressure_verdict,
    pod_revision,
    stall_verdict,
)
from servedmodel.probe.report import parse_rfc3339
from servedmodel.probe.schedule import NOT_READY_WAIT_S, next_delay
from servedmodel.render.autoscaling import scaled_object_name
from servedmodel.wire.http11 import LeanTransport

from . import adapters
from .sources import Sources
from .telemetry import ProbeMetrics

log = logging.getLogger(__name__)

SERVED_MODEL_KIND: Final = "ServedModel"
INVALID_SPEC_WAIT_S: Final = 30.0

Enqueue = Callable[[str, str], object]  # the controller's enqueue(namespace, name)


# ---- pure pieces ---------------------------------------------------------------------------------


def read_override(value: str | None) -> str | None:
    """SERVEDMODEL_ENDPOINT_OVERRIDE's text: the value, or with '@/path' that file's content, read at
    every cycle so a test can map pods that did not exist when the operator started (lines count as
    commas; '#' starts a comment line). An unreadable file overrides nothing."""
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    lines = (line.strip() for line in text.splitlines())
    return ",".join(line for line in lines if line and not line.startswith("#"))


def containers_ready(pod: Mapping[str, Any]) -> bool:
    """Running, with an IP and its containers ready (the engine's /health readiness probe passed)."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    ready = find_condition(status.get("conditions"), "ContainersReady")
    return ready is not None and ready.get("status") == "True"


def encode_patch(patch: Mapping[str, Any]) -> bytes:
    """A status patch as Model holds it (compact JSON, keys in the order compose wrote them): two patches
    are the same write when their encodings are equal."""
    return json.dumps(patch, separators=(",", ":"), ensure_ascii=False).encode()


def serving_of(conditions: Any) -> tuple[str, str] | None:
    """(status, reason) of a Serving condition in a conditions list."""
    serving = find_condition(conditions, SERVING)
    return None if serving is None else (str(serving.get("status")), str(serving.get("reason")))


# ---- what a cycle works on -----------------------------------------------------------------------


@dataclass
class Model:
    """One tracked ServedModel: the scheduler's (due, placed, task) and what its cycles last saw and wrote."""

    key: Key
    body: Obj | None = None  # the last body seen (events, cache, or the write's answer)
    due: float = 0.0
    placed: bool = False  # its first due time has been chosen
    task: asyncio.Task[None] | None = None
    # What its cycles last wrote, held once and as its JSON (`last_patch()` decodes it): status.probe is
    # parsed from it when needed (compose.previous_probe_status). As a dict it took ~11.9 KB, as JSON
    # ~2.6 KB (one ServedModel against the simulator): ~90 MB of the 1 GB at 10,000 ServedModels, for
    # ~35 µs to decode it once a cycle and ~40 µs to encode what was written.
    last_patch_json: bytes | None = None
    cycles: int = 0
    removed: bool = False
    windows: dict[str, Window] = field(default_factory=dict)  # pod -> its figures at the last cycle
    # a multi-node group's worker pod -> its /metrics at its last check (probe/group.py)
    worker_windows: dict[str, WorkerWindow] = field(default_factory=dict)
    paths: dict[str, PathMemo] = field(default_factory=dict)  # pod ("" external) -> its full path's facts
    adapter_paths: dict[str, PathMemo] = field(default_factory=dict)  # "<pod>/<adapter>" -> the same
    # pod -> (its incarnation and whether adapters are declared, the verdict on its /metrics): judged once
    metrics_compat: dict[str, tuple[str, Compatibility]] = field(default_factory=dict)
    rotation: int = 0  # where the next bounded rotation over many pods starts
    starts: dict[str, startup.StartTrack] = field(default_factory=dict)  # pod -> its start, as probed

    def last_patch(self) -> dict[str, Any] | None:
        """What its cycles last wrote (a fresh dict: the caller may keep parts of it in a new patch)."""
        return None if self.last_patch_json is None else json.loads(self.last_patch_json)


@dataclass(frozen=True)
class _Worker:
    """A worker pod of a multi-node group: where its engine answers (None: nowhere to ask), its readiness."""

    name: str
    url: str | None
    ready: bool


@dataclass(frozen=True)
class _PodTarget:
    name: str
    url: str
    pod: Obj
    workers: tuple[_Worker, ...] = ()  # spec.workers: the other pods of this leader's group


@dataclass(frozen=True)
class _Plan:
    """The pods of one managed cycle: whom to probe now, who exists, why nobody (when so)."""

    targets: list[_PodTarget]
    eligible: list[str]  # pods that can be probed (containers ready, an address)
    replicas: int  # engine pods that exist, ready or not
    pods: dict[str, Obj]
    why: str = ""


@dataclass
class CycleResult:
    """What one cycle did (tests and the log read it)."""

    probed: bool
    written: bool = False
    outcome: ProbeOutcome | None = None
    status: ProbeStatus | None = None
    next_delay_s: float = 0.0
    skipped: str = ""  # why nothing was probed: disabled, not-ready, invalid-spec, gone, deleting
    pods: list[PodResult] = field(default_factory=list)


def path_key(spec: ServedModelSpec) -> str:
    """What a full path's facts hold for on one engine: the probe spec and the model name it asks for."""
    return f"{spec.resolved_served_model_name} {spec.probe.model_dump_json()}"


def pod_incarnation(pod: Mapping[str, Any]) -> str:
    """The pod and its containers' restarts: another engine process behind the same name is another."""
    restarts = sum(
        int(c.get("restartCount") or 0) for c in (pod.get("status") or {}).get("containerStatuses") or []
    )
    return f"{(pod.get('metadata') or {}).get('uid')}/{restarts}"


def memo_of(model: Model, pod: str, key: str) -> PathMemo:
    """The model's PathMemo for `pod`, new when what it was learned for (`key`) changed."""
    memo = model.paths.get(pod)
    if memo is None or memo.key != key:
        memo = model.paths[pod] = PathMemo(key)
    return memo


# Probe failures that mean no engine answered at that address: no /metrics to judge there either.
UNREACHABLE = frozenset(
    {
        errors.CONNECTION_REFUSED,
        errors.CONNECTION_FAILED,
        errors.CONNECT_TIMEOUT,
        errors.DNS_FAILURE,
        errors.ENGINE_UNHEALTHY,
        errors.SECRET_UNAVAILABLE,
    }
)


# ---- the cycle -----------------------------------------------------------------------------------


@dataclass
class CycleRunner:
    """Runs cycles (`run`) for a scheduler; it holds what they share: the clients, the HTTP pool, the
    ProbeLoop and the metrics. `forget(namespace, name)` is the scheduler's: a cycle that finds its
    ServedModel gone or deleting stops its tracking."""

    kube: KubeClient  # tests give fakes with the methods used: get, list, apply_status, create_event
    config: OperatorConfig
    metrics: ProbeMetrics
    reader: Reader
    cache: Cache | None
    enqueue: Enqueue | None
    forget: Callable[[str, str], None]
    probe_loop: ProbeLoop
    rng: random.Random
    clock: Callable[[], float] = time.monotonic
    sources: Sources = field(init=False)
    _transport: httpx.AsyncBaseTransport | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.sources = Sources(self.reader, self.config)

    def _pool(self) -> httpx.AsyncBaseTransport:
        if self._transport is None:
            self._transport = probe_transport()
        return self._transport

    def _client(self, spec: ProbeSpec) -> httpx.AsyncClient:
        """A client with this model's limits over the one connection pool."""
        pool = self._pool()
        return http_client(spec, _Shared(pool), lean=pool if isinstance(pool, LeanTransport) else None)

    def closers(self) -> list[Any]:
        """The clients to close on the probe loop, whose connections they hold (the scheduler's stop)."""
        transport, self._transport = self._transport, None
        return [*([transport.aclose] if transport is not None else []), *self.sources.closers()]

    async def _body(self, model: Model) -> Obj | None:
        """The ServedModel as it is now (the reader's); without a cache, as tracked or last written."""
        if self.cache is None and model.body is not None:
            return model.body
        return await self.reader.get(API_GROUP_VERSION, PLURAL, *model.key)

    async def run(self, model: Model) -> CycleResult:
        """One probe cycle of `model`."""
        namespace, name = model.key
        body = await self._body(model)
        if body is None:
            self.forget(namespace, name)
            return CycleResult(False, skipped="gone")
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            self.forget(namespace, name)
            return CycleResult(False, skipped="deleting")
        try:
            spec = ServedModelSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return CycleResult(False, skipped="invalid-spec", next_delay_s=INVALID_SPEC_WAIT_S)
        probe = spec.probe
        status = dict(body.get("status") or {})
        if not probe.enabled:
            return CycleResult(False, skipped="disabled", next_delay_s=float(probe.interval))
        if scaling.scaled_to_zero(spec, status):
            return await self._at_zero(model, body, status)
        generation = (body.get("metadata") or {}).get("generation")
        last = model.last_patch()  # decoded once for the whole cycle
        probed: list[PodResult] = []
        started: list[StartupTimeline] = []
        plan: _Plan | None = None
        previous: ProbeStatus | None = None  # status.probe as the cycle found it (parsed once)
        synced: dict[str, adapters.PodAdapters] | None = None
        if spec.external:
            out = await self.probe_external(model, spec)
        else:
            plan = await self._plan(model, spec)
            model.paths = {pod: m for pod, m in model.paths.items() if pod in plan.pods}
            model.worker_windows = {p: w for p, w in model.worker_windows.items() if p in plan.pods}
            model.metrics_compat = {p: v for p, v in model.metrics_compat.items() if p in plan.pods}
            model.starts = {p: t for p, t in model.starts.items() if p in plan.pods}
            previous = previous_probe_status(status, last)
            if plan.targets:
                rollout = previous_rollout(status, last)
                probed = await self._probe_pods(model, spec, plan.targets, rollout)
                started = await self._startups(model, spec, probed, plan, previous)
                out = aggregate(probed)
                if spec.adapters:  # loaded, unloaded and probed on the pods that serve (prober/adapters.py)
                    targets = [adapters.Target(t.name, t.url, pod_incarnation(t.pod)) for t in plan.targets]
                    http = self._client(spec.probe)
                    synced = await adapters.sync_pods(
                        http,
                        self.sources,
                        self.probe_loop,
                        model.key,
                        spec,
                        targets,
                        probed,
                        model.adapter_paths,
                    )
            elif previous is not None and previous.reason != errors.NO_READY_ENDPOINTS:
                # It served before and now no pod can be probed: say so once, then wait quietly.
                now = datetime.now(UTC)
                failure = ProbeFailure(errors.NO_READY_ENDPOINTS, plan.why)
                out = ProbeOutcome(endpoint="", started=now, ended=now, failure=failure)
            else:
                return CycleResult(False, skipped="not-ready", next_delay_s=NOT_READY_WAIT_S)
        model.cycles += 1
        self.metrics.record(namespace, name, out)
        pods = None
        if plan is not None:
            pods = Pods(
                probed, plan.eligible, plan.replicas, plan.pods, self._rolled_back_from(namespace, name)
            )
        now = datetime.now(UTC)
        share = None
        if plan is not None:  # `previous` is the one parsed above: nothing was written since
            conds = status.get("conditions")
            share = adapters.compose_adapters(spec, synced, previous, plan.eligible, conds, generation, now)
        compatible = None
        if plan is not None and spec.probe.metrics_source.type != "prometheus":
            verdicts = {pod: v for pod, (_, v) in model.metrics_compat.items()}
            stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
            conds = status.get("conditions")
            compatible = compat_condition(verdicts, plan.eligible, conds, generation, stamp)
        cycle = Cycle(out, spec, status, generation, now, last, pods, share, previous=previous)
        composed = compose(dataclasses.replace(cycle, metrics_compatible=compatible, startups=started))
        for start in composed.started:
            self.metrics.record_start(namespace, name, start)
        new, patch = composed.status, composed.patch
        log.info(
            "probe %s/%s %s: %s",
            namespace,
            name,
            new.result,
            new.message if new.result == "Success" else f"{new.reason}: {new.message}",
        )
        if new.window is not None and new.window.ttft_p95_ms is not None:
            self.metrics.ttft_p95.labels(namespace, name).set(new.window.ttft_p95_ms / 1000)
        result = CycleResult(
            True,
            outcome=out,
            status=new,
            next_delay_s=next_delay(probe.interval, new.consecutive_failures, self.rng),
            pods=probed,
        )
        if probed and plan is not None:
            await self._after_pods(model, body, probed, plan, status, previous, composed, last)
        encoded = encode_patch(patch)
        if encoded == model.last_patch_json:
            return result
        before = serving_of(status.get("conditions"))
        if last is not None:
            before = serving_of(last.get("conditions")) or before
        after = serving_of(patch["conditions"])
        # The rollout verdict the reconciler acts on (reconcile.rollback): a change enqueues it, as a
        # Serving change does (our write goes into the cache first, so the watch event shows no change).
        said = rollout_verdict(status.get("rollout"))
        if last is not None and "rollout" in last:
            said = rollout_verdict(last["rollout"])
        rollout_changed = said != rollout_verdict(patch.get("rollout"))
        reconciler_reads = before != after or rollout_changed
        if await self._write(model, body, patch, through=reconciler_reads, encoded=encoded):
            result.written = True
            if reconciler_reads:
                self._enqueue(model.key)
        return result

    async def _write(
        self,
        model: Model,
        body: Mapping[str, Any],
        patch: dict[str, Any],
        *,
        through: bool = True,
        encoded: bytes | None = None,
    ) -> bool:
        """The cycle's one status write (server-side apply, the probe's field manager); False when the
        ServedModel was forgotten meanwhile, is gone (404: it leaves the cache too) or the write failed.
        `through`: its answer into the cache before the caller enqueues the reconciler, which must read
        it; else, where a watch feeds the cache, the answer is not decoded (the write's watch event
        brings the object, stored and routed there, once; until then the next cycle reads what it wrote
        from model.last_patch: compose.previous_probe_status). `encoded`: encode_patch(patch), if made."""
        namespace, name = model.key
        if model.removed:
            return False  # forgotten (deleted) while the probe ran: write nothing
        unread = not through and self.cache is not None and self.cache.tracks(SERVED_MODEL_KIND)
        encoded = encode_patch(patch) if encoded is None else encoded
        try:
            if unread:
                await self.kube.apply_status_unread(
                    API_GROUP_VERSION,
                    PLURAL,
                    namespace,
                    name,
                    patch,
                    self.config.probe_field_manager,
                    encoded=encoded,  # the JSON it holds as its last patch: the body's, not encoded again
                )
                written = None
            else:
                written = await self.kube.apply_status(
                    API_GROUP_VERSION, PLURAL, namespace, name, patch, self.config.probe_field_manager
                )
        except NotFoundError:
            self._gone(namespace, name, body)
            return False
        except ApiError as exc:
            log.warning("probe status write of %s/%s failed: %s %s", namespace, name, exc.status, exc.reason)
            return False
        model.last_patch_json = encoded
        if isinstance(written, dict) and written.get("metadata"):
            # Into the cache, whose copy the next cycle reads; the Model keeps it only without a cache
            # (_body). A copy kept here outlived the cache's next event of this ServedModel: a second
            # body per ServedModel until the next write. The answer itself carries managedFields.
            body_written = self._write_through(SERVED_MODEL_KIND, written)
            if self.cache is None:
                model.body = body_written
        self.metrics.status_writes.labels(namespace, name).inc()
        return True

    def _gone(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """A status write for `body` answered 404: that ServedModel is gone, whatever the watch has said
        so far. It leaves the cache too, or the next sync from the cache would track (and probe) it
        again; a newer object of the same name already in the cache stays, and the next sync tracks it."""
        self.forget(namespace, name)
        if self.cache is not None:
            self.cache.evict(SERVED_MODEL_KIND, body)

    def _enqueue(self, key: Key) -> None:
        if self.enqueue is not None:
            self.enqueue(*key)

    # ---- managed mode: every engine pod at its own address -----------------------------------

    async def _plan(self, model: Model, spec: ServedModelSpec) -> _Plan:
        """Which pods this cycle probes: every pod whose containers are ready (the engine's /health
        passed: the readiness gate is what stands between it and traffic), at most
        probe_max_pods_per_cycle of them, rotating through the rest cycle by cycle."""
        namespace, name = model.key
        try:
            pods = await self.reader.list("v1", "pods", namespace, selector_labels(name))
        except ApiError as exc:
            return _Plan([], [], 0, {}, f"listing engine pods: {exc.status} {exc.reason}")
        live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        existing = sorted(str(p["metadata"]["name"]) for p in live)
        text = read_override(self.config.endpoint_override)
        if text is None and self.config.endpoint_override:
            # An override file that cannot be read must not fall back to the pods' real addresses.
            return _Plan([], [], len(existing), {}, "the endpoint override file cannot be read")
        per_pod = parse_pod_overrides(text, namespace, name)
        model_url = None if per_pod else parse_override(text, namespace, name)
        # With an override configured, the engines are where it says or nowhere: a pod it does not map
        # (yet: a test's mapper writes the file after the pod exists) is not probed at its own address,
        # which exists nowhere (kwok) and must not be asked.
        overridden = bool(self.config.endpoint_override)
        targets: list[_PodTarget] = []
        unmapped: list[str] = []

        def address(pod: Obj) -> str | None:
            url = per_pod.get(str(pod["metadata"]["name"])) if per_pod else model_url
            if url is None and not overridden:
                url = pod_base_url(pod)
            return url

        groups: dict[str, list[Obj]] = {}
        if spec.workers is not None:
            # A multi-node group: its leader (worker-index 0) is probed, its workers checked with it, and
            # `existing` counts groups (the replicas), not pods.
            for pod in live:
                labels = pod["metadata"].get("labels") or {}
                if labels.get(LWS_WORKER_INDEX_LABEL, LEADER_WORKER_INDEX) != LEADER_WORKER_INDEX:
                    groups.setdefault(str(labels.get(LWS_GROUP_INDEX_LABEL)), []).append(pod)
            live_leaders = [
                p
                for p in live
                if (p["metadata"].get("labels") or {}).get(LWS_WORKER_INDEX_LABEL) == LEADER_WORKER_INDEX
            ]
            existing = sorted(str(p["metadata"]["name"]) for p in live_leaders)
        else:
            live_leaders = live
        for pod in sorted(live_leaders, key=lambda p: str(p["metadata"]["name"])):
            pod_name = str(pod["metadata"]["name"])
            if not containers_ready(pod):
                continue
            url = address(pod)
            if url:
                group = str((pod["metadata"].get("labels") or {}).get(LWS_GROUP_INDEX_LABEL))
                members = sorted(groups.get(group, []), key=lambda p: str(p["metadata"]["name"]))
                # A vLLM worker runs headless: no HTTP to ask, only its readiness.
                headless = spec.engine.kind == "vllm"
                workers = tuple(
                    _Worker(str(w["metadata"]["name"]), None if headless else address(w), containers_ready(w))
                    for w in members
                )
                targets.append(_PodTarget(pod_name, url, pod, workers))
            elif overridden:
                unmapped.append(pod_name)
        eligible = [t.name for t in targets]
        why = f"no engine pod of {len(existing)} has its containers ready" if existing else "no engine pod"
        if unmapped and not targets:
            why = f"the endpoint override maps no ready engine pod ({', '.join(unmapped[:3])})"
        cap = max(1, self.config.probe_max_pods_per_cycle)
        if len(targets) > cap:
            start = model.rotation % len(targets)
            targets = (targets[start:] + targets[:start])[:cap]
            model.rotation = start + cap
        pods_by_name = {str(p["metadata"]["name"]): p for p in live}
        return _Plan(targets, eligible, len(existing), pods_by_name, why)

    async def _probe_pods(
        self,
        model: Model,
        spec: ServedModelSpec,
        targets: list[_PodTarget],
        rollout: RolloutStatus | None,
    ) -> list[PodResult]:
        """Probe the pods concurrently, each with its own /metrics; verdicts from this and the last cycle.
        With the gate on, the first pod of a revision status.rollout has no template fingerprint of
        also takes one."""
        namespace, name = model.key
        fingerprint = [False] * len(targets)
        if spec.probe.readiness_gate:
            seen = set(known_fingerprints(rollout))
            for i, t in enumerate(targets):
                revision = pod_revision(t.pod)
                if revision is not None and revision not in seen:
                    fingerprint[i] = True
                    seen.add(revision)
        served = spec.resolved_served_model_name
        async with self._client(spec.probe) as http:
            try:
                api_key = await self.sources.api_key(model.key, spec)
                prometheus = None
                if spec.probe.metrics_source.type == "prometheus":
                    # Prometheus answers for the whole ServedModel, not per pod: read once, around the
                    # first pod's probe (the others have no server figures then).
                    prometheus = await self.sources.metrics_reader(
                        http, model.key, spec, resolve_override(targets[0].url)
                    )
            except ProbeFailure as f:
                self.sources.redacted(model.key)  # nothing was sent; what was read is dropped
                now = datetime.now(UTC)
                return [
                    PodResult(t.name, t.url, ProbeOutcome(endpoint=t.url, started=now, ended=now, failure=f))
                    for t in targets
                ]

            probe_key = path_key(spec)

            async def one(i: int, t: _PodTarget) -> ProbeOutcome:
                reader: MetricsReader | None
                if prometheus is not None:
                    reader = prometheus if i == 0 else None
                else:
                    reader = PodMetrics(http, [t.url], served)
                out = await self.probe_loop.submit(
                    run_probe(
                        http,
                        resolve_override(t.url),
                        spec.probe,
                        model=served,
                        api_key=api_key,
                        metrics=reader,
                        fingerprint=fingerprint[i],
                        memo=memo_of(model, t.name, f"{pod_incarnation(t.pod)} {probe_key}"),
                    )
                )
                unreachable = out.failure is not None and out.failure.reason in UNREACHABLE
                if prometheus is None and not unreachable:
                    # MetricsCompatible: one whole /metrics per engine incarnation, once the engine answers
                    # the probe at all (retried in a later cycle when it could not be read).
                    key = f"{pod_incarnation(t.pod)} {bool(spec.adapters)}"
                    if model.metrics_compat.get(t.name, ("", None))[0] != key:
                        base = resolve_override(t.url).base_url
                        judging = scrape_and_judge(http, base, adapters=bool(spec.adapters))
                        verdict = await self.probe_loop.submit(judging)
                        model.metrics_compat[t.name] = (key if verdict.error is None else "", verdict)
                return out

            outcomes = await asyncio.gather(*(one(i, t) for i, t in enumerate(targets)))
            workers = [w for t in targets for w in t.workers]
            checks = await asyncio.gather(
                *(
                    self.probe_loop.submit(
                        check_worker(
                            http, w.name, resolve_override(w.url).base_url if w.url else None, w.ready, served
                        )
                    )
                    for w in workers
                )
            )
        outcomes = self.sources.redacted(model.key, *outcomes)
        checked = {c.name: c for c in checks}
        mono = self.clock()
        results: list[PodResult] = []
        for t, out in zip(targets, outcomes, strict=True):
            previous = model.windows.get(t.name)
            r = PodResult(t.name, t.url, out)
            r.stalled = stall_verdict(out, mono, previous)
            r.kv_pressure = kv_pressure_verdict(out, previous)
            if t.workers:
                group = [checked[w.name] for w in t.workers]
                r.stalled, r.worker_failure = group_verdicts(group, model.worker_windows, r.stalled)
                r.workers = tuple(w.name for w in t.workers)
                for c in group:
                    if c.metrics is not None:
                        model.worker_windows[c.name] = WorkerWindow(c.metrics, c.at)
            if out.after is not None:
                model.windows[t.name] = Window(out.after, mono)
            results.append(r)
            self.metrics.pod_probes.labels(namespace, name, r.reason).inc()
        return results

    async def _startups(
        self,
        model: Model,
        spec: ServedModelSpec,
        probed: list[PodResult],
        plan: _Plan,
        previous: ProbeStatus | None,
    ) -> list[StartupTimeline]:
        """The starts this cycle ended (a pod's first real token, probe/startup.py), each with its pod's
        Events read once (its image pulled), and, for a model that scales to zero, its ScaledObject's
        (KEDA's scale from 0: the pod is a wake). A pod the status already calls serving at first sight
        is not a start this scheduler saw."""
        namespace, name = model.key
        auto = spec.autoscaling
        served = {p.name for p in (previous.pods or []) if p.serving == "True"} if previous else set()
        ended: list[StartupTimeline] = []
        for r in probed:
            pod = plan.pods.get(r.name)
            if pod is None:
                continue
            before = model.starts.get(r.name)
            track, done = startup.observe(before, pod_incarnation(pod), r.outcome, r.name in served)
            model.starts[r.name] = track
            if done and track.first_token_at is not None:
                events = await self._pulled(namespace, str((pod.get("metadata") or {}).get("uid") or ""))
                activated = None
                created = parse_rfc3339((pod.get("metadata") or {}).get("creationTimestamp"))
                if auto is not None and auto.scale_to_zero and created is not None:
                    keda = await self._events(
                        namespace,
                        {
                            "involvedObject.kind": "ScaledObject",
                            "involvedObject.name": scaled_object_name(name),
                        },
                    )
                    activated = startup.wake_activation(keda, created)
                start = startup.timeline(pod, events, track.healthy_at, track.first_token_at, activated)
                if start is not None:
                    ended.append(start)
        return ended

    async def _pulled(self, namespace: str, pod_uid: str) -> list[Obj]:
        """A pod's Pulled Events: from the cache where the Events watch feeds it (watches.py), else
        listed (the events of a namespace are read from etcd, all of them, for each such list)."""
        if self.cache is not None and self.cache.tracks(EVENT):
            return self.cache.events_about(pod_uid) if pod_uid else []
        return await self._events(namespace, {"involvedObject.uid": pod_uid})

    async def _events(self, namespace: str, about: Mapping[str, Any]) -> list[Obj]:
        """The Events about one object (one list, by field selector); none where they cannot be read."""
        if not all(about.values()):
            return []
        try:
            found = await self.kube.list("v1", "events", namespace, field_selector=dict(about))
        except ApiError as exc:
            log.debug("events in %s about %s: %s %s", namespace, dict(about), exc.status, exc.reason)
            return []
        return list(found)

    async def _after_pods(
        self,
        model: Model,
        body: Obj,
        probed: list[PodResult],
        plan: _Plan,
        status: Mapping[str, Any],
        previous: ProbeStatus | None,
        composed: Composed,
        last: Mapping[str, Any] | None,
    ) -> None:
        """The composed readiness-gate writes (pods/status), and Events: for every pod whose Serving
        changed, for EngineStalled / KVCachePressure / RolloutBlocked / ProbeUnreliable turning True, an
        adapter that stops serving (AdaptersServing's reason), and TemplateChanged."""
        namespace, name = model.key
        if model.removed:
            return
        before = {p.name: p.serving for p in (previous.pods or [])} if previous is not None else {}
        for r in probed:
            pod = plan.pods.get(r.name)
            if pod is None:
                continue
            serving = "True" if r.serving else "False"
            if before.get(r.name) != serving:
                self.metrics.pod_transitions.labels(namespace, name, serving, r.reason).inc()
                await self._event(
                    {"apiVersion": "v1", "kind": "Pod", "metadata": pod.get("metadata") or {}},
                    "Normal" if r.serving else "Warning",
                    "ReplicaServing" if r.serving else "ReplicaNotServing",
                    f"{name}: {r.reason}: {r.message}"
                    if not r.serving
                    else f"{name}: a real chat completion succeeded",
                )
        for pod_name, cond in composed.gates.items():
            try:
                written_pod = await self.kube.apply_status(
                    "v1", "pods", namespace, pod_name, {"conditions": [cond]}, self.config.probe_field_manager
                )
                plan.pods[pod_name] = self._write_through("Pod", written_pod)
                self.metrics.gate_writes.labels(namespace, name, cond["status"]).inc()
            except ApiError as exc:
                log.warning("readiness gate of pod %s/%s: %s %s", namespace, pod_name, exc.status, exc.reason)
        if composed.template_changed is not None:
            await self._event(body, "Normal", TEMPLATE_CHANGED, composed.template_changed)
        old_conds = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}
        if last is not None:  # the cycle's last written patch (Model.last_patch)
            old_conds.update({c.get("type"): c for c in last.get("conditions") or []})
        for c in composed.patch["conditions"]:
            was = (old_conds.get(c["type"]) or {}).get("status")
            # a stall of the probe's own loop alone is the machine's noise: in status, not an Event
            warned = c["type"] in (ENGINE_STALLED, KV_CACHE_PRESSURE, ROLLOUT_BLOCKED) or (
                c["type"] == PROBE_UNRELIABLE and c["reason"] != PROBE_LOOP_STALLED
            )
            if warned and c["status"] == "True" and was != "True":
                await self._event(body, "Warning", c["type"], c["message"])
            elif c["type"] == ADAPTERS_SERVING and adapters.started_failing(previous, composed.status):
                await self._event(body, "Warning", c["reason"], c["message"])  # an adapter stopped serving
        self.metrics.stalled.labels(namespace, name).set(sum(1 for r in probed if r.stalled))
        self.metrics.kv_pressure.labels(namespace, name).set(sum(1 for r in probed if r.kv_pressure))

    def _rolled_back_from(self, namespace: str, name: str) -> str | None:
        """The engine Deployment's rolled-back-from annotation (reconcile.rollback writes it)."""
        deployment = self.cache.get("Deployment", namespace, deployment_name(name)) if self.cache else None
        annotations = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
        value = annotations.get(ROLLED_BACK_FROM_ANNOTATION)
        return str(value) if value else None

    def _write_through(self, kind: str, obj: Obj) -> Obj:
        """Our write's answer into the cache, so the next cycle does not act on a copy older than what
        it wrote; returns the cache's (slim) copy, or `obj` without a cache."""
        if self.cache is None or not obj.get("metadata"):
            return obj
        self.cache.upsert(kind, obj)
        meta = obj["metadata"]
        return self.cache.get(kind, str(meta.get("namespace") or ""), str(meta.get("name"))) or obj

    async def _event(self, involved: Obj, type_: str, reason: str, message: str) -> None:
        try:
            await self.kube.create_event(involved, type=type_, reason=reason, message=message)
        except ApiError as exc:
            log.debug("event %s: %s %s", reason, exc.status, exc.reason)

    async def _at_zero(self, model: Model, body: Mapping[str, Any], status: Obj) -> CycleResult:
        """Scaled to zero by the autoscaler: no chat (it would be traffic, and finds no engine), Serving
        Unknown once, and no TTFT p95 series (a stale one would keep a KEDA trigger active)."""
        namespace, name = model.key
        with contextlib.suppress(KeyError):
            self.metrics.ttft_p95.remove(namespace, name)
        result = CycleResult(False, skipped="scaled-to-zero", next_delay_s=NOT_READY_WAIT_S)
        said = ("Unknown", scaling.SCALED_TO_ZERO)
        last = model.last_patch()
        if model.removed or said in (
            serving_of(status.get("conditions")),
            serving_of((last or {}).get("conditions")),
        ):
            return result
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        generation = (body.get("metadata") or {}).get("generation")
        patch: dict[str, Any] = {
            "conditions": scaling.scaled_to_zero_conditions(status.get("conditions"), generation, now)
        }
        probe = (last or {}).get("probe", status.get("probe"))
        if isinstance(probe, dict):
            patch["probe"] = probe  # kept as last written: server-side apply drops what we omit
        keep_rollout(status, last, patch)
        keep_startup(status, last, patch)
        if await self._write(model, body, patch):
            result.written = True
            self._enqueue(model.key)
        return result

    # ---- external mode: one endpoint, spec.endpoint --------------------------------------------

    async def probe_external(self, model: Model, spec: ServedModelSpec) -> ProbeOutcome:
        """One external-mode cycle's measurements; secret and allow-list refusals are outcomes too."""
        key = model.key
        async with self._client(spec.probe) as http:
            try:
                target = self.sources.target(key, spec)
                api_key = await self.sources.api_key(key, spec)
                metrics = await self.sources.metrics_reader(http, key, spec, target)
            except ProbeFailure as f:
                self.sources.redacted(key)
                now = datetime.now(UTC)
                return ProbeOutcome(endpoint="", started=now, ended=now, failure=f)
            out = await self.probe_loop.submit(
                run_probe(
                    http,
                    target,
                    spec.probe,
                    model=spec.resolved_served_model_name,
                    api_key=api_key,
                    metrics=metrics,
                    memo=memo_of(model, "", f"{target.base_url} {path_key(spec)}"),
                )
            )
            [out] = self.sources.redacted(key, out)
            return out


class _Shared(httpx.AsyncBaseTransport):
    """The runner's connection pool, shared by every cycle's client and closed only by the runner."""

    def __init__(self, pool: httpx.AsyncBaseTransport) -> None:
        self._pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._pool.handle_async_request(request)

    async def aclose(self) -> None:
        return None

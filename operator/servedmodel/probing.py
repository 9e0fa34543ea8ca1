"""The operator-wide probe scheduler: one asyncio task that probes every ServedModel's request path.

No kopf here (handlers/probe.py starts and stops it: on the leader, or on every replica with probe
sharding, where `owns` picks this replica's share). One task for all models, not one per object.

- Due times: each ServedModel has its own, spec.probe.interval apart and jittered ±10 %; a model seen
  for the first time is placed at a random point of its first interval (continuing from its last
  status.probe.lastProbeTime after an operator restart), so a thousand ServedModels never fire
  together.
- Concurrency: at most `OperatorConfig.probe_concurrency` cycles run at once; a due model waits for a
  slot, earliest due first. One namespace holds at most its share of the slots (`namespace_share`,
  default max(1, slots // 4)): 16 models of one tenant pointed at a listener that never answers leave the
  other tenants' probes on time. A cycle's requests all fit in probe.client.cycle_budget_s.
- The probe's clock: each cycle's requests (door, tokenize, /metrics, the timed streams) run on a
  ProbeLoop (probe/loop.py), an event loop in its own thread that does nothing else, so the main loop's
  watch events, reconciles and status writes do not become "engine latency". The scheduler, Secrets and
  every Kubernetes request stay on the main loop. Both loops' lag is exported
  (servedmodel_event_loop_lag_seconds).
- Backoff: a model whose cycles fail is probed less often (probe/schedule.next_delay, capped at four
  intervals); its backoff is its own and delays no other model.
- One status write per probed cycle (server-side apply of what probe/compose.compose composed:
  status.probe, status.rollout and the probe's conditions, with the probe's field manager), after the
  pods' readiness-gate writes it also composed. lastProbeTime moves every cycle, so every probed cycle
  writes; a cycle that probes nothing (probing off, no engine ready, a repeat of NoReadyEndpoints)
  writes nothing, and none is written after the object got a deletionTimestamp or went away.
- When a write changes the Serving condition, the ServedModel is enqueued in the controller's work queue
  so the reconciler's phase and Degraded follow at once (the probe never writes the phase).
- `stop()` cancels every in-flight cycle and waits for it: nothing is left running or half-written.

Reads go through k8s/reader.Reader: the ServedModel and its pods from the watch-fed cache when one is
given, Secrets (the engine's API key, a Prometheus token) from the API server (no informer feeds them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import heapq
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol, TypeVar, cast

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ValidationError

from . import access, scaling
from .api import API_GROUP_VERSION, PLURAL
from .api.base import Key, Obj
from .api.conditions import ENGINE_STALLED, KV_CACHE_PRESSURE, PROBE_UNRELIABLE, ROLLOUT_BLOCKED, SERVING
from .api.conditions import find as find_condition
from .api.names import ROLLED_BACK_FROM_ANNOTATION, deployment_name, selector_labels
from .api.probe import ProbeSpec, ProbeStatus, RolloutStatus, rollout_verdict
from .api.spec import ServedModelSpec
from .config import OperatorConfig
from .k8s import ApiError, Cache, KubeClient, NotFoundError
from .k8s.reader import Reader
from .probe import errors
from .probe.client import (
    PROBE_LOOP_STALLED,
    MetricsReader,
    PodMetrics,
    ProbeOutcome,
    http_timeout,
    run_probe,
)
from .probe.compose import (
    Composed,
    Cycle,
    Pods,
    compose,
    keep_rollout,
    previous_probe_status,
    previous_rollout,
)
from .probe.endpoints import (
    ProbeTarget,
    parse_override,
    parse_pod_overrides,
    pod_base_url,
    resolve_external,
    resolve_override,
)
from .probe.errors import ProbeFailure
from .probe.loop import GC_WATCH, MAIN_WATCH_PERIOD_S, LoopWatch, ProbeLoop
from .probe.prometheus import PrometheusMetrics
from .probe.replicas import (
    TEMPLATE_CHANGED,
    PodResult,
    Window,
    aggregate,
    known_fingerprints,
    kv_pressure_verdict,
    pod_revision,
    stall_verdict,
)
from .probe.report import parse_rfc3339, publishable_figures
from .probe.schedule import JITTER, NOT_READY_WAIT_S, next_delay

log = logging.getLogger(__name__)


SERVED_MODEL_KIND: Final = "ServedModel"
INVALID_SPEC_WAIT_S: Final = 30.0
CACHE_SYNC_S: Final = 1.0  # how often the loop compares its ServedModels with the cache's
IDLE_TICK_S: Final = 5.0  # the loop wakes at least this often (new keys from the cache, stop requests)
# A namespace's share of the probe slots: max(1, probe_concurrency // NAMESPACE_SHARE_DIVISOR) cycles at
# once (OperatorConfig has no field for it yet; ProbeScheduler.namespace_share overrides it).
NAMESPACE_SHARE_DIVISOR: Final = 4


Enqueue = Callable[[str, str], object]


API_KEY_FIELD: Final = "spec.engine.apiKeySecretRef"
ScrubT = TypeVar("ScrubT")


def _scrub(value: ScrubT, secrets: frozenset[str]) -> ScrubT:
    """`value` with every string inside it (dataclasses, pydantic models, lists, dicts, a ProbeFailure)
    redacted of `secrets` (servedmodel.access.redact); frozen dataclasses are copied, others changed."""
    out: Any
    if isinstance(value, str):
        out = access.redact(value, secrets)
    elif isinstance(value, ProbeFailure):
        out = ProbeFailure(value.reason, access.redact(value.message, secrets))
    elif isinstance(value, BaseModel):
        out = value.model_copy(
            update={k: _scrub(getattr(value, k), secrets) for k in type(value).model_fields}
        )
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _scrub(getattr(value, f.name), secrets) for f in dataclasses.fields(value)}
        if getattr(getattr(value, "__dataclass_params__", None), "frozen", False):
            init = {f.name for f in dataclasses.fields(value) if f.init}
            out = dataclasses.replace(value, **{k: v for k, v in changes.items() if k in init})
        else:
            for k, v in changes.items():
                setattr(value, k, v)
            out = value
    elif isinstance(value, list):
        out = [_scrub(v, secrets) for v in value]
    elif isinstance(value, tuple):
        out = tuple(_scrub(v, secrets) for v in value)
    elif isinstance(value, dict):
        out = {_scrub(k, secrets): _scrub(v, secrets) for k, v in value.items()}
    else:
        out = value
    return cast(ScrubT, out)


class _KeyRef(Protocol):
    """A Secret key reference (spec.engine.apiKeySecretRef, a Prometheus bearer token's)."""

    name: str
    key: str  # the controller's enqueue(namespace, name)


class ProbeMetrics:
    """The probe's operator metrics, on the registry the operator serves (no module globals)."""

    _LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["namespace", "name"]
        self.ttft = Histogram(
            "servedmodel_probe_ttft_seconds",
            "Probe TTFT (request sent -> first content token), seconds.",
            labels,
            buckets=self._LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "servedmodel_probe_tpot_seconds",
            "Probe TPOT, vLLM's definition ((e2e - TTFT)/(completion tokens - 1)), seconds.",
            labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.e2e = Histogram(
            "servedmodel_probe_e2e_seconds",
            "Probe end to end (request sent -> [DONE]), seconds.",
            labels,
            buckets=self._LATENCY_BUCKETS,
            registry=registry,
        )
        self.serving = Gauge(
            "servedmodel_probe_serving", "1 when the last probe succeeded, else 0.", labels, registry=registry
        )
        self.failures = Counter(
            "servedmodel_probe_failures", "Failed probes by reason.", [*labels, "reason"], registry=registry
        )
        self.cycles = Counter(
            "servedmodel_probe", "Probe cycles run, by result.", [*labels, "result"], registry=registry
        )
        self.status_writes = Counter(
            "servedmodel_probe_status_writes",
            "Status writes of the probe (at most one per cycle).",
            labels,
            registry=registry,
        )
        # The autoscaling signal (spec.autoscaling.targets.probeTtftP95Ms): the rolling window's p95, which
        # Prometheus scrapes and prometheus-adapter / KEDA serve to the autoscaler (servedmodel.scaling).
        self.ttft_p95 = Gauge(
            "servedmodel_probe_ttft_p95_seconds",
            "Probe TTFT p95 over the rolling window (status.probe.window.ttftP95Ms), seconds.",
            labels,
            registry=registry,
        )
        self.in_flight = Gauge(
            "servedmodel_probe_cycles_in_flight",
            "Probe cycles running now (bounded by the scheduler's concurrency).",
            registry=registry,
        )
        self.scheduled = Gauge(
            "servedmodel_probe_scheduled_models",
            "ServedModels the probe scheduler tracks.",
            registry=registry,
        )
        self.loop_lag = Histogram(
            "servedmodel_event_loop_lag_seconds",
            "Event-loop lag (a short sleep's overshoot): loop=main (watches, reconciles, the scheduler) "
            "or loop=probe (the probe's own loop, watched while probes run), seconds.",
            ["loop"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.gc_pause = Histogram(
            "servedmodel_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, which stop every thread of the operator "
            "(the probe's loop included), by generation, seconds.",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.stalled_samples = Counter(
            "servedmodel_probe_stalled_samples",
            "Probe streams read while the probe's own loop was stalled (figures not published).",
            registry=registry,
        )
        self.lateness = Histogram(
            "servedmodel_probe_start_lateness_seconds",
            "How long a due probe cycle waited for a concurrency slot, seconds.",
            buckets=(0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )

        self.pod_probes = Counter(
            "servedmodel_probe_pod",
            "Probes of single engine pods, by reason (Serving, or why the pod failed).",
            [*labels, "reason"],
            registry=registry,
        )
        self.pod_transitions = Counter(
            "servedmodel_probe_pod_transitions",
            "Engine pods whose Serving changed, by new status and reason.",
            [*labels, "serving", "reason"],
            registry=registry,
        )
        self.gate_writes = Counter(
            "servedmodel_probe_readiness_gate_writes",
            "Readiness-gate condition writes on engine pods (pods/status), by status.",
            [*labels, "status"],
            registry=registry,
        )
        self.stalled = Gauge(
            "servedmodel_probe_engine_stalled_pods",
            "Engine pods whose last probe found the engine stalled (EngineStalled).",
            labels,
            registry=registry,
        )
        self.kv_pressure = Gauge(
            "servedmodel_probe_kv_cache_pressure_pods",
            "Engine pods whose last probe found KV cache pressure with preemptions rising.",
            labels,
            registry=registry,
        )

    def record(self, namespace: str, name: str, out: ProbeOutcome) -> None:
        self.cycles.labels(namespace, name, "success" if out.ok else "failure").inc()
        self.serving.labels(namespace, name).set(1 if out.ok else 0)
        if out.failure is not None:
            self.failures.labels(namespace, name, out.failure.reason).inc()
            return
        if out.stall_took_figures:
            self.stalled_samples.inc()
        f = publishable_figures(out)  # not a lump, not read by a stalled prober: the engine's figures
        if f is not None:
            if f.ttft_ms is not None:
                self.ttft.labels(namespace, name).observe(f.ttft_ms / 1000)
            if f.tpot_ms is not None:
                self.tpot.labels(namespace, name).observe(f.tpot_ms / 1000)
            if f.e2e_ms is not None:
                self.e2e.labels(namespace, name).observe(f.e2e_ms / 1000)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted ServedModel's series (every label set that starts with it): no ghosts."""
        for metric in (
            self.ttft,
            self.tpot,
            self.e2e,
            self.serving,
            self.failures,
            self.cycles,
            self.status_writes,
            self.pod_probes,
            self.pod_transitions,
            self.gate_writes,
            self.stalled,
            self.kv_pressure,
            self.ttft_p95,
        ):
            # prometheus_client lists a metric's children only in this private mapping.
            for labels in list(metric._metrics):
                if labels[:2] == (namespace, name):
                    with contextlib.suppress(KeyError):
                        metric.remove(*labels)


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


def serving_of(conditions: Any) -> tuple[str, str] | None:
    """(status, reason) of a Serving condition in a conditions list."""
    serving = find_condition(conditions, SERVING)
    return None if serving is None else (str(serving.get("status")), str(serving.get("reason")))


def first_due(
    now: float, interval: float, last_probe_time: str | None, wall_now: datetime, rng: random.Random
) -> float:
    """When a newly tracked model's first cycle runs (monotonic seconds).

    With a lastProbeTime (an operator restart), one interval after it, so the spread the models had
    is kept; when that is already past, or the model was never probed, at a random point of the next
    interval (a model that just became ready: within the first 10 % of it)."""
    last = parse_rfc3339(last_probe_time)
    if last is not None:
        since = (wall_now - last).total_seconds()
        ahead = interval - since
        if 0 <= ahead <= interval:
            return now + ahead
        return now + rng.uniform(0, interval)
    return now + rng.uniform(0, interval * JITTER)


# ---- the scheduler -------------------------------------------------------------------------------


@dataclass
class _Model:
    """One tracked ServedModel: when it runs next and what this scheduler last wrote for it."""

    key: Key
    body: Obj | None = None  # the last body seen (events, cache, or the write's answer)
    due: float = 0.0
    placed: bool = False  # its first due time has been chosen
    task: asyncio.Task[None] | None = None
    last_patch: dict[str, Any] | None = None
    last_status: ProbeStatus | None = None
    cycles: int = 0
    removed: bool = False
    windows: dict[str, Window] = field(default_factory=dict)  # pod -> its figures at the last cycle
    rotation: int = 0  # where the next bounded rotation over many pods starts


@dataclass(frozen=True)
class _PodTarget:
    name: str
    url: str
    pod: Obj


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


@dataclass
class ProbeScheduler:
    """Probes every tracked ServedModel on its own jittered schedule; see the module docstring.

    Feed it with `track(body)` / `forget(namespace, name)` (tests), or give it the cache:
    every tick it tracks the cache's ServedModel keys and forgets the ones gone from it.
    """

    kube: KubeClient  # tests give fakes with the methods used: get, list, apply_status, create_event
    config: OperatorConfig
    metrics: ProbeMetrics = field(default_factory=lambda: ProbeMetrics(CollectorRegistry()))
    cache: Cache | None = None
    enqueue: Enqueue | None = None
    # With probe sharding (k8s/members.py): whether this replica probes a ServedModel ("ns/name").
    owns: Callable[[str], bool] | None = None
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    _models: dict[Key, _Model] = field(default_factory=dict, init=False)
    _heap: list[tuple[float, int, Key]] = field(default_factory=list, init=False)
    _seq: int = field(default=0, init=False)
    _wake: asyncio.Event | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _transport: httpx.AsyncHTTPTransport | None = field(default=None, init=False)
    # Prometheus sources with insecureSkipVerify: one client for all of them, closed with the pool.
    _insecure_http: httpx.AsyncClient | None = field(default=None, init=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False)
    # Slots one namespace may hold at once (None: max(1, probe_concurrency // NAMESPACE_SHARE_DIVISOR)).
    namespace_share: int | None = None
    # Where cycles' requests run (started by start(); not started, on the caller's loop).
    probe_loop: ProbeLoop = field(default_factory=ProbeLoop)
    _ns_busy: dict[str, int] = field(default_factory=dict, init=False)
    # Due models whose namespace held its share: back on the heap when one of its cycles ends.
    _parked: dict[str, list[tuple[float, int, Key]]] = field(default_factory=dict, init=False)
    _lag_task: asyncio.Task[None] | None = field(default=None, init=False)
    # Secret values a running cycle sends, per ServedModel: scrubbed from its outcome (`_redacted`).
    _in_use: dict[Key, set[str]] = field(default_factory=dict, init=False)
    _synced: float = field(default=float("-inf"), init=False)
    # Tracked but not yet given a first due time: the loop places only these (it wakes at every
    # cycle's end, and walking every model each time grew with the fleet).
    _unplaced: list[Key] = field(default_factory=list, init=False)
    # Every read of the cluster (ServedModel, engine Pods, Secrets): the cache where it feeds the kind.
    reader: Reader = field(init=False)

    def __post_init__(self) -> None:
        self.reader = Reader(self.kube, self.cache)

    # ---- feeding -------------------------------------------------------------------------------

    def track(self, body: Mapping[str, Any]) -> None:
        """A ServedModel exists (or changed): keep its newest body; a deletionTimestamp forgets it."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or "default"), str(meta.get("name")))
        if meta.get("deletionTimestamp"):
            self.forget(*key)
            return
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = _Model(key)
            self._unplaced.append(key)
            self.metrics.scheduled.set(len(self._models))
        model.body = dict(body)
        if not model.placed and self._wake is not None:
            self._wake.set()

    def forget(self, namespace: str, name: str) -> None:
        """The ServedModel is gone (or going): cancel its cycle, write nothing more, drop its series."""
        model = self._models.pop((namespace, name), None)
        if model is None:
            return
        model.removed = True
        if model.task is not None and not model.task.done():
            model.task.cancel()
        self.metrics.forget(namespace, name)
        self.metrics.scheduled.set(len(self._models))

    def _gone(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """A status write for `body` answered 404: that ServedModel is gone, whatever the watch has said
        so far. It leaves the cache too, or the next sync from the cache would track (and probe) it
        again; a newer object of the same name already in the cache stays, and the next sync tracks it."""
        self.forget(namespace, name)
        if self.cache is not None:
            self.cache.evict(SERVED_MODEL_KIND, body)

    def tracked(self) -> list[Key]:
        return sorted(self._models)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the scheduling loop (idempotent)."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(max(1, self.config.probe_concurrency))
        self._pool()
        self.probe_loop.watch.observe = self.metrics.loop_lag.labels("probe").observe
        self.probe_loop.start()
        GC_WATCH.install()
        main_lag = self.metrics.loop_lag.labels("main")

        def observe_main(lag_s: float) -> None:
            main_lag.observe(lag_s)
            for generation, pause_s in GC_WATCH.drain():
                self.metrics.gc_pause.labels(str(generation)).observe(pause_s)

        main_watch = LoopWatch(MAIN_WATCH_PERIOD_S, MAIN_WATCH_PERIOD_S, observe_main)
        self._lag_task = asyncio.get_running_loop().create_task(
            main_watch.run(), name="probe-main-loop-watch"
        )
        self._task = asyncio.get_running_loop().create_task(self._run(), name="probe-scheduler")

    async def stop(self) -> None:
        """Cancel the loop and every in-flight cycle, wait for them, close the HTTP clients (on the probe
        loop, whose connections they hold) and end the probe loop's thread."""
        task, self._task = self._task, None
        lag, self._lag_task = self._lag_task, None
        cycles = [m.task for m in self._models.values() if m.task is not None and not m.task.done()]
        for t in [*([task] if task else []), *([lag] if lag else []), *cycles]:
            t.cancel()
        await asyncio.gather(
            *([task] if task else []), *([lag] if lag else []), *cycles, return_exceptions=True
        )
        closers = []
        if self._transport is not None:
            closers.append(self._transport.aclose)
            self._transport = None
        if self._insecure_http is not None:
            closers.append(self._insecure_http.aclose)
            self._insecure_http = None
        await self.probe_loop.stop(closers)
        GC_WATCH.uninstall()

    def _pool(self) -> httpx.AsyncHTTPTransport:
        if self._transport is None:
            self._transport = httpx.AsyncHTTPTransport(trust_env=False)
        return self._transport

    def _client(self, spec: ProbeSpec) -> httpx.AsyncClient:
        """A client with this model's limits over the scheduler's one connection pool."""
        return httpx.AsyncClient(transport=_Shared(self._pool()), timeout=http_timeout(spec), trust_env=False)

    def _prometheus_http(self, http: httpx.AsyncClient, *, insecure: bool) -> httpx.AsyncClient:
        """The client a Prometheus source queries on: this cycle's (the shared pool), or for
        insecureSkipVerify the scheduler's one client that does not verify TLS."""
        if not insecure:
            return http
        if self._insecure_http is None:
            self._insecure_http = httpx.AsyncClient(verify=False, trust_env=False)
        return self._insecure_http

    async def __aenter__(self) -> ProbeScheduler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- the loop ------------------------------------------------------------------------------

    def _push(self, model: _Model, due: float) -> None:
        model.due = due
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, model.key))

    def _sync_from_cache(self) -> None:
        """Follow the cache's ServedModels: new keys tracked, vanished ones forgotten. At most once per
        CACHE_SYNC_S: the loop wakes at every cycle's end, and the key sets grow with the fleet."""
        cache = self.cache
        if cache is None or not cache.tracks(SERVED_MODEL_KIND):
            return
        now = self.clock()
        if now - self._synced < CACHE_SYNC_S:
            return
        self._synced = now
        keys = {k for k in cache.keys(SERVED_MODEL_KIND) if self.owns is None or self.owns(f"{k[0]}/{k[1]}")}
        for key in keys - set(self._models):
            body = cache.get(SERVED_MODEL_KIND, *key)
            if body is not None:
                self.track(body)
        for key in set(self._models) - keys:
            self.forget(*key)

    def _place_new(self) -> None:
        if not self._unplaced:
            return
        now, wall = self.clock(), datetime.now(UTC)
        keys, self._unplaced = self._unplaced, []
        for key in keys:
            model = self._models.get(key)
            if model is None or model.placed:
                continue
            model.placed = True
            status = (model.body or {}).get("status") or {}
            interval = float(((model.body or {}).get("spec") or {}).get("probe", {}).get("interval") or 60)
            last = (status.get("probe") or {}).get("lastProbeTime")
            self._push(model, first_due(now, interval, last, wall, self.rng))

    async def _run(self) -> None:
        assert self._wake is not None
        assert self._slots is not None
        while True:
            self._sync_from_cache()
            self._place_new()
            now = self.clock()
            # Start every due model a slot is free for; stale heap entries (re-pushed, forgotten) are skipped.
            while self._heap and self._heap[0][0] <= now:
                due, _, key = self._heap[0]
                model = self._models.get(key)
                if model is None or model.due != due or (model.task is not None and not model.task.done()):
                    heapq.heappop(self._heap)
                    continue
                if self._slots.locked():
                    break
                heapq.heappop(self._heap)
                if self._ns_busy.get(key[0], 0) >= self._share():
                    self._parked.setdefault(key[0], []).append((due, _, key))
                    continue
                self._ns_busy[key[0]] = self._ns_busy.get(key[0], 0) + 1
                await self._slots.acquire()
                self.metrics.lateness.observe(max(0.0, now - due))
                model.task = asyncio.get_running_loop().create_task(
                    self._cycle_task(model), name=f"probe {key[0]}/{key[1]}"
                )
            timeout = IDLE_TICK_S
            if self._heap and not self._slots.locked():
                timeout = min(timeout, max(0.0, self._heap[0][0] - self.clock()))
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for could lose a cancel that came as its
            # timeout fired (stop() then waited for ever on a loop blocked in bursts); no inner task here.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _share(self) -> int:
        if self.namespace_share is not None:
            return max(1, self.namespace_share)
        return max(1, self.config.probe_concurrency // NAMESPACE_SHARE_DIVISOR)

    def _release_namespace(self, namespace: str) -> None:
        """One of the namespace's cycles ended: its parked due models go back on the heap (stale ones
        are skipped there as any)."""
        left = self._ns_busy.get(namespace, 0) - 1
        if left > 0:
            self._ns_busy[namespace] = left
        else:
            self._ns_busy.pop(namespace, None)
        for entry in self._parked.pop(namespace, []):
            heapq.heappush(self._heap, entry)

    async def _cycle_task(self, model: _Model) -> None:
        assert self._slots is not None
        assert self._wake is not None
        self.metrics.in_flight.inc()
        delay = NOT_READY_WAIT_S
        try:
            result = await self.run_cycle(model.key)
            delay = result.next_delay_s
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not stop the scheduler: log it, retry after an interval
            log.exception("probe cycle of %s/%s failed", *model.key)
            delay = INVALID_SPEC_WAIT_S
        finally:
            self.metrics.in_flight.dec()
            self._slots.release()
            self._release_namespace(model.key[0])
            self._wake.set()
        if not model.removed and self._models.get(model.key) is model:
            self._push(model, self.clock() + delay)

    # ---- one cycle -----------------------------------------------------------------------------

    async def _body(self, model: _Model) -> Obj | None:
        """The ServedModel as it is now (the reader's); without a cache, as tracked or last written."""
        if self.cache is None and model.body is not None:
            return model.body
        return await self.reader.get(API_GROUP_VERSION, PLURAL, *model.key)

    async def run_cycle(self, key: Key) -> CycleResult:
        """One probe cycle of one tracked ServedModel (the loop calls it; tests may too)."""
        model = self._models.get(key)
        if model is None:
            return CycleResult(False, skipped="gone")
        namespace, name = key
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
        probed: list[PodResult] = []
        plan: _Plan | None = None
        if spec.external:
            out = await self.probe_once(namespace, name, spec)
        else:
            plan = await self._plan(model, spec)
            previous = previous_probe_status(status, model.last_status)
            if plan.targets:
                rollout = previous_rollout(status, model.last_patch)
                probed = await self._probe_pods(model, spec, plan.targets, rollout)
                out = aggregate(probed)
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
        composed = compose(
            Cycle(out, spec, status, generation, datetime.now(UTC), model.last_status, model.last_patch, pods)
        )
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
        )
        result.pods = probed
        if probed and plan is not None:
            await self._after_pods(model, body, probed, plan, status, composed)
        if patch == model.last_patch:
            return result
        before = serving_of(status.get("conditions"))
        if model.last_patch is not None:
            before = serving_of(model.last_patch.get("conditions")) or before
        after = serving_of(patch["conditions"])
        # The rollout verdict the reconciler acts on (reconcile.rollback): a change enqueues it, as a
        # Serving change does (our write goes into the cache first, so the watch event shows no change).
        said = rollout_verdict(status.get("rollout"))
        if model.last_patch is not None and "rollout" in model.last_patch:
            said = rollout_verdict(model.last_patch["rollout"])
        rollout_changed = said != rollout_verdict(patch.get("rollout"))
        if model.removed:
            return result  # forgotten (deleted) while the probe ran: write nothing
        try:
            written = await self.kube.apply_status(
                API_GROUP_VERSION, PLURAL, namespace, name, patch, self.config.probe_field_manager
            )
        except NotFoundError:
            self._gone(namespace, name, body)
            return result
        except ApiError as exc:
            log.warning("probe status write of %s/%s failed: %s %s", namespace, name, exc.status, exc.reason)
            return result
        model.last_patch, model.last_status = patch, new
        if isinstance(written, dict) and written.get("metadata"):
            # The cache's slim copy where it has one: the answer itself carries managedFields (the
            # probe's status twice over), and a thousand of them were a tenth of the operator's memory.
            model.body = self._write_through(SERVED_MODEL_KIND, written)
        self.metrics.status_writes.labels(namespace, name).inc()
        result.written = True
        if (before != after or rollout_changed) and self.enqueue is not None:  # the reconciler reads these
            self.enqueue(namespace, name)
        return result

    # ---- managed mode: every engine pod at its own address -----------------------------------

    def _override_text(self) -> str | None:
        return read_override(self.config.endpoint_override)

    async def _engine_pods(self, namespace: str, name: str) -> list[Obj]:
        return await self.reader.list("v1", "pods", namespace, selector_labels(name))

    async def _plan(self, model: _Model, spec: ServedModelSpec) -> _Plan:
        """Which pods this cycle probes: every pod whose containers are ready (the engine's /health
        passed: the readiness gate is what stands between it and traffic), at most
        probe_max_pods_per_cycle of them, rotating through the rest cycle by cycle."""
        namespace, name = model.key
        try:
            pods = await self._engine_pods(namespace, name)
        except ApiError as exc:
            return _Plan([], [], 0, {}, f"listing engine pods: {exc.status} {exc.reason}")
        live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        existing = sorted(str(p["metadata"]["name"]) for p in live)
        text = self._override_text()
        if text is None and self.config.endpoint_override:
            # An override file that cannot be read must not fall back to the pods' real addresses.
            return _Plan([], [], len(existing), {}, "the endpoint override file cannot be read")
        per_pod = parse_pod_overrides(text, namespace, name)
        model_url = None if per_pod else parse_override(text, namespace, name)
        targets: list[_PodTarget] = []
        for pod in sorted(live, key=lambda p: str(p["metadata"]["name"])):
            pod_name = str(pod["metadata"]["name"])
            if not containers_ready(pod):
                continue
            url = per_pod.get(pod_name) if per_pod else (model_url or pod_base_url(pod))
            if url:
                targets.append(_PodTarget(pod_name, url, pod))
        eligible = [t.name for t in targets]
        why = f"no engine pod of {len(existing)} has its containers ready" if existing else "no engine pod"
        cap = max(1, self.config.probe_max_pods_per_cycle)
        if len(targets) > cap:
            start = model.rotation % len(targets)
            targets = (targets[start:] + targets[:start])[:cap]
            model.rotation = start + cap
        pods_by_name = {str(p["metadata"]["name"]): p for p in live}
        return _Plan(targets, eligible, len(existing), pods_by_name, why)

    async def _probe_pods(
        self,
        model: _Model,
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
                api_key = None
                if spec.engine.api_key_secret_ref is not None:
                    api_key = await self._secret_value(
                        namespace, name, spec.engine.api_key_secret_ref, API_KEY_FIELD
                    )
                    self._in_use.setdefault((namespace, name), set()).add(api_key)
                prometheus = None
                if spec.probe.metrics_source.type == "prometheus":
                    # Prometheus answers for the whole ServedModel, not per pod: read once, around the
                    # first pod's probe (the others have no server figures then).
                    prometheus = await self._metrics_reader(
                        http, namespace, name, spec, resolve_override(targets[0].url)
                    )
            except ProbeFailure as f:
                self._in_use.pop((namespace, name), None)
                now = datetime.now(UTC)
                return [
                    PodResult(t.name, t.url, ProbeOutcome(endpoint=t.url, started=now, ended=now, failure=f))
                    for t in targets
                ]

            async def one(i: int, t: _PodTarget) -> ProbeOutcome:
                reader: MetricsReader | None
                if prometheus is not None:
                    reader = prometheus if i == 0 else None
                else:
                    reader = PodMetrics(http, [t.url], served)
                return await self.probe_loop.submit(
                    run_probe(
                        http,
                        resolve_override(t.url),
                        spec.probe,
                        model=served,
                        api_key=api_key,
                        metrics=reader,
                        fingerprint=fingerprint[i],
                    )
                )

            outcomes = await asyncio.gather(*(one(i, t) for i, t in enumerate(targets)))
        outcomes = self._redacted(namespace, name, *outcomes)
        mono = self.clock()
        results: list[PodResult] = []
        for t, out in zip(targets, outcomes, strict=True):
            previous = model.windows.get(t.name)
            r = PodResult(t.name, t.url, out)
            r.stalled = stall_verdict(out, mono, previous)
            r.kv_pressure = kv_pressure_verdict(out, previous)
            if out.after is not None:
                model.windows[t.name] = Window(out.after, mono)
            results.append(r)
            self.metrics.pod_probes.labels(namespace, model.key[1], r.reason).inc()
        return results

    async def _after_pods(
        self,
        model: _Model,
        body: Obj,
        probed: list[PodResult],
        plan: _Plan,
        status: Mapping[str, Any],
        composed: Composed,
    ) -> None:
        """The composed readiness-gate writes (pods/status), and Events: for every pod whose Serving
        changed, for EngineStalled / KVCachePressure / RolloutBlocked / ProbeUnreliable turning True, and
        TemplateChanged."""
        namespace, name = model.key
        if model.removed:
            return
        previous = previous_probe_status(status, model.last_status)
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
        if model.last_patch is not None:
            old_conds.update({c.get("type"): c for c in model.last_patch.get("conditions") or []})
        for c in composed.patch["conditions"]:
            was = (old_conds.get(c["type"]) or {}).get("status")
            # a stall of the probe's own loop alone is the machine's noise: in status, not an Event
            warned = c["type"] in (ENGINE_STALLED, KV_CACHE_PRESSURE, ROLLOUT_BLOCKED) or (
                c["type"] == PROBE_UNRELIABLE and c["reason"] != PROBE_LOOP_STALLED
            )
            if warned and c["status"] == "True" and was != "True":
                await self._event(body, "Warning", c["type"], c["message"])
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

    async def _at_zero(self, model: _Model, body: Mapping[str, Any], status: Obj) -> CycleResult:
        """Scaled to zero by the autoscaler: no chat (it would be traffic, and finds no engine), Serving
        Unknown once, and no TTFT p95 series (a stale one would keep a KEDA trigger active)."""
        namespace, name = model.key
        with contextlib.suppress(KeyError):
            self.metrics.ttft_p95.remove(namespace, name)
        result = CycleResult(False, skipped="scaled-to-zero", next_delay_s=NOT_READY_WAIT_S)
        said = ("Unknown", scaling.SCALED_TO_ZERO)
        if model.removed or said in (
            serving_of(status.get("conditions")),
            serving_of((model.last_patch or {}).get("conditions")),
        ):
            return result
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        generation = (body.get("metadata") or {}).get("generation")
        patch: dict[str, Any] = {
            "conditions": scaling.scaled_to_zero_conditions(status.get("conditions"), generation, now)
        }
        if isinstance(status.get("probe"), dict):
            patch["probe"] = status["probe"]  # kept as it is: server-side apply drops what we omit
        keep_rollout(status, patch)
        try:
            written = await self.kube.apply_status(
                API_GROUP_VERSION, PLURAL, namespace, name, patch, self.config.probe_field_manager
            )
        except NotFoundError:
            self._gone(namespace, name, body)
            return result
        except ApiError as exc:
            log.warning("probe status write of %s/%s failed: %s %s", namespace, name, exc.status, exc.reason)
            return result
        model.last_patch = patch
        if isinstance(written, dict) and written.get("metadata"):
            model.body = written
        self.metrics.status_writes.labels(namespace, name).inc()
        result.written = True
        if self.enqueue is not None:
            self.enqueue(namespace, name)
        return result

    async def _secret_value(self, namespace: str, name: str, ref: _KeyRef, field: str) -> str:
        """A Secret key's value for ServedModel `name`, only where the Secret's owner allowed that
        (servedmodel.access.secret_refusal: the inference.servedmodel.io/allowed-servedmodels annotation);
        a refusal is a ProbeFailure naming the Secret and `field`. No message ever holds the value."""
        try:
            secret = await self.reader.get("v1", "secrets", namespace, ref.name)
        except ApiError as exc:
            raise ProbeFailure(
                errors.SECRET_UNAVAILABLE, f"Secret {ref.name} ({field}): {exc.status} {exc.reason}"
            ) from None
        if secret is None:
            raise ProbeFailure(errors.SECRET_UNAVAILABLE, f"Secret {ref.name} ({field}) not found")
        refusal = access.secret_refusal(secret, name, field)
        if refusal is not None:
            raise ProbeFailure(refusal.reason, refusal.message)
        data = secret.get("data") or {}
        if ref.key not in data:
            raise ProbeFailure(errors.SECRET_UNAVAILABLE, f"Secret {ref.name} has no key {ref.key}")
        try:
            return base64.b64decode(data[ref.key]).decode("utf-8").strip()
        except (ValueError, UnicodeDecodeError):
            raise ProbeFailure(
                errors.SECRET_UNAVAILABLE, f"Secret {ref.name} key {ref.key} is not UTF-8 text"
            ) from None

    def _target(self, namespace: str, name: str, spec: ServedModelSpec) -> ProbeTarget:
        """External mode's target (managed models are probed pod by pod: `_plan`). spec.endpoint must pass
        the operator's allow-list (servedmodel.access.target_refusal); the admin's override is trusted."""
        override = parse_override(self.config.endpoint_override, namespace, name)
        if override is not None:
            return resolve_override(override)
        assert spec.endpoint is not None  # run_cycle sends only external models here
        refusal = access.target_refusal(
            spec.endpoint, self.config.target_allow_list, "spec.endpoint", base_path_only=True
        )
        if refusal is not None:
            raise ProbeFailure(refusal.reason, refusal.message)
        return resolve_external(spec.endpoint)

    async def _metrics_reader(
        self, http: httpx.AsyncClient, namespace: str, name: str, spec: ServedModelSpec, target: ProbeTarget
    ) -> MetricsReader:
        src = spec.probe.metrics_source
        model = spec.resolved_served_model_name
        if src.type == "prometheus" and src.prometheus is not None:
            prom = src.prometheus
            field = "spec.probe.metricsSource.prometheus"
            refusal = access.target_refusal(
                prom.url, self.config.target_allow_list, f"{field}.url", base_path_only=False
            )
            if refusal is not None:
                raise ProbeFailure(refusal.reason, refusal.message)
            if prom.insecure_skip_verify and not self.config.allow_insecure_tls:
                raise ProbeFailure(
                    access.INSECURE_TLS_NOT_ALLOWED,
                    f"{field}.insecureSkipVerify is true, but the operator verifies TLS for every "
                    "ServedModel (a cluster admin may allow skipping it: SERVEDMODEL_ALLOW_INSECURE_TLS)",
                )
            token = None
            if prom.bearer_token_secret_ref is not None:
                token = await self._secret_value(
                    namespace, name, prom.bearer_token_secret_ref, f"{field}.bearerTokenSecretRef"
                )
                self._in_use.setdefault((namespace, name), set()).add(token)
            return PrometheusMetrics(
                self._prometheus_http(http, insecure=prom.insecure_skip_verify),
                prom.url,
                model=model,
                namespace=namespace,
                bearer_token=token,
                settle_timeout_s=spec.probe.timeout,
            )
        return PodMetrics(http, target.metrics_urls, model)

    def _redacted(self, namespace: str, name: str, *outs: ProbeOutcome) -> list[ProbeOutcome]:
        """The outcomes without any Secret value this model's cycle sent (an engine may echo the API key
        in an error body, a model id or its content): status, Events and the log are all made from them."""
        secrets = self._in_use.pop((namespace, name), set())
        if not secrets:
            return list(outs)
        return [_scrub(out, frozenset(secrets)) for out in outs]

    async def probe_once(self, namespace: str, name: str, spec: ServedModelSpec) -> ProbeOutcome:
        """One external-mode cycle's measurements; secret failures are outcomes too."""
        async with self._client(spec.probe) as http:
            try:
                target = self._target(namespace, name, spec)
                api_key = None
                if spec.engine.api_key_secret_ref is not None:
                    api_key = await self._secret_value(
                        namespace, name, spec.engine.api_key_secret_ref, API_KEY_FIELD
                    )
                    self._in_use.setdefault((namespace, name), set()).add(api_key)
                metrics = await self._metrics_reader(http, namespace, name, spec, target)
            except ProbeFailure as f:
                self._in_use.pop((namespace, name), None)
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
                )
            )
            [out] = self._redacted(namespace, name, out)
            return out


class _Shared(httpx.AsyncBaseTransport):
    """The scheduler's connection pool, shared by every cycle's client and closed only by the scheduler."""

    def __init__(self, pool: httpx.AsyncHTTPTransport) -> None:
        self._pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._pool.handle_async_request(request)

    async def aclose(self) -> None:
        return None

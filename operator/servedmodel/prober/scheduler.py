"""When each ServedModel's probe cycle runs: due times, the concurrency slots and a namespace's share of
them, backoff, following the cache's ServedModels, and start/stop. What a cycle does is cycle.py's."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from prometheus_client import CollectorRegistry

from servedmodel.api.base import Key
from servedmodel.api.spec import ServedModelSpec
from servedmodel.config import OperatorConfig
from servedmodel.k8s import Cache, KubeClient
from servedmodel.k8s.reader import Reader
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.loop import GC_WATCH, MAIN_WATCH_PERIOD_S, LoopWatch, ProbeLoop
from servedmodel.probe.report import parse_rfc3339
from servedmodel.probe.schedule import JITTER, NOT_READY_WAIT_S

from . import shares
from .cycle import INVALID_SPEC_WAIT_S, SERVED_MODEL_KIND, CycleResult, CycleRunner, Enqueue, Model
from .telemetry import ProbeMetrics

log = logging.getLogger(__name__)

CACHE_SYNC_S: Final = 1.0  # how often the loop compares its ServedModels with the cache's
IDLE_TICK_S: Final = 5.0  # the loop wakes at least this often (new keys from the cache, stop requests)
# While the reconciler has keys waiting (`yield_to`), at most this many cycles run, and the loop looks
# again this often. 1,000 ServedModels created at once turn Ready within a minute and each is first
# probed within a tenth of its interval: 32 first cycles at once (full paths and status writes) took the
# two cores and the API server from the reconciles still to come (all Ready at 300: 22 -> 31 s).
YIELD_SLOTS: Final = 4
YIELD_POLL_S: Final = 0.5


def rate_of(body: Mapping[str, Any]) -> float:
    """A ServedModel's probe cycles per second: 1 / spec.probe.interval (60 s when not given)."""
    interval = float(((body.get("spec") or {}).get("probe") or {}).get("interval") or 60)
    return 1.0 / max(1.0, interval)


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


@dataclass
class ProbeScheduler:
    """Probes every tracked ServedModel on its own jittered schedule; see servedmodel.prober.

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
    # Slots one namespace may hold at once; None: its fair share, sized from demand (prober/shares.py).
    namespace_share: int | None = None
    # True while the reconciler has work waiting: the probe keeps to YIELD_SLOTS cycles meanwhile.
    yield_to: Callable[[], bool] | None = None
    # Where cycles' requests run (started by start(); not started, on the caller's loop).
    probe_loop: ProbeLoop = field(default_factory=ProbeLoop)
    # Every read of the cluster (ServedModel, engine Pods, Secrets): the cache where it feeds the kind.
    reader: Reader = field(init=False)
    runner: CycleRunner = field(init=False)
    _models: dict[Key, Model] = field(default_factory=dict, init=False)
    _heap: list[tuple[float, int, Key]] = field(default_factory=list, init=False)
    _seq: int = field(default=0, init=False)
    _wake: asyncio.Event | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False)
    _ns_busy: dict[str, int] = field(default_factory=dict, init=False)
    # Each tracked model's cycles per second (1 / its interval); per namespace, its cycles' mean seconds,
    # and the cap on its slots those give (prober/shares.py; recomputed at most once per CACHE_SYNC_S).
    _rates: dict[Key, float] = field(default_factory=dict, init=False)
    _ns_cycle_s: dict[str, float] = field(default_factory=dict, init=False)
    _started: dict[Key, float] = field(default_factory=dict, init=False)  # cycles in flight: since when
    _shares: dict[str, int] = field(default_factory=dict, init=False)
    _shared: float = field(default=float("-inf"), init=False)
    # Due models whose namespace held its share: back on the heap when one of its cycles ends.
    _parked: dict[str, list[tuple[float, int, Key]]] = field(default_factory=dict, init=False)
    _lag_task: asyncio.Task[None] | None = field(default=None, init=False)
    _synced: float = field(default=float("-inf"), init=False)
    # Tracked but not yet given a first due time: the loop places only these (it wakes at every
    # cycle's end, and walking every model each time grew with the fleet).
    _unplaced: list[Key] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.reader = Reader(self.kube, self.cache)
        self.runner = CycleRunner(
            kube=self.kube,
            config=self.config,
            metrics=self.metrics,
            reader=self.reader,
            cache=self.cache,
            enqueue=self.enqueue,
            forget=self.forget,
            probe_loop=self.probe_loop,
            rng=self.rng,
            clock=self.clock,
        )

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
            model = self._models[key] = Model(key)
            self._unplaced.append(key)
            self.metrics.scheduled.set(len(self._models))
        model.body = dict(body)
        self._rates[key] = rate_of(body)
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
        self._rates.pop((namespace, name), None)
        self.metrics.forget(namespace, name)
        self.metrics.scheduled.set(len(self._models))

    def tracked(self) -> list[Key]:
        return sorted(self._models)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the scheduling loop (idempotent)."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(max(1, self.config.probe_concurrency))
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
        running = [*([task] if task else []), *([lag] if lag else []), *cycles]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self.probe_loop.stop(self.runner.closers())
        GC_WATCH.uninstall()

    async def __aenter__(self) -> ProbeScheduler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- one cycle, now (the loop's; tests call them too) -------------------------------------

    async def run_cycle(self, key: Key) -> CycleResult:
        """One probe cycle of one tracked ServedModel."""
        model = self._models.get(key)
        if model is None:
            return CycleResult(False, skipped="gone")
        return await self.runner.run(model)

    async def probe_once(self, namespace: str, name: str, spec: ServedModelSpec) -> ProbeOutcome:
        """One external-mode cycle's measurements (the full path), written nowhere."""
        return await self.runner.probe_external(Model((namespace, name)), spec)

    # ---- the loop ------------------------------------------------------------------------------

    def _push(self, model: Model, due: float) -> None:
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
            if self.cache is not None:
                model.body = None  # cycles read the cache's copy; this one would outlive its next event

    async def _run(self) -> None:
        assert self._wake is not None
        assert self._slots is not None
        while True:
            self._sync_from_cache()
            self._place_new()
            self._resize_shares()
            now = self.clock()
            # Start every due model a slot is free for; stale heap entries (re-pushed, forgotten) are skipped.
            while self._heap and self._heap[0][0] <= now:
                due, seq, key = self._heap[0]
                model = self._models.get(key)
                if model is None or model.due != due or (model.task is not None and not model.task.done()):
                    heapq.heappop(self._heap)
                    continue
                if self._slots.locked() or self._yielding():
                    break
                heapq.heappop(self._heap)
                if self._ns_busy.get(key[0], 0) >= self._share(key[0]):
                    self._parked.setdefault(key[0], []).append((due, seq, key))
                    continue
                self._ns_busy[key[0]] = self._ns_busy.get(key[0], 0) + 1
                await self._slots.acquire()
                self._started[key] = now  # here, not in the task: the next turn of this loop counts it
                self.metrics.lateness.observe(max(0.0, now - due))
                model.task = asyncio.get_running_loop().create_task(
                    self._cycle_task(model), name=f"probe {key[0]}/{key[1]}"
                )
            timeout = IDLE_TICK_S
            if self._heap and self._yielding():
                timeout = YIELD_POLL_S  # the reconciler's backlog clears without telling us
            elif self._heap and not self._slots.locked():
                timeout = min(timeout, max(0.0, self._heap[0][0] - self.clock()))
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for could lose a cancel that came as its
            # timeout fired (stop() then waited for ever on a loop blocked in bursts); no inner task here.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _yielding(self) -> bool:
        """YIELD_SLOTS cycles run and the reconciler has keys waiting: start no more for now."""
        return self.yield_to is not None and len(self._started) >= YIELD_SLOTS and self.yield_to()

    def _resize_shares(self) -> None:
        """Each namespace's cap from its demand (prober/shares.py), at most once per CACHE_SYNC_S.

        A namespace's cycle seconds are its mean, or the mean age of its cycles in flight when that is
        longer: cycles that never end must count before they end."""
        now = self.clock()
        if now - self._shared < CACHE_SYNC_S:
            return
        self._shared = now
        rates: dict[str, float] = {}
        for (namespace, _), rate in self._rates.items():
            rates[namespace] = rates.get(namespace, 0.0) + rate
        # a namespace whose last model went takes what was learnt of its cycles with it
        self._ns_cycle_s = {ns: s for ns, s in self._ns_cycle_s.items() if ns in rates}
        ages: dict[str, list[float]] = {}
        for key, started in self._started.items():
            ages.setdefault(key[0], []).append(now - started)
        demands: dict[str, float] = {}
        for namespace, rate in rates.items():
            cycle_s = self._ns_cycle_s.get(namespace, shares.DEFAULT_CYCLE_S)
            running = ages.get(namespace)
            if running:
                cycle_s = max(cycle_s, sum(running) / len(running))
            demands[namespace] = shares.demand(rate, cycle_s)
        self._shares = shares.fair_shares(demands, self.config.probe_concurrency)
        self.metrics.slots_demanded.set(sum(demands.values()))
        # A namespace whose share grew takes its parked models back now, not when a cycle of it ends
        # (its cycles may be the ones that never end).
        for namespace in [ns for ns in self._parked if self._ns_busy.get(ns, 0) < self._share(ns)]:
            for entry in self._parked.pop(namespace):
                heapq.heappush(self._heap, entry)

    def _share(self, namespace: str) -> int:
        if self.namespace_share is not None:
            return max(1, self.namespace_share)
        share = self._shares.get(namespace)
        if share is None:  # new since the last resize: an even split until the next
            return max(1, self.config.probe_concurrency // (len(self._shares) + 1))
        return share

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

    async def _cycle_task(self, model: Model) -> None:
        assert self._slots is not None
        assert self._wake is not None
        self.metrics.in_flight.inc()
        delay = NOT_READY_WAIT_S
        started = self._started.get(model.key, self.clock())
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
            self._started.pop(model.key, None)
            namespace = model.key[0]
            if self.cache is not None and not model.removed:  # its interval may have changed
                body = self.cache.get(SERVED_MODEL_KIND, *model.key)
                if body is not None:
                    self._rates[model.key] = rate_of(body)
            if model.key in self._rates:
                took = self.clock() - started
                self._ns_cycle_s[namespace] = shares.mean_cycle_s(self._ns_cycle_s.get(namespace), took)
            self._slots.release()
            self._release_namespace(model.key[0])
            self._wake.set()
        if not model.removed and self._models.get(model.key) is model:
            self._push(model, self.clock() + delay)

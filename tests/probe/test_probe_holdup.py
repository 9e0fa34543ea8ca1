"""A hold-up of the prober's own loop shorter than a stall (probe/loop.py: over 2 ms, under 50 ms) can
still lump a short stream: a CI run read a simulator's 16 tokens in 2.76 ms while the server's decode
took 30.77 ms, its thread held up ~28 ms on a loaded 2-core machine, and failed the streaming check
(CoalescedStream) on a healthy engine. A lump the hold-ups can account for is the prober's
(ProbeLoopStalled, skipped), one they cannot is still the engine's (test_against_sim's
test_coalesced_stream_is_flagged_and_not_written_as_latency).

Real simulator over loopback (2 ms engine steps); the hold-up is staged by blocking the probe's own loop
from the moment the chat's response headers arrive until the engine has made every token, so the whole
decode happens while nothing reads the socket."""

from __future__ import annotations

import time

import httpx

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe.client import PROBE_LOOP_STALLED, PodMetrics, ProbeOutcome, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.sse import Delivery, lump_explained
from servedmodel.sim.process import SimulatorProcess

TOKENS = 16


def generated(sim: SimulatorProcess) -> float:
    """vllm:generation_tokens_total: the tokens the engine has made so far."""
    text = httpx.get(f"{sim.base_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total{")
    )


async def probe_held_up(sim: SimulatorProcess) -> tuple[ProbeOutcome, float]:
    """One probe cycle on this (plain, unwatched) loop, held up while its chat's tokens are made: returns
    the outcome and the longest hold-up staged (s)."""
    spec = ProbeSpec.model_validate({"maxTokens": TOKENS, "stop": [], "checkLimits": False})
    target = resolve_external(sim.base_url)
    held: list[float] = []

    async def hold_until_generated(response: httpx.Response) -> None:
        if not response.url.path.endswith("/chat/completions"):
            return
        before, t0 = generated(sim), time.monotonic()
        # Blocking on purpose: the loop reads nothing until the engine has made the whole answer.
        while generated(sim) - before < TOKENS - 1 and time.monotonic() - t0 < 5:
            time.sleep(0.002)  # noqa: ASYNC251
        held.append(time.monotonic() - t0)

    async with probe_client(spec) as client:
        client.event_hooks["response"] = [hold_until_generated]
        metrics = PodMetrics(client, target.metrics_urls, "qwen")
        out = await run_probe(client, target, spec, model="qwen", metrics=metrics)
    assert held, "the chat's response never came"
    return out, max(held)


async def test_a_lump_made_while_the_probes_loop_was_held_up_is_the_probers(
    faults: SimulatorProcess,
) -> None:
    out, held_s = await probe_held_up(faults)
    assert out.failure is None, out.failure
    assert out.delivery is not None
    assert out.delivery.coalesced, out.delivery.describe()  # the lump is real: the reader was away
    streaming = out.checks["streaming"]
    assert (streaming.result, streaming.reason) == ("Skipped", PROBE_LOOP_STALLED), streaming
    assert "held up" in streaming.message
    assert out.probe_held_up_ms, "the cycle's watch saw no hold-up"
    assert out.probe_held_up_ms[0] >= 0.5 * held_s * 1000 - 10  # one 10 ms watch period may hide


def lump(client_ms: float, server_ms: float | None) -> Delivery:
    return Delivery(True, 16, 16, 2, client_ms, server_ms, None if server_ms is None else server_ms / 15)


def test_lump_explained_needs_the_hold_ups_to_make_up_the_missing_decode() -> None:
    # the CI run's stream: 2.76 ms seen of 30.77 ms made; a live stream shows at least half of it
    assert lump_explained(lump(2.76, 30.77), 13.0)
    assert not lump_explained(lump(2.76, 30.77), 12.0)
    # a buffering proxy's 300 ms decode delivered at once is not excused by a 20 ms hold-up
    assert not lump_explained(lump(0.1, 300.0), 20.0)
    assert not lump_explained(lump(2.76, 30.77), 0.0)
    # without server figures any hold-up may have made the lump
    assert lump_explained(lump(0.1, None), 3.0)
    live = Delivery(False, 16, 16, 16, 29.0, 30.0, 2.0)
    assert not lump_explained(live, 50.0)

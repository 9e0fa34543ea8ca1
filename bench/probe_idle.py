"""Whether the probe times a warm or a cold engine: client - server TTFT of a light cycle whose chat comes
0.2 s after a /metrics scrape (the probe as it is: probe/client.SCRAPE_QUIET_S) against one whose chat is
the first request after a whole gap of idleness (its "before" is the last cycle's scrape after, taken
--gap seconds earlier: what 6664009 did on a quiet engine, reverted).

One simulator on loopback, one PathMemo, the prober's way of running a cycle (a uvloop ProbeLoop with the
probe's HTTP/1.1 transport); the two ways alternate cycle by cycle on the same engine, so the machine's
drift falls on both alike. Only light cycles are counted (the full path sends the door and /tokenize right
before its chat). The excess is the cycle's client TTFT minus the engine's own from its histograms over
the cycle's window.

    .venv/bin/python bench/probe_idle.py [--cycles 24] [--gap 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import uvloop

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import client as probe
from servedmodel.probe import loop as probe_loop
from servedmodel.probe import report
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.metrics import MetricsSnapshot
from servedmodel.sim.process import SimulatorProcess

BASE = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
WARM = "a scrape 0.2 s before the chat (the probe)"
COLD = "the last cycle's scrape after as before (idle gap)"


class LastAfter:
    """A MetricsReader over the pod's /metrics whose "before" is the previous cycle's scrape after, when
    `reuse` is set and there is one: the chat is then the engine's first request since that scrape."""

    def __init__(self, pod: probe.PodMetrics) -> None:
        self.pod, self.model, self.reuse = pod, pod.model, False
        self.last: MetricsSnapshot | None = None

    async def snapshot(self) -> MetricsSnapshot:
        if self.reuse and self.last is not None:
            return self.last
        return await self.pod.snapshot()

    async def settled(self, before: MetricsSnapshot, requests: int, ended_wall: float) -> MetricsSnapshot:
        self.last = await self.pod.settled(before, requests, ended_wall)
        return self.last


def row(name: str, values: list[float]) -> str:
    if not values:
        return f"| {name} | 0 | n/a | n/a | n/a |"
    p50, mean = statistics.median(values), statistics.fmean(values)
    return f"| {name} | {len(values)} | {p50:.2f} | {mean:.2f} | {max(values):.2f} |"


async def run(cycles: int, gap_s: float) -> dict[str, list[float]]:
    spec = ProbeSpec()
    excess: dict[str, list[float]] = {WARM: [], COLD: []}
    async with SimulatorProcess(BASE, ready_timeout=60) as sim:
        target = resolve_external(sim.base_url)
        loop = probe_loop.ProbeLoop("bench-idle", loop_factory=uvloop.new_event_loop)
        loop.start()
        client = probe.http_client(spec, probe.probe_transport())
        memo = probe.PathMemo("bench")
        reader = LastAfter(probe.PodMetrics(client, [sim.base_url], "qwen"))
        try:
            for i in range(cycles):
                reader.reuse = i % 2 == 1
                light = memo.light
                kwargs: dict[str, Any] = {"model": "qwen", "metrics": reader, "memo": memo}
                out = await loop.submit(probe.run_probe(client, target, spec, **kwargs))
                if out.failure is not None:
                    raise RuntimeError(f"probe failed: {out.failure}")
                server = report.server_latency(out)
                client_ttft = out.figures.ttft_ms if out.figures is not None else None
                if light and client_ttft is not None and server is not None and server.ttft_ms is not None:
                    excess[COLD if reader.reuse else WARM].append(client_ttft - server.ttft_ms)
                await asyncio.sleep(gap_s)
        finally:
            await loop.stop([client.aclose])
    return excess


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=24, help="cycles in all, the two ways alternating")
    parser.add_argument("--gap", type=float, default=5.0, help="idle seconds between cycles (an interval)")
    args = parser.parse_args()
    excess = asyncio.run(run(args.cycles, args.gap))
    print(f"light cycles {args.gap:g} s apart, client - server TTFT, ms")
    print("| chat after | cycles | p50 | mean | max |")
    print("|---|---|---|---|---|")
    for name, values in excess.items():
        print(row(name, values))
    if excess[WARM] and excess[COLD]:
        ratio = statistics.median(excess[COLD]) / max(statistics.median(excess[WARM]), 1e-9)
        print(f"cold / warm p50: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one probe cycle costs the operator: CPU and requests per cycle, the full request path every cycle
against the operator's mix (a full path, then FULL_PATH_EVERY - 1 light cycles: probe/client.PathMemo).

One simulator on loopback, one probing process; the two ways alternate in blocks of FULL_PATH_EVERY
cycles, so the machine's noise falls on both alike. CPU is time.process_time() of this process across
each whole cycle (every request, the /metrics parses, the checks); requests are counted by the client.

    .venv/bin/python bench/probe_cost.py [--blocks 10]

Run it with PYTHONPATH=<an older checkout>/operator to measure that checkout's full path (its run_probe
has no memo: only the first row is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

import servedmodel
from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import client as probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.sim.process import SimulatorProcess

BASE = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
WARMUP = 3


@dataclass
class Way:
    name: str
    cpu_ms: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)

    def row(self, base: Way | None) -> str:
        p50, mean = statistics.median(self.cpu_ms), statistics.fmean(self.cpu_ms)
        ratio = f"{statistics.fmean(base.cpu_ms) / mean:.2f}x" if base is not None else "1.00x"
        return (
            f"| {self.name} | {len(self.cpu_ms)} | {statistics.fmean(self.requests):.1f} | {p50:.2f} | "
            f"{mean:.2f} | {max(self.cpu_ms):.2f} | {ratio} |"
        )


async def run(blocks: int) -> list[Way]:
    spec = ProbeSpec()
    every = getattr(probe, "FULL_PATH_EVERY", 10)
    has_memo = "memo" in inspect.signature(probe.run_probe).parameters
    full, mixed = Way("full path every cycle"), Way("operator: full path + light cycles")
    sent: Counter[str] = Counter()

    async def count(request: httpx.Request) -> None:
        sent[request.url.path] += 1

    async with SimulatorProcess(BASE, ready_timeout=60) as sim:
        target = resolve_external(sim.base_url)
        async with probe.probe_client(spec) as client:
            client.event_hooks["request"].append(count)

            async def cycle(way: Way | None, memo: object) -> None:
                kwargs = {"memo": memo} if memo is not None else {}
                metrics = probe.PodMetrics(client, [sim.base_url], "qwen")
                sent.clear()
                c0 = time.process_time()
                out = await probe.run_probe(client, target, spec, model="qwen", metrics=metrics, **kwargs)
                c1 = time.process_time()
                if out.failure is not None:
                    raise RuntimeError(f"probe failed: {out.failure}")
                if way is not None:
                    way.cpu_ms.append((c1 - c0) * 1000)
                    way.requests.append(sum(sent.values()))

            for _ in range(WARMUP):
                await cycle(None, None)
            memo = probe.PathMemo("bench") if has_memo else None
            for _ in range(blocks):
                for _ in range(every):
                    await cycle(full, None)
                if memo is not None:
                    for _ in range(every):
                        await cycle(mixed, memo)
    return [full, mixed] if has_memo else [full]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10, help="blocks of FULL_PATH_EVERY cycles per way")
    args = parser.parse_args()
    ways = asyncio.run(run(args.blocks))
    print(f"servedmodel from {servedmodel.__file__}")
    print("| probe cycles | n | requests per cycle | CPU ms p50 | CPU ms mean | CPU ms max | vs full path |")
    print("|---|---|---|---|---|---|---|")
    for way in ways:
        print(way.row(ways[0] if way is not ways[0] else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

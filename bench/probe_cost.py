"""What one probe cycle costs the operator: CPU and requests per cycle, the full request path every cycle
against the operator's mix (a full path, then FULL_PATH_EVERY - 1 light cycles: probe/client.PathMemo),
for each way of running the probe: asyncio's or uvloop's event loop, httpx's own transport or the
probe's HTTP/1.1 transport (wire/http11.py).

One simulator on loopback, one probing process. Each way runs on its own ProbeLoop (a thread with its own
event loop, as in the operator) with its own client; the cycles are submitted from the main loop. The ways
and the two kinds of cycle alternate in blocks of FULL_PATH_EVERY cycles, so the machine's noise falls on
all alike. CPU is time.process_time() of this process across each whole cycle (every request, the
/metrics parses, the checks, the hand-over between the loops); requests are counted by the client.

    .venv/bin/python bench/probe_cost.py [--blocks 5]

Run it with PYTHONPATH=<an older checkout>/operator to measure that checkout: the ways it lacks are left
out (without a memo in its run_probe, only the full path is measured).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

import servedmodel
from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import client as probe
from servedmodel.probe import loop as probe_loop
from servedmodel.probe.endpoints import resolve_external
from servedmodel.sim.process import SimulatorProcess

BASE = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
WARMUP = 3


@dataclass
class Way:
    name: str
    cpu_ms: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)

    def row(self, base: Way) -> str:
        p50, mean = statistics.median(self.cpu_ms), statistics.fmean(self.cpu_ms)
        ratio = statistics.fmean(base.cpu_ms) / mean
        return (
            f"| {self.name} | {len(self.cpu_ms)} | {statistics.fmean(self.requests):.1f} | {p50:.2f} | "
            f"{mean:.2f} | {max(self.cpu_ms):.2f} | {ratio:.2f}x |"
        )


@dataclass
class Setup:
    """One way of running the probe: its event loop and its client's transport."""

    name: str
    loop_factory: Callable[[], asyncio.AbstractEventLoop]
    transport: Callable[[], httpx.AsyncBaseTransport] | None  # None: httpx's own
    full: Way = field(init=False)
    mixed: Way = field(init=False)
    loop: probe_loop.ProbeLoop = field(init=False)
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.full = Way(f"{self.name}: full path every cycle")
        self.mixed = Way(f"{self.name}: full path + light cycles")


def setups() -> list[Setup]:
    """What this checkout can run: asyncio + httpx always; uvloop and the probe's transport if present."""
    out = [Setup("asyncio, httpx", asyncio.new_event_loop, None)]
    lean: Callable[[], httpx.AsyncBaseTransport] | None = getattr(probe, "probe_transport", None)
    uvloop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        uvloop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    if "loop_factory" not in inspect.signature(probe_loop.ProbeLoop).parameters:
        return out
    if uvloop_factory is not None:
        out.append(Setup("uvloop, httpx", uvloop_factory, None))
    if lean is not None:
        out.append(Setup("asyncio, probe transport", asyncio.new_event_loop, lean))
        if uvloop_factory is not None:
            out.append(Setup("uvloop, probe transport", uvloop_factory, lean))
    return out


def client_for(
    s: Setup, spec: ProbeSpec, sent: Counter[str], hook: Callable[[httpx.Request], Awaitable[None]]
) -> httpx.AsyncClient:
    """The client as the operator makes it (probe/client.http_client: no cookies kept, the lean path
    under httpx's client where the checkout has one) over the way's transport; requests counted where
    they are sent: at the probe transport's exchange where the checkout has it (the lean path passes no
    event hook), else by an event hook."""
    transport = s.transport() if s.transport is not None else httpx.AsyncHTTPTransport(trust_env=False)
    make: Callable[..., httpx.AsyncClient] | None = getattr(probe, "http_client", None)
    if make is None:
        return httpx.AsyncClient(
            transport=transport,
            timeout=probe.http_timeout(spec),
            trust_env=False,
            event_hooks={"request": [hook]},
        )
    exchange = getattr(transport, "exchange", None)
    if exchange is not None:

        async def counted(host: str, port: int, wire: bytes, *args: Any, **kwargs: Any) -> Any:
            sent[wire.split(b" ", 2)[1].split(b"?", 1)[0].decode()] += 1
            return await exchange(host, port, wire, *args, **kwargs)

        transport.exchange = counted  # type: ignore[attr-defined]
        return make(spec, transport)
    client = make(spec, transport)
    client.event_hooks = {"request": [hook]}
    return client


async def run(blocks: int) -> list[Way]:
    spec = ProbeSpec()
    every = getattr(probe, "FULL_PATH_EVERY", 10)
    has_memo = "memo" in inspect.signature(probe.run_probe).parameters
    loop_factory = "loop_factory" in inspect.signature(probe_loop.ProbeLoop).parameters
    ways = setups()
    sent: Counter[str] = Counter()

    async def count(request: httpx.Request) -> None:
        sent[request.url.path] += 1

    async with SimulatorProcess(BASE, ready_timeout=60) as sim:
        target = resolve_external(sim.base_url)

        async def cycle(s: Setup, way: Way | None, memo: object) -> None:
            kwargs = {"memo": memo} if memo is not None else {}
            metrics = probe.PodMetrics(s.client, [sim.base_url], "qwen")
            sent.clear()
            c0 = time.process_time()
            out = await s.loop.submit(
                probe.run_probe(s.client, target, spec, model="qwen", metrics=metrics, **kwargs)
            )
            c1 = time.process_time()
            if out.failure is not None:
                raise RuntimeError(f"{s.name}: probe failed: {out.failure}")
            if way is not None:
                way.cpu_ms.append((c1 - c0) * 1000)
                way.requests.append(sum(sent.values()))

        try:
            for s in ways:
                kw: dict[str, Any] = {"loop_factory": s.loop_factory} if loop_factory else {}
                s.loop = probe_loop.ProbeLoop(f"bench-{s.name}", **kw)
                s.loop.start()
                s.client = client_for(s, spec, sent, count)
                for _ in range(WARMUP):
                    await cycle(s, None, None)
            memos = {s.name: probe.PathMemo("bench") if has_memo else None for s in ways}
            for _ in range(blocks):
                for s in ways:
                    for _ in range(every):
                        await cycle(s, s.full, None)
                    for _ in range(every if has_memo else 0):
                        await cycle(s, s.mixed, memos[s.name])
        finally:
            for s in ways:
                await s.loop.stop([s.client.aclose])
    return [w for s in ways for w in ((s.full, s.mixed) if has_memo else (s.full,))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5, help="blocks of FULL_PATH_EVERY cycles per way")
    args = parser.parse_args()
    ways = asyncio.run(run(args.blocks))
    print(f"servedmodel from {servedmodel.__file__}")
    print("| probe cycles | n | requests per cycle | CPU ms p50 | CPU ms mean | CPU ms max | vs first row |")
    print("|---|---|---|---|---|---|---|")
    for way in ways:
        print(way.row(ways[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much one core of the simulator sustains: concurrent streams, streamed tokens/s, step-clock lateness.

Method
- The simulator runs as its own process pinned to CPU 0 (`taskset -c 0`); this script, the load
  generator, pins itself to CPU 1, so the client is not sharing the server's core.
- The client keeps N chat streams open at all times (closed loop: a finished stream is replaced at once),
  over raw HTTP/1.1 keep-alive connections with asyncio streams, counting SSE content chunks in the bytes as
  they arrive (no JSON parsing), so it is not the bottleneck.
- After a warm-up the window opens (/debug/reset), and closes after --seconds: streamed tokens/s is the
  server's vllm:generation_tokens_total delta over the window; chunks/s is what the client received;
  lateness is the engine's own measure per step (wake time - scheduled step end), p50/p99/max over the
  window, from /debug/engine.
- The step-time model is set so the engine *demands* more than the target (demand = streams / step time);
  when the core cannot keep up, lateness and a shortfall against demand show it.

    .venv/bin/python bench/sim_throughput.py                 # the default sweep: 128, 512, 1024 streams
    .venv/bin/python bench/sim_throughput.py --streams 512 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servedmodel.sim.process import SimulatorProcess

CONTENT = b'"delta":{"content":'


@dataclass
class Row:
    streams: int
    step_ms: float
    demand_tps: float
    tokens_per_s: float
    chunks_per_s: float
    lateness_p50_ms: float
    lateness_p99_ms: float
    lateness_max_ms: float
    steps: int
    server_cpu: float  # share of one core the server used in the window
    tokens_per_cpu_s: float  # tokens streamed per second of server CPU: what a whole core would sustain


class Load:
    """N closed-loop streams over raw keep-alive connections; counts content chunks."""

    def __init__(self, port: int, streams: int, max_tokens: int) -> None:
        self.port = port
        self.streams = streams
        body = json.dumps(
            {
                "model": "qwen",
                "messages": [{"role": "user", "content": "one two three four five six seven eight"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.chunks = 0
        self.completed = 0
        self.stopping = False

    async def _conn(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while not self.stopping:
                writer.write(self.request)
                tail = b""
                done = False
                while True:
                    data = await asyncio.wait_for(reader.read(65536), timeout=60)
                    if not data:
                        return
                    window = tail + data
                    self.chunks += window.count(CONTENT)
                    tail = window[-(len(CONTENT) - 1) :]
                    if not done and b"[DONE]" in window:
                        done = True
                    if done and window.endswith(b"0\r\n\r\n"):
                        break
                self.completed += 1
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._conn()) for _ in range(self.streams)]
        await stop.wait()
        self.stopping = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generation_tokens(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:generation_tokens_total":
                return float(s.value)
    raise RuntimeError("vllm:generation_tokens_total missing")


async def measure(sim: SimulatorProcess, streams: int, seconds: float, warmup: float, max_tokens: int) -> Row:
    load = Load(sim.port, streams, max_tokens)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    await asyncio.sleep(warmup)
    async with httpx.AsyncClient(timeout=10) as h:
        await h.post(f"{sim.base_url}/debug/reset")
        tokens0 = await asyncio.to_thread(generation_tokens, sim.base_url)
        chunks0, t0, cpu0 = load.chunks, time.monotonic(), cpu_seconds(sim.pid)
        await asyncio.sleep(seconds)
        tokens1 = await asyncio.to_thread(generation_tokens, sim.base_url)
        chunks1, t1, cpu1 = load.chunks, time.monotonic(), cpu_seconds(sim.pid)
        eng = (await h.get(f"{sim.base_url}/debug/engine")).json()
        cfg = (await h.get(f"{sim.base_url}/admin/config")).json()
    stop.set()
    await runner
    step_ms = cfg["step_base_ms"] + cfg["running_seq_ms"] * streams
    return Row(
        streams=streams,
        step_ms=step_ms,
        demand_tps=streams / (step_ms / 1000),
        tokens_per_s=(tokens1 - tokens0) / (t1 - t0),
        chunks_per_s=(chunks1 - chunks0) / (t1 - t0),
        lateness_p50_ms=eng["lateness_p50_ms"],
        lateness_p99_ms=eng["lateness_p99_ms"],
        lateness_max_ms=eng["lateness_max_ms"],
        steps=int(eng["steps"]),
        server_cpu=(cpu1 - cpu0) / (t1 - t0),
        tokens_per_cpu_s=(tokens1 - tokens0) / max(cpu1 - cpu0, 1e-9),
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--step-base-ms", type=float, default=6.0)
    parser.add_argument("--running-seq-ms", type=float, default=0.02)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness for the server process (e.g. -10 on a machine shared with other jobs; needs root)",
    )
    args = parser.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[0]
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[1]})  # the load generator on another core than the server
    rows: list[Row] = []
    for streams in args.streams:
        sim_args = [
            "--served-model-name",
            "qwen",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            str(streams),
            "--sim-step-base-ms",
            str(args.step_base_ms),
            "--sim-running-seq-ms",
            str(args.running_seq_ms),
            "--log-level",
            "WARNING",
        ]
        with SimulatorProcess(sim_args, ready_timeout=60, cpu=server_cpu) as sim:
            if args.nice:
                os.setpriority(os.PRIO_PROCESS, sim.pid, args.nice)
            rows.append(asyncio.run(measure(sim, streams, args.seconds, args.warmup, args.max_tokens)))

    load = os.getloadavg()
    client_cpu = cpus[1] if len(cpus) > 1 else server_cpu
    print(f"server pinned to CPU {server_cpu}, load generator on CPU {client_cpu}; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    print(f"window {args.seconds:.0f} s after {args.warmup:.0f} s warm-up; step = {args.step_base_ms} ms + "
          f"{args.running_seq_ms} ms x running sequences; server niceness {args.nice}")  # fmt: skip
    header = (
        "streams",
        "step ms",
        "demand tok/s",
        "tokens/s",
        "chunks/s",
        "late p50 ms",
        "late p99 ms",
        "late max ms",
        "server CPU",
        "tok/CPU-s",
    )
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        cells = (
            f"{r.streams}",
            f"{r.step_ms:.2f}",
            f"{r.demand_tps:,.0f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.chunks_per_s:,.0f}",
            f"{r.lateness_p50_ms:.3f}",
            f"{r.lateness_p99_ms:.3f}",
            f"{r.lateness_max_ms:.3f}",
            f"{r.server_cpu:.0%}",
            f"{r.tokens_per_cpu_s:,.0f}",
        )
        print(" | ".join(f"{c:>12}" for c in cells))
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

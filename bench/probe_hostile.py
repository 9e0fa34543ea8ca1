"""What a hostile engine costs the prober: one probe per mode of tests/probe/hostile_engine.py (100 MB
/v1/models, 200 MB /metrics without a newline, an endless stream, 100,000 nested brackets, one byte every
0.5 s, non-UTF-8, an endless SSE line, an echoed API key), through the real probe code (run_probe with
/metrics) in this process: the failure reason, the seconds it took and the process's peak RSS growth
(VmHWM reset through /proc/self/clear_refs, less VmRSS before).

Usage: .venv/bin/python bench/probe_hostile.py
       PYTHONPATH=<an older checkout>/operator .venv/bin/python bench/probe_hostile.py   # the same, old code
Target: every mode its own failure reason, in seconds, RSS growth < 50 MB.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "probe"))

from hostile_engine import MODES, Hostile, PeakRSS, serve

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe.client import PodMetrics, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external

SPEC = {"timeout": 8, "firstByteTimeout": 1, "checkLimits": False, "stop": [], "maxTokens": 16}
API_KEY = "sk-tenant-0123456789abcdef"


async def one(mode: str) -> tuple[str, float, float]:
    spec = ProbeSpec.model_validate(SPEC)
    async with serve(Hostile(mode, trickle_s=0.5)) as url:
        target = resolve_external(url)
        async with probe_client(spec) as client:
            with PeakRSS() as rss:
                t0 = time.monotonic()
                try:
                    out = await run_probe(
                        client,
                        target,
                        spec,
                        model="qwen",
                        api_key=API_KEY,
                        metrics=PodMetrics(client, target.metrics_urls, "qwen"),
                    )
                    if out.failure is not None:
                        what = out.failure.reason
                    else:
                        mf = getattr(out, "metrics_failure", None)
                        what = f"Serving (metrics: {mf.reason if mf else out.metrics_error or 'ok'})"
                    if API_KEY in str(out.failure.message if out.failure else ""):
                        what += " + API KEY IN MESSAGE"
                except Exception as exc:  # the old prober let some escape the cycle
                    what = f"escaped: {type(exc).__name__}"
                took = time.monotonic() - t0
    return what, took, rss.growth_mb


async def main() -> None:
    print(f"{'mode':16} {'outcome':44} {'seconds':>8} {'RSS growth MB':>14}")
    for mode in MODES:
        what, took, growth = await one(mode)
        print(f"{mode:16} {what[:44]:44} {took:8.2f} {growth:14.1f}")


if __name__ == "__main__":
    asyncio.run(main())

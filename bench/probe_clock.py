"""Is the probe's clock immune to the operator's load? The real ProbeScheduler (started: its loop and its
probe loop) probes a simulator on loopback (2 ms engine steps, 32 tokens) while a task blocks the main
event loop in bursts (time.sleep 50 ms, 3 ms apart: the main loop busy 94 % of the time), and once with
the main loop idle. For each cycle: client TTFT, TPOT, ITL p50 and bursts/chunks (status.probe.client,
checks.streaming) against the engine's own TTFT and TPOT (status.probe.server: the simulator's
histograms of that one request), and the main loop's lag (servedmodel_event_loop_lag_seconds).

Usage: .venv/bin/python bench/probe_clock.py [--cycles 2]
       PYTHONPATH=<an older checkout>/operator .venv/bin/python bench/probe_clock.py   # the old code
Target: with the main loop blocked, client TPOT and ITL p50 within 10 % of the engine's TPOT, the TTFT
excess as with the loop idle, one burst per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests" / "probe")]

import replica_support  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from replica_support import Cluster  # noqa: E402

from loopback import SIM_ARGS  # noqa: E402
from servedmodel.sim.process import SimulatorProcess  # noqa: E402


def body(url: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "qwen", "namespace": "ns", "generation": 1, "uid": "uid-qwen"},
        "spec": {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "servedModelName": "qwen",
            "endpoint": url,
            "probe": {"interval": 5, "checkLimits": False, "maxTokens": 32, "stop": []},
        },
    }


async def run(url: str, cycles: int, blocked: bool) -> list[dict[str, Any]]:
    kube = Cluster()
    kube.add(body(url))
    registry = CollectorRegistry()
    sched = replica_support.scheduler(kube, registry=registry, seed=2)  # the tests' scheduler on loopback
    sched.track(kube.objects[("ns", "qwen")])
    stop = asyncio.Event()

    async def blocker() -> None:
        while not stop.is_set():
            time.sleep(0.05)  # noqa: ASYNC251  (blocking the main loop is the point)
            await asyncio.sleep(0.003)

    await sched.start()
    task = asyncio.create_task(blocker()) if blocked else None
    try:
        for _ in range(int((6 * cycles + 5) / 0.02)):  # bounded: ~6 s a cycle
            if len(kube.writes) >= cycles:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        if task is not None:
            task.cancel()
        await sched.stop()
    rows = []
    for _, _, patch in kube.writes[:cycles]:
        p = patch["probe"]
        rows.append(
            {
                "client": p.get("client") or {},
                "server": p.get("server") or {},
                "streaming": (p.get("checks") or {}).get("streaming") or {},
                "message": p.get("message") or "",
            }
        )
    lag = registry.get_sample_value("servedmodel_event_loop_lag_seconds_sum", {"loop": "main"})
    n = registry.get_sample_value("servedmodel_event_loop_lag_seconds_count", {"loop": "main"})
    for r in rows:
        r["main_lag_mean_ms"] = (lag / n * 1000) if lag is not None and n else None
    return rows


def fmt(v: Any) -> str:
    return f"{v:8.3f}" if isinstance(v, int | float) else f"{'-':>8}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=2)
    args = ap.parse_args()
    with SimulatorProcess(SIM_ARGS, ready_timeout=60) as sim:
        print(
            f"{'main loop':10} {'cycle':>5} {'TTFT':>8} {'srvTTFT':>8} {'TPOT':>8} {'ITLp50':>8} "
            f"{'srvTPOT':>8} {'lag ms':>8}  streaming"
        )
        for blocked in (False, True):
            for i, r in enumerate(asyncio.run(run(sim.base_url, args.cycles, blocked)), 1):
                c, s = r["client"], r["server"]
                verdict = f"{r['streaming'].get('reason', '?')}: {r['streaming'].get('message', '')}"
                state = "blocked" if blocked else "idle"
                print(
                    f"{state:10} {i:5} {fmt(c.get('ttftMs'))} {fmt(s.get('ttftMs'))} "
                    f"{fmt(c.get('tpotMs'))} {fmt(c.get('itlP50Ms'))} {fmt(s.get('tpotMs'))} "
                    f"{fmt(r['main_lag_mean_ms'])}  {verdict[:90]}"
                )


if __name__ == "__main__":
    main()

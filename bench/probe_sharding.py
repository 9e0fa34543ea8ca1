"""Probe capacity with 1, 2 and 3 operator replicas sharing the probing (SERVEDMODEL_PROBE_SHARDING).

Method: one local control plane, one simulator on 127.0.0.1 (every engine pod's probe goes there through
SERVEDMODEL_ENDPOINT_OVERRIDE), N ServedModels probed every --interval seconds: a demand of
N / interval probe cycles a second. Each replica runs --concurrency cycles at once (a small
SERVEDMODEL_PROBE_CONCURRENCY, so that one replica cannot meet the demand and the slots, not this
machine's two cores, are what limits it). For k = 1, 2, 3 replicas: k operators on the namespace, a
warm-up, then a window of --window seconds in which the probe cycles started
(`servedmodel_probe_start_lateness_seconds_count`, summed over the replicas) and the starts more than
1 s late (the histogram's le=1.0 bucket) are counted. Between configurations the operators stop with
SIGTERM (their member Leases are deleted).

    .venv/bin/python bench/probe_sharding.py                      # 60 models every 10 s, 1 slot each
    .venv/bin/python bench/probe_sharding.py -n 90 --window 90
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_support import OperatorProcess, controlplane, prepare, scrape, total
from servedmodel.sim.process import SimulatorProcess

NAMESPACE = "bench"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def body(name: str, interval: int) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": {
            "model": MODEL,
            "servedModelName": "qwen",
            "engine": {"kind": "simulator"},
            "resources": {"gpus": 0},
            "probe": {"interval": interval, "readinessGate": False},  # as docs/benchmarks.md measured
        },
    }


def window(ops: list[OperatorProcess], seconds: float) -> tuple[float, float, list[int]]:
    """(cycles started, of them late > 1 s, scheduled models per replica) over `seconds`."""
    name = "servedmodel_probe_start_lateness_seconds"
    before = [scrape(op.metrics_port) for op in ops]
    time.sleep(seconds)
    after = [scrape(op.metrics_port) for op in ops]
    started = sum(
        total(a, f"{name}_count") - total(b, f"{name}_count") for a, b in zip(after, before, strict=True)
    )
    on_time = sum(
        total(a, f"{name}_bucket", le="1.0") - total(b, f"{name}_bucket", le="1.0")
        for a, b in zip(after, before, strict=True)
    )
    scheduled = [int(total(a, "servedmodel_probe_scheduled_models")) for a in after]
    return started, started - on_time, scheduled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=60, help="ServedModels")
    parser.add_argument("--interval", type=int, default=10, help="probe interval, s")
    # 1: before namespaces got demand-sized shares (2026-12-06) a replica's 2 slots were 1 for this
    # bench's one namespace (a fixed quarter, at least 1), which is what its earlier figures measured.
    parser.add_argument("--concurrency", type=int, default=1, help="probe cycles at once per replica")
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    demand = args.n / args.interval
    sim_args = [MODEL, "--served-model-name", "qwen", "--max-model-len", "4096", "--sim-step-base-ms", "20"]
    rows = []
    with controlplane.running() as cp, SimulatorProcess(args=sim_args) as sim:
        prepare(cp, NAMESPACE)
        path = f"/apis/inference.servedmodel.io/v1alpha1/namespaces/{NAMESPACE}/servedmodels"
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(lambda i: cp.request("POST", path, body(f"m{i:03d}", args.interval)), range(args.n))
            )
        os.environ.update(
            {
                "SERVEDMODEL_PROBE_SHARDING": "true",
                "SERVEDMODEL_PROBE_CONCURRENCY": str(args.concurrency),
                "SERVEDMODEL_ALLOWED_TARGETS": "127.0.0.1",
            }
        )
        for replicas in (1, 2, 3):
            ops = [
                OperatorProcess(cp, NAMESPACE, endpoint_override=sim.base_url, quiet=True)
                for _ in range(replicas)
            ]
            try:
                for op in ops:
                    op.__enter__()
                time.sleep(args.warmup)
                started, late, scheduled = window(ops, args.window)
            finally:
                for op in ops:
                    op.stop()
            rate = started / args.window
            rows.append((replicas, rate, rate / demand, late / max(started, 1.0), scheduled))
            print(
                f"{replicas} replicas: {rate:.2f} cycles/s, late {late:.0f}/{started:.0f}, "
                f"shares {scheduled}",
                flush=True,
            )
    print(
        f"\n{args.n} ServedModels every {args.interval} s (demand {demand:.1f} cycles/s), "
        f"{args.concurrency} slots per replica:\n"
    )
    print("| replicas | probe cycles/s | of the demand | starts > 1 s late | models per replica |")
    print("|---|---|---|---|---|")
    for replicas, rate, share, late, scheduled in rows:
        print(f"| {replicas} | {rate:.2f} | {share:.0%} | {late:.0%} | {' / '.join(map(str, scheduled))} |")
    if args.json is not None:
        figures = {
            "models": args.n,
            "interval_s": args.interval,
            "demand_per_s": demand,
            "replicas": [
                {"replicas": r, "cycles_per_s": rate, "of_demand": share, "late": late, "shares": scheduled}
                for r, rate, share, late, scheduled in rows
            ],
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

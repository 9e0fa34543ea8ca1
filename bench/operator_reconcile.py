"""What the operator costs on the local control plane: apply → Ready, Ready → first probe, status writes, RSS.

Method
- One control plane (hack/controlplane.py: real kube-apiserver, controller-manager, scheduler, and kwok
  with a fake 8-GPU node, so engine Deployments become available without a process behind them).
- One simulator on 127.0.0.1; the operator runs as a subprocess with SERVEDMODEL_ENDPOINT_OVERRIDE pointing
  at it, so every ServedModel's probe goes to that simulator (never to the fake pods' addresses).
- N ServedModels are applied at once (up to 8 on GPUs, the rest with engine.kind simulator and no GPU);
  the script polls `kubectl get sm` and records, per object, apply → phase Ready and apply → status.probe set.
- Then it stays idle for --idle seconds and reads the operator's own /metrics before and after: reconcile
  counts and durations, status writes, Kubernetes API requests. RSS is the operator process's VmRSS.

    .venv/bin/python bench/operator_reconcile.py            # 10 ServedModels, 35 s idle
    .venv/bin/python bench/operator_reconcile.py -n 20 --idle 65
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import yaml

from bench_support import OperatorProcess, Proc, controlplane, pct, prepare, print_rows, scrape, total
from servedmodel.sim.process import SimulatorProcess

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
NAMESPACE = "bench"


def servedmodel(i: int) -> dict[str, Any]:
    on_gpu = i < 8  # the kwok node advertises 8 GPUs
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": f"m{i}"},
        "spec": {
            "model": MODEL,
            "engine": {"kind": "vllm" if on_gpu else "simulator"},
            "resources": {"gpus": 1 if on_gpu else 0},
            "probe": {"interval": 60, "readinessGate": False},  # Ready as docs/benchmarks.md measured it
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=10, help="ServedModels to apply (default 10)")
    parser.add_argument(
        "--idle", type=float, default=35.0, help="idle seconds after all are probed (default 35)"
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="give up waiting after this many seconds"
    )
    args = parser.parse_args()

    with controlplane.running() as cp, SimulatorProcess([MODEL, "--max-model-len", "4096"]) as sim:
        prepare(cp, NAMESPACE)
        with OperatorProcess(cp, NAMESPACE, endpoint_override=sim.base_url, quiet=True) as operator:
            proc = Proc(operator.pid, sample=False)
            rss_idle = proc.rss_mb()
            applied: dict[str, float] = {}
            for i in range(args.n):
                obj = servedmodel(i)
                applied[obj["metadata"]["name"]] = time.monotonic()
                cp.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(obj))
            ready: dict[str, float] = {}
            probed: dict[str, float] = {}
            deadline = time.monotonic() + args.timeout
            while len(probed) < args.n and time.monotonic() < deadline:
                items = cp.get_json("sm", "-n", NAMESPACE)["items"]
                now = time.monotonic()
                for item in items:
                    name, status = item["metadata"]["name"], item.get("status") or {}
                    if name not in ready and status.get("phase") == "Ready":
                        ready[name] = now - applied[name]
                    if name not in probed and (status.get("probe") or {}).get("result"):
                        probed[name] = now - applied[name]
                time.sleep(0.1)
            before = scrape(operator.metrics_port)
            versions = {
                i["metadata"]["name"]: i["metadata"]["resourceVersion"]
                for i in cp.get_json("sm", "-n", NAMESPACE)["items"]
            }
            time.sleep(args.idle)
            after = scrape(operator.metrics_port)
            versions_after = {
                i["metadata"]["name"]: i["metadata"]["resourceVersion"]
                for i in cp.get_json("sm", "-n", NAMESPACE)["items"]
            }
            rss_busy = proc.rss_mb()

    if not ready:
        print("no ServedModel became Ready", file=sys.stderr)
        return 1
    r, p = sorted(ready.values()), sorted(probed[k] - ready[k] for k in probed if k in ready)
    refresh = "servedmodel_reconcile_duration_seconds_count"
    idle_refreshes = total(after, refresh) - total(before, refresh)
    idle_writes = total(after, "servedmodel_status_writes_total") - total(
        before, "servedmodel_status_writes_total"
    )
    idle_requests = total(after, "servedmodel_kube_api_requests") - total(
        before, "servedmodel_kube_api_requests"
    )
    changed = sum(versions[k] != versions_after.get(k) for k in versions)
    rows = [
        ("ServedModels applied / Ready / probed", f"{args.n} / {len(ready)} / {len(probed)}"),
        ("apply → phase Ready, s (min / p50 / max)", f"{r[0]:.2f} / {pct(r, 50):.2f} / {r[-1]:.2f}"),
        (
            "Ready → first probe in status, s (min / p50 / max)",
            f"{p[0]:.2f} / {pct(p, 50):.2f} / {p[-1]:.2f}" if p else "—",
        ),
        (
            "reconciler status writes until probed, per ServedModel",
            f"{total(before, 'servedmodel_status_writes_total') / args.n:.1f}",
        ),
        (
            f"idle {args.idle:.0f} s: reconciles / reconciler status writes / API requests",
            f"{idle_refreshes:.0f} / {idle_writes:.0f} / {idle_requests:.0f}",
        ),
        (
            f"idle {args.idle:.0f} s: ServedModels whose resourceVersion changed (probe writes included)",
            f"{changed} of {len(versions)}",
        ),
        ("operator RSS, MB (started / with all probed)", f"{rss_idle:.0f} / {rss_busy:.0f}"),
    ]
    print_rows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

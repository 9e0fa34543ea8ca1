"""How fast the local kube-apiserver creates Services while Deployments churn: ClusterIP vs headless.

Why: in bench/operator_scale.py the API server's own histogram puts a ServedModel's first apply on its
Service create (APPLY services, seconds each at 1,000 ServedModels, against ~0.2 s for the Deployment),
and the Ready time of the fleet follows it. This isolates that cost without the operator: N
Deployments and N Services applied through servedmodel.k8s.KubeClient (server-side apply, 32 in
flight), once with ClusterIP Services (the operator's engine Service), once headless (clusterIP: None,
no ClusterIP allocation: the API server's IPAddress allocator is not involved), each on a fresh control
plane with kwok making the Deployments' pods Ready.

    .venv/bin/python bench/service_create.py            # N = 1000
    .venv/bin/python bench/service_create.py -n 300
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench_support import controlplane, pct, print_rows
from servedmodel.k8s import KubeClient, load_identity

IN_FLIGHT = 32


def service(i: int, cluster_ip: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"app": f"a{i}"}, "ports": [{"name": "http", "port": 8000}]}
    if cluster_ip is not None:
        spec["clusterIP"] = cluster_ip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"s{i}", "namespace": "default"},
        "spec": spec,
    }


def deployment(i: int) -> dict[str, Any]:
    labels = {"app": f"a{i}"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"d{i}", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }


async def burst(cp: controlplane.ControlPlane, n: int, cluster_ip: str | None) -> dict[str, list[float]]:
    latency: dict[str, list[float]] = {"Deployment": [], "Service": []}
    async with KubeClient(load_identity(str(cp.kubeconfig)), max_inflight=64) as client:
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def one(obj: dict[str, Any]) -> None:
            async with slots:
                t0 = time.monotonic()
                await client.apply(obj, "bench", force=True)
                latency[obj["kind"]].append(time.monotonic() - t0)

        t0 = time.monotonic()
        await asyncio.gather(*(one(o) for i in range(n) for o in (deployment(i), service(i, cluster_ip))))
        latency["all"] = [time.monotonic() - t0]
    return latency


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=1000, help="Deployments and Services each (default 1000)")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    for label, cluster_ip in (("ClusterIP", None), ("headless", "None")):
        with controlplane.running() as cp:
            got = asyncio.run(burst(cp, args.n, cluster_ip))
        for kind in ("Service", "Deployment"):
            values = sorted(got[kind])
            rows.append(
                (
                    f"{label}: {kind} apply, s (p50 / p95 / max)",
                    f"{pct(values, 50):.3f} / {pct(values, 95):.3f} / {values[-1]:.3f}",
                )
            )
        rows.append(
            (
                f"{label}: {args.n} of each applied in, s / Services per s",
                f"{got['all'][0]:.1f} / {args.n / got['all'][0]:.1f}",
            )
        )
    print_rows(rows, markdown=True, title=f"N = {args.n}, {IN_FLIGHT} in flight")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

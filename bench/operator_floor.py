"""The reconcile path against the API server's floor, side by side in one run (issue 21).

- floor: for N ServedModels, the Deployment and Service the operator renders for each
  (servedmodel.render, the same objects, without the owner reference no ServedModel exists for), applied
  by an ideal client: the operator's own KubeClient, server-side apply, 64 in flight, no custom resource,
  no status. Done when every Deployment is available (status.availableReplicas ≥ 1, seen on a watch).
- operator: a fresh control plane, the operator as a subprocess with every probe going to one simulator
  (probes on, every 60 s, the readiness gate off so that Ready is the Deployments', as
  bench/operator_scale.py), the N ServedModels created 64 in flight. Done when every one is phase Ready.

Both from the first request, each on a fresh control plane (hack/controlplane.py: kwok makes the pods
Ready at once). Printed: both times, their ratio (goal ≤ 1.2), and the operator's CPU per ServedModel
from the first create until all are Ready (goal ≤ 10 ms).

    .venv/bin/python bench/operator_floor.py            # N = 1000
    .venv/bin/python bench/operator_floor.py -n 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench_support import OperatorProcess, Proc, controlplane, prepare, print_rows
from operator_scale import NAMESPACE, servedmodel
from servedmodel.api import ServedModel
from servedmodel.k8s import GoneError, KubeClient, load_identity
from servedmodel.render import RenderContext, render
from servedmodel.sim.process import SimulatorProcess

IN_FLIGHT = 64
FIELD_MANAGER = "bench-floor"


def children(i: int) -> list[dict[str, Any]]:
    """What the operator applies for ServedModel i in this cluster (no Route or ServiceMonitor API)."""
    body = servedmodel(i, probe_interval=60, probe=True)
    return render(ServedModel.from_body(body), RenderContext())


async def until_all(
    client: KubeClient, api_version: str, plural: str, n: int, done: Callable[[dict[str, Any]], bool]
) -> float:
    """Wait until `n` objects of the namespace satisfy `done`, from a list and its watch (listed again
    when the watch ends or expires); the monotonic time it was first seen."""
    seen: set[str] = set()
    while True:
        items, rv = await client.list_at(api_version, plural, NAMESPACE)
        seen |= {o["metadata"]["name"] for o in items if done(o)}
        if len(seen) >= n:
            return time.monotonic()
        try:
            async for type_, obj in client.watch(api_version, plural, NAMESPACE, resource_version=rv):
                if type_ in ("ADDED", "MODIFIED") and done(obj):
                    seen.add(obj["metadata"]["name"])
                    if len(seen) >= n:
                        return time.monotonic()
        except GoneError:
            continue


def available(obj: dict[str, Any]) -> bool:
    return int((obj.get("status") or {}).get("availableReplicas") or 0) >= 1


def ready(obj: dict[str, Any]) -> bool:
    return (obj.get("status") or {}).get("phase") == "Ready"


async def in_flight(send: Callable[[dict[str, Any]], Awaitable[Any]], objects: list[dict[str, Any]]) -> None:
    """`send` each object, IN_FLIGHT at a time."""
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(obj: dict[str, Any]) -> None:
        async with slots:
            await send(obj)

    await asyncio.gather(*(one(o) for o in objects))


async def floor(cp: controlplane.ControlPlane, n: int) -> float:
    objects = [o for i in range(n) for o in children(i)]
    async with KubeClient(load_identity(str(cp.kubeconfig)), max_inflight=IN_FLIGHT) as client:
        waiter = asyncio.create_task(until_all(client, "apps/v1", "deployments", n, available))
        t0 = time.monotonic()
        await in_flight(lambda o: client.apply(o, FIELD_MANAGER, force=True), objects)
        return await waiter - t0


async def operator(cp: controlplane.ControlPlane, n: int, proc: Proc) -> tuple[float, float]:
    async with KubeClient(load_identity(str(cp.kubeconfig)), max_inflight=IN_FLIGHT) as client:
        waiter = asyncio.create_task(
            until_all(client, "inference.servedmodel.io/v1alpha1", "servedmodels", n, ready)
        )
        cpu0, t0 = proc.cpu_s(), time.monotonic()
        bodies = [servedmodel(i, probe_interval=60, probe=True) for i in range(n)]
        await in_flight(client.create, bodies)
        done = await waiter
        return done - t0, proc.cpu_s() - cpu0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=1000, help="ServedModels (default 1000)")
    parser.add_argument("--timeout", type=float, default=900.0, help="each side's limit, s")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    with controlplane.running() as cp:
        cp.kubectl("create", "namespace", NAMESPACE)
        floor_s = asyncio.run(asyncio.wait_for(floor(cp, args.n), args.timeout))
    with controlplane.running() as cp, SimulatorProcess(["Qwen/Qwen2.5-0.5B-Instruct"]) as sim:
        prepare(cp, NAMESPACE)
        with OperatorProcess(cp, NAMESPACE, endpoint_override=sim.base_url, quiet=True) as op:
            proc = Proc(op.pid)
            try:
                op_s, cpu_s = asyncio.run(asyncio.wait_for(operator(cp, args.n, proc), args.timeout))
            finally:
                proc.stop()
    rows = [
        ("floor: Deployments + Services applied (64 in flight) → all available, s", f"{floor_s:.1f}"),
        ("operator: ServedModels created (64 in flight, probes on) → all Ready, s", f"{op_s:.1f}"),
        ("operator / floor (goal ≤ 1.2)", f"{op_s / floor_s:.2f}"),
        ("operator CPU per ServedModel until all Ready, ms (goal ≤ 10)", f"{cpu_s / args.n * 1000:.1f}"),
    ]
    print_rows(rows, markdown=True, title=f"N = {args.n}")
    if args.json is not None:
        figures = {"models": args.n, "floor_s": floor_s, "operator_s": op_s, "cpu_s": cpu_s}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

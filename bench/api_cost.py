"""What the operator's API requests cost the API server and etcd, in CPU per request (issue 21).

The reconcile path at 1,000 ServedModels is bound by the API server's CPU on this machine (the floor and
the operator both keep it busy), so a request the operator adds costs what the API server and etcd spend
on it. Measured one kind at a time on a fresh control plane, each with 16 in flight:

- POST ServedModel (the user's create), APPLY ServedModel/status (the reconciler's and the probe's writes,
  a Ready status with four conditions), POST Event (the operator's transitions), APPLY Deployment (the
  floor's own request, for scale);
- LIST Events by involvedObject.uid (what the prober sent once per engine pod start for status.startup,
  before the Events watch): at the Events those creates left in the namespace, and again after filler
  Events (`--events`, as a fleet's pods leave). The API server keeps no watch cache of Events
  (kube-apiserver's default --watch-cache-sizes leaves them out), so each such list reads every Event of
  the namespace from etcd.

CPU is utime + stime of kube-apiserver and etcd (/proc) over each step, less their idle rate measured
just before (controllers keep running), divided by its requests.

    .venv/bin/python bench/api_cost.py
    .venv/bin/python bench/api_cost.py -n 300 --events 4000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench_support import controlplane, prepare, print_rows
from operator_floor import children
from operator_scale import NAMESPACE, servedmodel
from servedmodel.k8s import KubeClient, load_identity

IN_FLIGHT = 16
FIELD_MANAGER = "servedmodel-operator"
API = "inference.servedmodel.io/v1alpha1"
READY_STATUS: dict[str, Any] = {
    "phase": "Ready",
    "observedGeneration": 1,
    "replicas": 1,
    "readyReplicas": 1,
    "servedModelName": "qwen",
    "conditions": [
        {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": "the Deployment has 1/1 ready replicas",
            "lastTransitionTime": "2026-12-07T00:00:00Z",
            "observedGeneration": 1,
        }
        for kind, reason in (
            ("Ready", "Available"),
            ("Available", "MinimumReplicasAvailable"),
            ("Progressing", "NewReplicaSetAvailable"),
            ("Degraded", "AsExpected"),
        )
    ],
}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """API server and etcd CPU per request of a step, less their idle rate."""

    def __init__(self, cp: controlplane.ControlPlane) -> None:
        pids = cp.pids()
        self.pids = {name: pids[name] for name in ("kube-apiserver", "etcd")}
        self.idle = dict.fromkeys(self.pids, 0.0)  # CPU s per wall s

    def now(self) -> dict[str, float]:
        return {name: cpu_s(pid) for name, pid in self.pids.items()}

    async def measure_idle(self, seconds: float = 3.0) -> None:
        before, t0 = self.now(), time.monotonic()
        await asyncio.sleep(seconds)
        wall, after = time.monotonic() - t0, self.now()
        self.idle = {k: (after[k] - before[k]) / wall for k in self.pids}

    async def step(
        self, send: Callable[[Any], Awaitable[Any]], items: list[Any]
    ) -> tuple[float, float, float]:
        """(wall s, API server ms, etcd ms per request) of sending every item, IN_FLIGHT at a time."""
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def one(item: Any) -> None:
            async with slots:
                await send(item)

        before, t0 = self.now(), time.monotonic()
        await asyncio.gather(*(one(i) for i in items))
        wall, after = time.monotonic() - t0, self.now()
        per = {k: 1000 * max(0.0, after[k] - before[k] - self.idle[k] * wall) / len(items) for k in self.pids}
        return wall, per["kube-apiserver"], per["etcd"]


async def run(cp: controlplane.ControlPlane, n: int, filler: int, lists: int) -> list[tuple[str, str]]:
    meter = Meter(cp)
    rows: list[tuple[str, str]] = []

    def row(what: str, count: int, figures: tuple[float, float, float]) -> None:
        wall, api, etcd = figures
        rows.append((f"{what} ({count} in {wall:.1f} s)", f"{api:.2f} / {etcd:.2f}"))

    async with KubeClient(load_identity(str(cp.kubeconfig)), max_inflight=IN_FLIGHT) as client:
        created: dict[str, dict[str, Any]] = {}

        async def create(body: dict[str, Any]) -> None:
            created[body["metadata"]["name"]] = await client.create(body)

        async def status(name: str) -> None:
            await client.apply_status(
                API, "servedmodels", NAMESPACE, name, READY_STATUS, "servedmodel-operator"
            )

        async def event(obj: dict[str, Any]) -> None:
            await client.create_event(obj, type="Normal", reason="Ready", message="new → Ready")

        async def events_of(uid: str) -> None:
            await client.list("v1", "events", NAMESPACE, field_selector={"involvedObject.uid": uid})

        await meter.measure_idle()
        row("POST ServedModel", n, await meter.step(create, [servedmodel(i, 60, True) for i in range(n)]))
        await meter.measure_idle()
        row("APPLY ServedModel/status", n, await meter.step(status, list(created)))
        await meter.measure_idle()
        row("POST Event", n, await meter.step(event, list(created.values())))
        uids = [o["metadata"]["uid"] for o in created.values()][:lists]
        for extra in (0, filler):
            if extra:
                await meter.step(event, [created[f"m{i % n:04d}"] for i in range(extra)])
            in_namespace = len(await client.list("v1", "events", NAMESPACE))
            await meter.measure_idle()
            row(
                f"LIST Events by uid, {in_namespace} Events in the namespace",
                lists,
                await meter.step(events_of, uids),
            )
        deployments = [o for i in range(n) for o in children(i) if o["kind"] == "Deployment"]
        await meter.measure_idle()
        row(
            "APPLY Deployment",
            n,
            await meter.step(lambda o: client.apply(o, "bench", force=True), deployments),
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=300, help="ServedModels (and each other write), default 300")
    parser.add_argument("--events", type=int, default=4000, help="filler Events before the second LIST step")
    parser.add_argument("--lists", type=int, default=100, help="LISTs per LIST step")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with controlplane.running() as cp:
        prepare(cp, NAMESPACE)
        rows = asyncio.run(run(cp, args.n, args.events, args.lists))
    print_rows(rows, markdown=args.markdown, title="API server / etcd CPU per request, ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

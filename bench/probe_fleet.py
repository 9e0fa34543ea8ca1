"""The probe across a fleet: what probing N ServedModels costs one operator and whether its figures stay
true (issue 21), for one and for many models side by side in one run.

For each size N: a fresh local control plane, one simulator on 127.0.0.1 (every engine pod's probe goes
there through SERVEDMODEL_ENDPOINT_OVERRIDE), the operator as a subprocess, N ServedModels created 64 in
flight, probed every --interval seconds (a lone model every --single-interval seconds, so that its window
holds enough cycles). Once every model has a probe in status and a --settle has passed (the ramp left
out), a window of --window seconds in which:

- the operator's CPU (/proc, the whole process: once all are Ready the reconciler is idle and what is
  left is the probe) as % of a core, and per probe cycle started (`servedmodel_probe_total`);
- starts more than 1 s late (`servedmodel_probe_start_lateness_seconds`; also counted from the first
  create, the ramp included, as issue 21 first measured it);
- each cycle's client TTFT minus the engine's own (status.probe.client.ttftMs - server.ttftMs, from a
  watch of the ServedModels: every written cycle, not only the last), p50 / p95 / max;
- the probe's stalled samples (figures it refused to publish).

    .venv/bin/python bench/probe_fleet.py                      # N = 1 and 1,000
    .venv/bin/python bench/probe_fleet.py --sizes 1,100 --window 60 --json /tmp/fleet.json

Goals (issue 21): ≤ 15 % of a core at 1,000 every 60 s; TTFT excess p95 ≤ 5 ms and within 1 ms of the
lone model's; late starts ≤ 1 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_support import OperatorProcess, Proc, controlplane, pct, prepare, scrape, total
from operator_floor import IN_FLIGHT, in_flight
from operator_scale import MODEL, NAMESPACE, servedmodel
from servedmodel.k8s import GoneError, KubeClient, load_identity
from servedmodel.sim.process import SimulatorProcess

GROUP = "inference.servedmodel.io/v1alpha1"
LATENESS = "servedmodel_probe_start_lateness_seconds"


@dataclass
class Fleet:
    """One size's figures (None where nothing was measured)."""

    models: int
    interval_s: int
    window_s: float
    probed_after_s: float  # first create → every model has a probe in status
    cycles_per_s: float
    cpu_core_pct: float
    cpu_ms_per_cycle: float | None
    late_pct_window: float | None
    late_pct_from_create: float | None
    excess_samples: int
    excess_p50_ms: float | None
    excess_p95_ms: float | None
    excess_max_ms: float | None
    stalled_samples: float


def probed(obj: dict[str, Any]) -> bool:
    return bool(((obj.get("status") or {}).get("probe") or {}).get("lastProbeTime"))


def excess_ms(obj: dict[str, Any]) -> tuple[str, float] | None:
    """(the cycle's lastProbeTime, client TTFT - server TTFT) of the cycle this body's status holds."""
    probe = (obj.get("status") or {}).get("probe") or {}
    client, server = (probe.get("client") or {}).get("ttftMs"), (probe.get("server") or {}).get("ttftMs")
    if client is None or server is None or not probe.get("lastProbeTime"):
        return None
    return probe["lastProbeTime"], float(client) - float(server)


async def until_probed(client: KubeClient, n: int, limit_s: float) -> None:
    """Every one of the n ServedModels has a probe in status (a list, then its watch)."""
    seen: set[str] = set()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        items, rv = await client.list_at(GROUP, "servedmodels", NAMESPACE)
        seen |= {o["metadata"]["name"] for o in items if probed(o)}
        if len(seen) >= n:
            return
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                async for type_, obj in client.watch(GROUP, "servedmodels", NAMESPACE, resource_version=rv):
                    if type_ in ("ADDED", "MODIFIED") and probed(obj):
                        seen.add(obj["metadata"]["name"])
                        if len(seen) >= n:
                            return
        except (GoneError, TimeoutError):
            continue
    raise TimeoutError(f"{len(seen)} of {n} ServedModels probed within {limit_s:g} s")


async def collect_excess(client: KubeClient, until: float, out: dict[tuple[str, str], float]) -> None:
    """Each written cycle's TTFT excess, keyed (model, lastProbeTime), from a watch until `until`."""
    _, rv = await client.list_at(GROUP, "servedmodels", NAMESPACE)
    while time.monotonic() < until:
        try:
            async with asyncio.timeout(max(0.1, until - time.monotonic())):
                async for type_, obj in client.watch(GROUP, "servedmodels", NAMESPACE, resource_version=rv):
                    rv = obj["metadata"].get("resourceVersion", rv)
                    found = excess_ms(obj) if type_ == "MODIFIED" else None
                    if found is not None:
                        out[(obj["metadata"]["name"], found[0])] = found[1]
        except TimeoutError:
            return
        except GoneError:
            _, rv = await client.list_at(GROUP, "servedmodels", NAMESPACE)


def late_pct(before: dict[Any, float], after: dict[Any, float]) -> float | None:
    started = total(after, f"{LATENESS}_count") - total(before, f"{LATENESS}_count")
    on_time = total(after, f"{LATENESS}_bucket", le="1.0") - total(before, f"{LATENESS}_bucket", le="1.0")
    return 100.0 * (started - on_time) / started if started > 0 else None


async def measure(
    cp: controlplane.ControlPlane, op: OperatorProcess, n: int, interval: int, settle: float, window: float
) -> Fleet:
    proc = Proc(op.pid, sample=False)
    async with KubeClient(load_identity(str(cp.kubeconfig)), max_inflight=IN_FLIGHT) as client:
        start_metrics, t0 = scrape(op.metrics_port), time.monotonic()
        bodies = [servedmodel(i, probe_interval=interval, probe=True) for i in range(n)]
        await in_flight(client.create, bodies)
        await until_probed(client, n, limit_s=max(600.0, n * 1.5))
        probed_after = time.monotonic() - t0
        await asyncio.sleep(settle)
        excess: dict[tuple[str, str], float] = {}
        before, cpu0, w0 = scrape(op.metrics_port), proc.cpu_s(), time.monotonic()
        await collect_excess(client, w0 + window, excess)
        after, cpu1, took = scrape(op.metrics_port), proc.cpu_s(), time.monotonic() - w0
    cycles = total(after, "servedmodel_probe_total") - total(before, "servedmodel_probe_total")
    values = sorted(excess.values())
    return Fleet(
        models=n,
        interval_s=interval,
        window_s=round(took, 1),
        probed_after_s=round(probed_after, 1),
        cycles_per_s=cycles / took,
        cpu_core_pct=100.0 * (cpu1 - cpu0) / took,
        cpu_ms_per_cycle=1000.0 * (cpu1 - cpu0) / cycles if cycles else None,
        late_pct_window=late_pct(before, after),
        late_pct_from_create=late_pct(start_metrics, after),
        excess_samples=len(values),
        excess_p50_ms=pct(values, 50) if values else None,
        excess_p95_ms=pct(values, 95) if values else None,
        excess_max_ms=values[-1] if values else None,
        stalled_samples=total(after, "servedmodel_probe_stalled_samples_total")
        - total(before, "servedmodel_probe_stalled_samples_total"),
    )


def override(n: int, sims: list[SimulatorProcess]) -> str:
    """SERVEDMODEL_ENDPOINT_OVERRIDE: every model to the one simulator, or model i to simulator i mod k."""
    if len(sims) == 1:
        return sims[0].base_url
    return ",".join(f"{NAMESPACE}/m{i:04d}={sims[i % len(sims)].base_url}" for i in range(n))


def run_size(n: int, interval: int, settle: float, window: float, simulators: int = 1) -> Fleet:
    with controlplane.running() as cp, contextlib.ExitStack() as stack:
        sims = [
            stack.enter_context(SimulatorProcess([MODEL, "--max-model-len", "4096"]))
            for _ in range(min(simulators, n))
        ]
        prepare(cp, NAMESPACE)
        with OperatorProcess(cp, NAMESPACE, endpoint_override=override(n, sims), quiet=True) as op:
            return asyncio.run(measure(cp, op, n, interval, settle, window))


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(fleets: list[Fleet]) -> str:
    head = [f"N = {f.models:,} every {f.interval_s} s" for f in fleets]
    rows: list[tuple[str, list[str]]] = [
        ("first create → all probed, s", [fmt(f.probed_after_s) for f in fleets]),
        ("window, s", [fmt(f.window_s) for f in fleets]),
        ("probe cycles / s", [fmt(f.cycles_per_s, ".2f") for f in fleets]),
        ("operator CPU, % of a core (goal ≤ 15 at 1,000)", [fmt(f.cpu_core_pct) for f in fleets]),
        ("operator CPU per probe cycle, ms", [fmt(f.cpu_ms_per_cycle, ".2f") for f in fleets]),
        ("client - server TTFT p50, ms", [fmt(f.excess_p50_ms, ".2f") for f in fleets]),
        ("client - server TTFT p95, ms (goal ≤ 5)", [fmt(f.excess_p95_ms, ".2f") for f in fleets]),
        ("client - server TTFT max, ms", [fmt(f.excess_max_ms, ".2f") for f in fleets]),
        ("cycles with both TTFTs in the window", [str(f.excess_samples) for f in fleets]),
        ("starts > 1 s late in the window, % (goal ≤ 1)", [fmt(f.late_pct_window, ".2f") for f in fleets]),
        ("starts > 1 s late from the first create, %", [fmt(f.late_pct_from_create, ".2f") for f in fleets]),
        ("stalled samples (not published)", [fmt(f.stalled_samples, ".0f") for f in fleets]),
    ]
    lines = [f"| | {' | '.join(head)} |", f"|---|{'---|' * len(fleets)}"]
    lines += [f"| {k} | {' | '.join(v)} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,1000", help="comma-separated N (default 1,1000)")
    parser.add_argument("--interval", type=int, default=60, help="spec.probe.interval, s (default 60)")
    parser.add_argument("--single-interval", type=int, default=5, help="interval of a lone model, s")
    parser.add_argument("--settle", type=float, default=60.0, help="after all are probed, s")
    parser.add_argument("--window", type=float, default=120.0, help="measured window, s")
    parser.add_argument(
        "--simulators",
        type=int,
        default=1,
        help="simulator processes the models are spread over (default 1: one engine answers every model's "
        "probes, its own event loop the queue for all of them)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    if args.window < max(args.interval, args.single_interval):
        parser.error("--window must hold a whole --interval: every model is probed once in it")
    fleets = []
    for n in (int(s) for s in args.sizes.split(",")):
        interval = args.single_interval if n == 1 else args.interval
        fleets.append(run_size(n, interval, args.settle, args.window, args.simulators))
        print(f"N = {n}: {json.dumps(asdict(fleets[-1]))}", flush=True)
    print()
    print(table(fleets))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(f) for f in fleets], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

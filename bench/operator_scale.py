"""The control loop at scale: N ServedModels applied at once on the local control plane.

Method
- One control plane (hack/controlplane.py: real kube-apiserver, controller-manager, scheduler; kwok with a
  fake node that admits 5,000 pods and a /16 Service range), with more fake nodes past 4,500 ServedModels
  (`extra_nodes`) and an 8 GiB etcd quota. The ServedModels use the simulator engine
  with `resources.gpus: 0`, so GPUs do not limit scheduling and kwok makes every pod Ready.
- One simulator on 127.0.0.1; the operator runs as a subprocess (`servedmodel run -n bench`) with
  SERVEDMODEL_ENDPOINT_OVERRIDE pointing at it, so every probe goes to that one simulator.
- `--namespaces K` spreads the ServedModels over K namespaces (bench-000 …, model i in i mod K; the
  operator watches `-n 'bench-*'`). Why: the controller-manager's ReplicaSet, Deployment and
  EndpointSlice controllers find the owners and Services of a changed Pod by matching every ReplicaSet,
  Deployment and Service of its namespace (client-go's GetPodReplicaSets, GetPodServiceMemberships), so
  N models in one namespace cost it O(N) per Pod change and O(N²) in all: at 10,000 in one namespace the
  controller-manager, not the operator, is what the fleet waits for.
- The N ServedModels are created in parallel (16 connections) as fast as the API server takes them; a
  `kubectl get sm -w` stream stamps, per object, when its phase first became Ready and when
  status.probe.lastProbeTime first appeared.
- Idle: after all are Ready (and probed, unless --no-probe), `--idle` seconds of nothing; the operator's
  /metrics before and after give its own API requests, the reconciler's status writes and the probe's.
- Delete: all N deleted at once (one deletecollection request per namespace); gone = the ServedModels
  and their Deployments no longer listed.
- The operator's RSS (VmRSS; the max is the kernel's high-water mark, VmHWM) and CPU seconds (utime + stime).

    .venv/bin/python bench/operator_scale.py -n 100
    .venv/bin/python bench/operator_scale.py -n 1000 --idle 60
    .venv/bin/python bench/operator_scale.py -n 3000 --idle 60 --timeout 900
    .venv/bin/python bench/operator_scale.py -n 10000 --idle 60 --timeout 3600 --no-delete
    .venv/bin/python bench/operator_scale.py -n 10000 --namespaces 100 --idle 60 --probe-interval 600 \
        --timeout 3000 --no-delete

Never a test: it prints a table (markdown with --markdown) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench_support import (
    Metrics,
    OperatorProcess,
    Proc,
    controlplane,
    pct,
    prepare,
    print_rows,
    scrape,
    total,
)
from servedmodel.api.probe import READINESS_GATE_CONDITION
from servedmodel.sim.process import SimulatorProcess

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
NAMESPACE = "bench"


def namespace_of(i: int, namespaces: int) -> str:
    """Model i's namespace: NAMESPACE alone, or bench-000 … over `namespaces` (i mod namespaces)."""
    return NAMESPACE if namespaces <= 1 else f"{NAMESPACE}-{i % namespaces:03d}"


def scope(namespaces: int) -> list[str]:
    """kubectl's namespace flags for the bench's objects (names are unique across its namespaces)."""
    return ["-n", NAMESPACE] if namespaces <= 1 else ["-A"]


def servedmodel(i: int, probe_interval: int, probe: bool, namespace: str = NAMESPACE) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": f"m{i:04d}", "namespace": namespace},
        "spec": {
            "model": MODEL,
            "engine": {"kind": "simulator"},
            "resources": {"gpus": 0},
            # the gate off: Ready is the Deployments' (docs/benchmarks.md's figures), not the first probe's
            "probe": {"enabled": probe, "interval": probe_interval, "readinessGate": False},
        },
    }


# etcd's quota: the control plane's 1 GiB is about what 10,000 ServedModels' objects and history take.
ETCD_QUOTA = 8 * 1024**3


def extra_nodes(n: int) -> list[dict[str, Any]]:
    """The fake nodes to add beside the control plane's kwok-gpu-0 so that n one-replica pods fit: it
    admits NODE_PODS pods, and the ones added as many each (a tenth spare). The /16 Service range
    holds 65,534 ClusterIPs: no change needed there."""
    count = math.ceil(n * 1.1 / controlplane.NODE_PODS)
    return [controlplane.gpu_node(f"kwok-gpu-{k}") for k in range(1, count)]


def apiserver_requests(cp: controlplane.ControlPlane) -> dict[str, tuple[float, float]]:
    """(count, seconds) per "VERB resource[/subresource]" from the API server's own
    apiserver_request_duration_seconds (every client's requests, watches excluded)."""
    out: dict[str, tuple[float, float]] = {}
    for fam in text_string_to_metric_families(cp.get_text("/metrics")):
        if fam.name != "apiserver_request_duration_seconds":
            continue
        for sample in fam.samples:
            verb = sample.labels.get("verb", "")
            if verb in ("WATCH", "CONNECT") or sample.name.endswith("_bucket"):
                continue
            key = f"{verb} {sample.labels.get('resource', '')}"
            if sample.labels.get("subresource"):
                key += f"/{sample.labels['subresource']}"
            n, secs = out.get(key, (0.0, 0.0))
            if sample.name.endswith("_count"):
                n += sample.value
            elif sample.name.endswith("_sum"):
                secs += sample.value
            out[key] = (n, secs)
    return out


class Watch:
    """`kubectl get sm -w` as one line per event (name, phase, lastProbeTime), stamping first sightings.

    A watch that ends (the server closes it, a busy machine drops it) is started again after a plain
    listing, so a transition missed in between is still seen (stamped at that listing: an upper bound)."""

    COLUMNS = "NAME:.metadata.name,PHASE:.status.phase,PROBE:.status.probe.lastProbeTime"

    def __init__(self, cp: controlplane.ControlPlane, namespaces: int = 1) -> None:
        kubectl = [str(cp.bin_dir / "kubectl"), f"--kubeconfig={cp.kubeconfig}"]
        self.cmd = [*kubectl, "get", "sm", *scope(namespaces)]
        self.ready: dict[str, float] = {}
        self.probed: dict[str, float] = {}
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _see(self, line: str, now: float) -> None:
        parts = line.split()
        if len(parts) < 3:
            return
        name, phase, probe = parts[0], parts[1], parts[2]
        with self.lock:
            if phase == "Ready":
                self.ready.setdefault(name, now)
            if probe != "<none>":
                self.probed.setdefault(name, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            listing = subprocess.run(
                [*self.cmd, "--no-headers", "-o", f"custom-columns={self.COLUMNS}"],
                capture_output=True,
                text=True,
                check=False,
                timeout=120,
            )
            now = time.monotonic()
            for line in listing.stdout.splitlines():
                self._see(line, now)
            if self._stop.is_set():
                return
            self.proc = subprocess.Popen(
                [*self.cmd, "-w", "--watch-only", "--no-headers", "-o", f"custom-columns={self.COLUMNS}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self._see(line, time.monotonic())
            self.proc.wait()
            time.sleep(0.5)

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return len(self.ready), len(self.probed)

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)


def listing(cp: controlplane.ControlPlane, what: str, namespaces: int = 1) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cp.get_json(what, *scope(namespaces), timeout=120)["items"]
    return items


def _stamp(value: Any) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def _condition_time(obj: dict[str, Any], type_: str) -> float | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return _stamp(c.get("lastTransitionTime"))
    return None


# Where create → Ready goes, stage by stage, from the objects' own (server-side, 1 s resolution) stamps:
# who does each stage is in its name.
STAGES = (
    ("ServedModel created → Deployment created (operator: first apply)", "sm", "deploy"),
    ("Deployment → Pod created (controller-manager)", "deploy", "pod"),
    ("Pod created → ContainersReady (scheduler, kwok)", "pod", "containers"),
    ("ContainersReady → serving gate True (operator: first probe of the pod)", "containers", "gate"),
    ("serving gate → Pod Ready (kwok)", "gate", "pod_ready"),
    (
        "Pod Ready → ServedModel Ready (Deployment status, then the phase)",
        "pod_ready",
        "ready",
    ),
)


def stages(cp: controlplane.ControlPlane, namespaces: int = 1) -> dict[str, list[float]]:
    """Per ServedModel (one replica each), the stamps of STAGES; durations per stage, sorted."""
    stamps: dict[str, dict[str, float | None]] = {}
    for sm in listing(cp, "servedmodels", namespaces):
        stamps[sm["metadata"]["name"]] = {
            "sm": _stamp(sm["metadata"]["creationTimestamp"]),
            "ready": _condition_time(sm, "Ready"),
        }
    for d in listing(cp, "deployments", namespaces):
        stamps.setdefault(d["metadata"]["name"], {})["deploy"] = _stamp(d["metadata"]["creationTimestamp"])
    for pod in listing(cp, "pods", namespaces):
        owner = (pod["metadata"].get("labels") or {}).get("app.kubernetes.io/instance")
        if owner not in stamps:
            continue
        s = stamps[owner]
        s["pod"] = _stamp(pod["metadata"]["creationTimestamp"])
        s["containers"] = _condition_time(pod, "ContainersReady")
        s["gate"] = _condition_time(pod, READINESS_GATE_CONDITION)
        s["pod_ready"] = _condition_time(pod, "Ready")
    out: dict[str, list[float]] = {}
    for label, start, end in STAGES:
        values = []
        for s in stamps.values():
            a, b = s.get(start), s.get(end)
            if a is not None and b is not None:
                values.append(b - a)
        out[label] = sorted(values)
    return out


def count(cp: controlplane.ControlPlane, what: str, namespaces: int = 1) -> int:
    out = cp.kubectl("get", what, *scope(namespaces), "--no-headers", "-o", "name", timeout=120).stdout
    return len(out.split())


def run(args: argparse.Namespace) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """The table's rows, and the headline figures (bench/scoreboard.py reads them from --json)."""
    n = args.n
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(controlplane.running(etcd_flags=[f"--quota-backend-bytes={ETCD_QUOTA}"]))
        sim = stack.enter_context(SimulatorProcess([MODEL, "--max-model-len", "4096"]))
        spread = args.namespaces
        namespaces = [namespace_of(k, spread) for k in range(min(spread, n))]
        prepare(cp, namespaces[0])
        for ns in namespaces[1:]:
            cp.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        for node in extra_nodes(n):
            cp.request("POST", "/api/v1/nodes", node)
        operator = stack.enter_context(
            OperatorProcess(
                cp,
                NAMESPACE if spread <= 1 else f"{NAMESPACE}-*",
                endpoint_override=sim.base_url,
                log=args.log,
                memory_profile=args.memory_profile,
            )
        )
        proc = Proc(operator.pid)
        stack.callback(proc.stop)
        watch = Watch(cp, spread)
        stack.callback(watch.stop)
        cpu_start, rss_start = proc.cpu_s(), proc.rss_mb()
        # Where the machine's CPU goes while busy: every component's, the simulator's, the operator's.
        others = {name: Proc(pid, sample=False) for name, pid in cp.pids().items()}
        others["simulator"] = Proc(sim.pid, sample=False)
        others_start = {name: p.cpu_s() for name, p in others.items()}
        api_start = apiserver_requests(cp)
        base = scrape(operator.metrics_port)

        created: dict[str, float] = {}

        def create(i: int) -> None:
            ns = namespace_of(i, spread)
            obj = servedmodel(i, args.probe_interval, not args.no_probe, ns)
            cp.request("POST", f"/apis/inference.servedmodel.io/v1alpha1/namespaces/{ns}/servedmodels", obj)
            created[obj["metadata"]["name"]] = time.monotonic()

        spy = None
        if args.profile:
            spy = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "-f", "raw", "-r", "50", "-d",
                 str(int(args.profile_s)), "-o", str(args.profile), "--pid", str(operator.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        t_apply = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(create, range(n)))
        t_created = time.monotonic()
        want_probed = 0 if args.no_probe else n
        deadline = t_apply + args.timeout
        while time.monotonic() < deadline:
            ready, probed = watch.counts()
            if ready >= n and probed >= want_probed:
                break
            time.sleep(0.5)
        t_settled = time.monotonic()
        if spy is not None:
            spy.wait(timeout=args.profile_s + 60)
        busy = scrape(operator.metrics_port)
        cpu_busy = proc.cpu_s()
        others_busy = {name: p.cpu_s() - others_start[name] for name, p in others.items()}
        api_busy = {
            k: (n - api_start.get(k, (0.0, 0.0))[0], secs - api_start.get(k, (0.0, 0.0))[1])
            for k, (n, secs) in apiserver_requests(cp).items()
        }
        stage_s = stages(cp, spread)

        time.sleep(args.idle)
        idle = scrape(operator.metrics_port)
        rss_idle = proc.rss_mb()
        if args.memory_profile is not None:
            print(operator.snapshot_memory(), file=sys.stderr)
        cpu_idle = proc.cpu_s()

        t_delete = time.monotonic()
        # deletecollection (kubectl delete --all sends one DELETE per object, in turn). The server
        # stops deleting when the request ends (its own 60 s timeout, or a client that hangs up),
        # so the request is sent again until nothing is left.
        collections = [
            f"/apis/inference.servedmodel.io/v1alpha1/namespaces/{ns}/servedmodels" for ns in namespaces
        ]
        sm_gone = deploy_gone = None
        # --no-delete: the control plane is stopped with everything in it
        while not args.no_delete and time.monotonic() < t_delete + args.timeout:
            if sm_gone is None:
                for collection in collections:
                    cp.kubectl("delete", "--raw", collection, check=False, timeout=120)
            if sm_gone is None and count(cp, "servedmodels", spread) == 0:
                sm_gone = time.monotonic() - t_delete
            if sm_gone is not None and count(cp, "deployments", spread) == 0:
                deploy_gone = time.monotonic() - t_delete
                break
            time.sleep(1.0)
        cpu_end = proc.cpu_s()

    ready_s = sorted(watch.ready[k] - created[k] for k in watch.ready if k in created)
    probe_s = sorted(watch.probed[k] - watch.ready[k] for k in watch.probed if k in watch.ready)
    first_probe_s = sorted(watch.probed[k] - created[k] for k in watch.probed if k in created)
    busy_s = max(t_settled - t_apply, 1e-9)

    def delta(a: Metrics, b: Metrics, name: str, **labels: str) -> float:
        return total(b, name, **labels) - total(a, name, **labels)

    def mean(a: Metrics, b: Metrics, kind: str) -> float:
        seconds = delta(a, b, "servedmodel_reconcile_duration_seconds_sum", kind=kind)
        return seconds / max(1.0, delta(a, b, "servedmodel_reconcile_duration_seconds_count", kind=kind))

    req = "servedmodel_kube_api_requests"
    writes = "servedmodel_status_writes_total"
    probe_writes = "servedmodel_probe_status_writes_total"
    pod_probes = "servedmodel_probe_pod_total"

    def verb_row(verb: str) -> str:
        sent = delta(base, busy, "servedmodel_kube_api_requests_by_verb_total", verb=verb)
        wait = delta(base, busy, "servedmodel_kube_api_slot_wait_seconds_total", verb=verb)
        response = delta(base, busy, "servedmodel_kube_api_response_seconds_total", verb=verb)
        return f"{verb}: {sent:.0f}, {wait / max(sent, 1):.3f} / {response / max(sent, 1):.3f}"

    by_verb = "; ".join(verb_row(v) for v in ("GET", "POST", "PATCH", "PUT", "DELETE"))

    def fmt(values: list[float]) -> str:
        if not values:
            return "—"
        return f"{pct(values, 50):.1f} / {pct(values, 95):.1f} / {values[-1]:.1f}"

    figures = {
        "models": n,
        "ready": len(ready_s),
        "probed": len(first_probe_s),
        "all_ready_s": t_settled - t_apply,
        "rss_start_mb": rss_start,
        "rss_max_mb": proc.max_rss_mb,
        "rss_idle_mb": rss_idle,
        "idle_s": args.idle,
        "idle_reconciler_writes": delta(busy, idle, writes),
        "idle_probe_writes": delta(busy, idle, probe_writes),
        "operator_cpu_until_ready_s": cpu_busy - cpu_start,
    }
    return [
        ("ServedModels created / Ready / probed", f"{n} / {len(ready_s)} / {len(probe_s)}"),
        ("create all (16 parallel POSTs), s", f"{t_created - t_apply:.1f}"),
        ("create → Ready, s (p50 / p95 / max)", fmt(ready_s)),
        ("create → first probe in status, s (p50 / p95 / max)", fmt(first_probe_s)),
        # Negative: the probe starts once a replica is ready, which can be before the phase says Ready.
        ("phase Ready → first probe in status, s (p50 / p95 / max)", fmt(probe_s)),
        ("first create → all Ready (and probed), s", f"{t_settled - t_apply:.1f}"),
        *((f"stage: {label}, s (p50 / p95 / max)", fmt(values)) for label, values in stage_s.items()),
        (
            "operator API requests while busy: total / per s / per ServedModel",
            f"{delta(base, busy, req):.0f} / {delta(base, busy, req) / busy_s:.1f} / "
            f"{delta(base, busy, req) / n:.1f}",
        ),
        (
            f"idle {args.idle:.0f} s: API requests / reconciler status writes / probe status writes",
            f"{delta(busy, idle, req):.0f} / {delta(busy, idle, writes):.0f} / "
            f"{delta(busy, idle, probe_writes):.0f}",
        ),
        (
            f"idle {args.idle:.0f} s: probe writes per probe cycle (interval {args.probe_interval} s)",
            "—"
            if args.no_probe
            else f"{delta(busy, idle, probe_writes) / max(1.0, n * args.idle / args.probe_interval):.2f}",
        ),
        (
            # The row above divides by the cycles the interval asks for; right after a ramp the probes
            # that actually ran in the idle window can be more (or fewer) than that.
            f"idle {args.idle:.0f} s: pod probes run / probe writes per pod probe run",
            "—"
            if args.no_probe
            else f"{delta(busy, idle, pod_probes):.0f} / "
            f"{delta(busy, idle, probe_writes) / max(1.0, delta(busy, idle, pod_probes)):.2f}",
        ),
        (
            "reconcile passes while busy: count / mean s (apply) / mean s (from the cache)",
            f"{delta(base, busy, 'servedmodel_controller_reconciles_total'):.0f} / "
            f"{mean(base, busy, 'apply'):.3f} / {mean(base, busy, 'refresh'):.3f}",
        ),
        (
            "delete all → ServedModels gone / Deployments gone, s",
            f"{sm_gone or float('nan'):.1f} / {deploy_gone or float('nan'):.1f}",
        ),
        (
            "operator RSS, MiB (started / max by VmHWM / idle)",
            f"{rss_start:.0f} / {proc.max_rss_mb:.0f} / {rss_idle:.0f}",
        ),
        (
            "operator CPU s (until all Ready / idle / delete)",
            f"{cpu_busy - cpu_start:.1f} / {cpu_idle - cpu_busy:.1f} / {cpu_end - cpu_idle:.1f}",
        ),
        (
            "CPU s until all Ready: operator / " + " / ".join(others_busy),
            f"{cpu_busy - cpu_start:.1f} / " + " / ".join(f"{v:.1f}" for v in others_busy.values()),
        ),
        ("operator's requests until all Ready by method: count, mean s for a slot / to response", by_verb),
        (
            "API server requests until all Ready, all clients (the 10 with the most seconds: count, mean s)",
            "; ".join(
                f"{k}: {n:.0f}, {secs / max(n, 1):.3f} s"
                for k, (n, secs) in sorted(api_busy.items(), key=lambda kv: -kv[1][1])[:10]
            ),
        ),
        ("load average at the end (1 / 5 / 15 min)", " / ".join(f"{x:.1f}" for x in os.getloadavg())),
    ], figures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=100, help="ServedModels (default 100)")
    parser.add_argument("--idle", type=float, default=60.0, help="idle seconds after all Ready (default 60)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up waiting after this many s")
    parser.add_argument("--probe-interval", type=int, default=60, help="spec.probe.interval (default 60)")
    parser.add_argument("--no-probe", action="store_true", help="spec.probe.enabled: false")
    parser.add_argument(
        "--namespaces", type=int, default=1, help="spread the ServedModels over K namespaces (default 1)"
    )
    parser.add_argument("--no-delete", action="store_true", help="skip the delete phase (its row says nan)")
    parser.add_argument("--log", type=Path, default=None, help="write the operator's log here")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw stacks of the operator here")
    parser.add_argument(
        "--memory-profile",
        type=Path,
        default=None,
        help="run the operator under tracemalloc and print where its memory is after the idle (to stderr)",
    )
    parser.add_argument(
        "--profile-s", type=float, default=60.0, help="seconds to profile from the first create"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the headline figures here too")
    args = parser.parse_args()
    rows, figures = run(args)
    print_rows(rows, markdown=args.markdown, title=f"N = {args.n}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

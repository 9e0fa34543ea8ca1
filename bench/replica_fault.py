"""Replica truth on the local control plane: a replica's fault → out of the Service's EndpointSlice → back.

Method
- One control plane (hack/controlplane.py: real kube-apiserver, controller-manager with the EndpointSlice
  controller, scheduler, and kwok with hack/kwok's stages, which honour readiness gates as a kubelet does).
- N simulators on 127.0.0.1, one per engine pod: the operator runs as a subprocess with
  SERVEDMODEL_ENDPOINT_OVERRIDE=@file, the file mapping each (fake) pod to its simulator once the pods exist.
- One ServedModel with N replicas and spec.probe.readinessGate, probe interval --interval (jittered ±10 %),
  firstByteTimeout 2 s. Each fault (stall: the engine schedules nothing; error: every request 500; die:
  /health 503) is injected --repeat times on the last replica, at a random moment of the probe cycle:
  the script polls the EndpointSlice every 50 ms and records fault → that endpoint ready=false, then
  reset → ready=true. Both include the wait for the next probe cycle, which is most of it.
- Probe cost per replica: with every replica serving, the operator's CPU time (utime+stime from /proc)
  and the simulators' HTTP requests over --idle seconds, divided by the pod probes the operator counted
  (servedmodel_probe_pod_total).

    .venv/bin/python bench/replica_fault.py                      # 3 replicas, interval 5 s, 3 repeats
    .venv/bin/python bench/replica_fault.py --replicas 6 --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench_support import OperatorProcess, Proc, controlplane, prepare, scrape, total
from rollout_rig import write_override
from servedmodel.sim.process import SimulatorProcess

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
NAMESPACE = "bench"
NAME = "qwen"
FAULTS = {
    "stall": {"engine_stalled": True},
    "error": {"error_rate": 1.0, "error_status": 500},
    "die": {"dead": True},
}


def wait(what: str, check: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {got!r})")
        time.sleep(interval)


def pod_probes_total(operator: OperatorProcess) -> float:
    return total(scrape(operator.metrics_port), "servedmodel_probe_pod_total")


def sim_requests(sims: list[SimulatorProcess]) -> float:
    total = 0.0
    for sim in sims:
        text = httpx.get(f"{sim.base_url}/metrics", timeout=5).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "http_requests_total" and s.labels.get("handler") != "/metrics":
                    total += s.value
    return total + 0.0


def fmt(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3, help="engine replicas (default 3, at most 8 GPUs)")
    parser.add_argument("--interval", type=int, default=5, help="spec.probe.interval, s (default 5)")
    parser.add_argument("--repeat", type=int, default=3, help="injections per fault (default 3)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds for the probe cost (default 30)")
    args = parser.parse_args()
    rng = random.Random(1)
    sim_args = [MODEL, "--served-model-name", "qwen", "--max-model-len", "4096", "--sim-step-base-ms", "2"]

    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(controlplane.running())
        sims = [
            stack.enter_context(SimulatorProcess(sim_args, ready_timeout=60)) for _ in range(args.replicas)
        ]
        prepare(cp, NAMESPACE)
        override = Path(tempfile.mkdtemp(prefix="replica-fault-")) / "endpoints"
        override.write_text("")
        operator = stack.enter_context(
            OperatorProcess(cp, NAMESPACE, endpoint_override=f"@{override}", quiet=True)
        )
        proc = Proc(operator.pid, sample=False)
        probe = {
            "interval": args.interval,
            "readinessGate": True,
            "failureThreshold": 1,  # out at the first failed cycle, as docs/benchmarks.md measured
            "firstByteTimeout": 2,
            "timeout": 10,
            "checkLimits": False,
        }
        sm = {
            "apiVersion": "inference.servedmodel.io/v1alpha1",
            "kind": "ServedModel",
            "metadata": {"name": NAME},
            "spec": {
                "model": MODEL,
                "servedModelName": "qwen",
                "replicas": args.replicas,
                "resources": {"gpus": 1},
                "engine": {"maxModelLen": 4096},
                "probe": probe,
            },
        }
        cp.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(sm))

        def running_pods() -> list[str] | None:
            pods = cp.get_json("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={NAME}")
            names = sorted(
                p["metadata"]["name"]
                for p in pods["items"]
                if (p.get("status") or {}).get("phase") == "Running"
            )
            return names if len(names) == args.replicas else None

        def endpoints() -> dict[str, bool]:
            return cp.endpoint_ready(NAMESPACE, f"{NAME}-engine")

        names = wait("engine pods running", running_pods, 120)
        mapped = time.monotonic()
        write_override(
            override, [f"{NAMESPACE}/{NAME}/{n}={s.base_url}" for n, s in zip(names, sims, strict=True)]
        )
        wait(
            "every endpoint ready",
            lambda: endpoints() == dict.fromkeys(names, True),
            120,
        )
        first_ready = time.monotonic() - mapped

        # Probe cost with everything serving.
        probes0, cpu0, req0 = pod_probes_total(operator), proc.cpu_s(), sim_requests(sims)
        time.sleep(args.idle)
        probes1, cpu1, req1 = pod_probes_total(operator), proc.cpu_s(), sim_requests(sims)
        pod_probes = probes1 - probes0

        victim, sim = names[-1], sims[-1]
        results: dict[str, tuple[list[float], list[float]]] = {}
        for fault, settings in FAULTS.items():
            outs, backs = [], []
            for _ in range(args.repeat):
                time.sleep(rng.uniform(0, args.interval))  # a random moment of the probe cycle
                t0 = time.monotonic()
                httpx.post(f"{sim.base_url}/admin/faults", json=settings, timeout=5).raise_for_status()
                wait(
                    f"{victim} out",
                    lambda: endpoints().get(victim) is False,
                    120,
                )
                outs.append(time.monotonic() - t0)
                others = endpoints()
                assert all(others[n] for n in names[:-1]), others  # the others keep serving
                time.sleep(rng.uniform(0, args.interval))
                t1 = time.monotonic()
                httpx.post(f"{sim.base_url}/admin/faults", json={"reset": True}, timeout=5).raise_for_status()
                wait(
                    f"{victim} back",
                    lambda: endpoints().get(victim) is True,
                    120,
                )
                backs.append(time.monotonic() - t1)
            results[fault] = (outs, backs)

    print(
        f"replica fault → EndpointSlice, {args.replicas} replicas, probe interval {args.interval} s, "
        f"firstByteTimeout 2 s, {args.repeat} injections each (min / median / max, s)"
    )
    print()
    print("| fault | fault → endpoint ready=false | recovery → ready=true |")
    print("|---|---|---|")
    for fault, (outs, backs) in results.items():
        print(f"| {fault} | {fmt(outs)} | {fmt(backs)} |")
    print()
    print(f"pods mapped → every endpoint ready (first real generation through the gate): {first_ready:.1f} s")
    print()
    print("| probe cost (all replicas serving) | value |")
    print("|---|---|")
    print(f"| pod probes in {args.idle:.0f} s | {pod_probes:.0f} |")
    if pod_probes:
        print(f"| operator CPU per pod probe | {(cpu1 - cpu0) / pod_probes * 1000:.1f} ms |")
        print(f"| engine HTTP requests per pod probe (without /metrics) | {(req1 - req0) / pod_probes:.1f} |")
        per_minute = (cpu1 - cpu0) / pod_probes * 60 / args.interval * 1000
        print(f"| operator CPU per replica per minute at this interval | {per_minute:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

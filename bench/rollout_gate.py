"""The rollout gate on the local control plane: what a new engine revision costs and what it spares users.

Method
- One control plane (hack/controlplane.py; kwok runs the pods and honours readiness gates as a kubelet
  does), the operator as a subprocess, its probes sent pod by pod to simulators on 127.0.0.1 through the
  endpoint-override file that hack/rollout_rig.py's mapper keeps current (first revision → two good
  engines; the new revision → the scenario's engine).
- Per scenario, a fresh ServedModel of two replicas (probe interval --interval, progressDeadlineSeconds
  --deadline); once its first revision is Proven (gate on) or its Deployment complete (gate off), a
  client loop starts (one chat every 0.1 s to an engine behind a ready endpoint of the Service, as the
  Service would send it), then a spec change makes a new revision.
- Scenarios: good (the new pods serve like the old), template (they render Llama 3's chat template for
  a Qwen model), flag (an engine started with --max-model-len 16: every probe prompt is too long), slow
  (the engine steps 10 times slower). Good and template also run with the gate off, for comparison.
- Measured: seconds from the spec change to the rollout's end (Proven, RolledBack, or with the gate off
  the Deployment complete), the fewest ready endpoints seen (EndpointSlice, every 0.3 s), and the
  client's requests, HTTP errors and requests answered by the new revision's broken engine over the
  same window for every scenario (2 x deadline + 10 s from the change, or to the end if later).

    .venv/bin/python bench/rollout_gate.py [--interval 5] [--deadline 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench_support import OperatorProcess, controlplane, prepare
from rollout_rig import RevisionMapper
from servedmodel.sim.process import SimulatorProcess

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
NAMESPACE = "bench"
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 4}


@dataclass
class Row:
    scenario: str
    gate: bool
    outcome: str
    seconds: float
    min_ready: int
    requests: int
    errors: int
    broken: int  # answered by the new revision's broken engine


class Client(threading.Thread):
    """Chats to the engines behind the Service's ready endpoints, one every 0.1 s, round robin."""

    def __init__(self, mapper: RevisionMapper, broken: set[str]) -> None:
        super().__init__(name="client", daemon=True)
        self.mapper, self.broken = mapper, broken
        self.requests = self.errors = self.answered_broken = 0
        self.halt = threading.Event()

    def run(self) -> None:
        turn = 0
        with httpx.Client(timeout=10, trust_env=False) as http:
            while not self.halt.wait(0.1):
                urls = self.mapper.ready_urls()
                if not urls:
                    self.requests += 1
                    self.errors += 1  # nowhere to send it: the Service has no ready endpoint
                    continue
                url, turn = urls[turn % len(urls)], turn + 1
                self.requests += 1
                try:
                    r = http.post(f"{url}/v1/chat/completions", json=CHAT)
                    if r.status_code != 200:
                        self.errors += 1
                except httpx.HTTPError:
                    self.errors += 1
                if url in self.broken:
                    self.answered_broken += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(15)


def wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)
    return got


def get(cp: controlplane.ControlPlane, *what: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cp.kubectl("get", "-n", NAMESPACE, *what, "-o", "json").stdout)
    return out


def rollout(cp: controlplane.ControlPlane, name: str) -> dict[str, Any]:
    return dict((get(cp, "sm", name).get("status") or {}).get("rollout") or {})


def deployment_complete(cp: controlplane.ControlPlane, name: str, replicas: int) -> bool:
    d = get(cp, "deployment", name)
    st = d.get("status") or {}
    return bool(
        st.get("observedGeneration") == d["metadata"]["generation"]
        and st.get("updatedReplicas") == replicas
        and st.get("availableReplicas") == replicas
        and st.get("replicas") == replicas
    )


def scenario(
    cp: controlplane.ControlPlane,
    override: Path,
    name: str,
    good: list[str],
    new: list[str],
    *,
    gate: bool,
    interval: int,
    deadline: int,
    window: float,
) -> Row:
    """One ServedModel through one rollout; the row of figures. `new`: the new revision's engines."""
    mapper = RevisionMapper(cp, NAMESPACE, name, override, good, new)
    mapper.start()
    spec: dict[str, Any] = {
        "model": MODEL,
        "servedModelName": "qwen",
        "replicas": 2,
        "resources": {"gpus": 1},
        "engine": {"maxModelLen": 4096},
        "probe": {"interval": interval, "checkLimits": False, "readinessGate": gate},
        "rollout": {"progressDeadlineSeconds": deadline},
    }

    def apply() -> None:
        sm = {"apiVersion": "inference.servedmodel.io/v1alpha1", "kind": "ServedModel"}
        sm |= {"metadata": {"name": name}, "spec": spec}
        cp.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(sm))

    broken = set(new) - set(good)
    client = Client(mapper, broken)
    try:
        apply()
        if gate:
            wait(f"{name}: first revision Proven", lambda: rollout(cp, name).get("state") == "Proven", 180)
        else:
            wait(f"{name}: first Deployment complete", lambda: deployment_complete(cp, name, 2), 180)
        first = rollout(cp, name).get("revision")
        mapper.sampling = True
        client.start()
        time.sleep(2.0)  # the client's view before the change
        spec["engine"] = {"maxModelLen": 4096, "env": [{"name": "REVISION", "value": "two"}]}
        changed = time.monotonic()
        apply()

        def done() -> str | None:
            if not gate:
                revisions = {
                    (p["metadata"].get("labels") or {}).get("inference.servedmodel.io/revision")
                    for p in get(cp, "pods", "-l", f"app.kubernetes.io/instance={name}")["items"]
                    if not p["metadata"].get("deletionTimestamp")
                }
                complete = deployment_complete(cp, name, 2) and len(revisions) == 1
                return "complete (no gate)" if complete and revisions != {mapper.first_revision} else None
            r = rollout(cp, name)
            if r.get("state") == "Proven" and r.get("revision") != first:
                return "Proven"
            if r.get("state") == "RolledBack" and r.get("passed") == r.get("total") == 2:
                return f"RolledBack ({r.get('blockedMessage', '').split(': ')[1]})"
            return None

        outcome = wait(f"{name}: the rollout's end", done, 3 * deadline + 120)
        seconds = time.monotonic() - changed
        # The client's figures over one window for every scenario: what a user sees in the same time.
        time.sleep(max(1.0, changed + window - time.monotonic()))
    finally:
        client.stop()
        mapper.stop()
        cp.kubectl("delete", "sm", name, "-n", NAMESPACE, "--wait=true", "--timeout=120s", check=False)
    if mapper.error is not None:
        raise mapper.error
    return Row(
        name.rsplit("-", 1)[0],
        gate,
        outcome,
        seconds,
        min(mapper.ready_counts),
        client.requests,
        client.errors,
        client.answered_broken,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interval", type=int, default=5, help="spec.probe.interval, s (default 5)")
    parser.add_argument("--deadline", type=int, default=20, help="progressDeadlineSeconds (default 20)")
    args = parser.parse_args()
    window = 2.0 * args.deadline + 10.0
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(controlplane.running())

        def sim(max_model_len: int = 4096) -> str:
            args = [MODEL, "--served-model-name", "qwen", "--max-model-len", str(max_model_len)]
            return stack.enter_context(SimulatorProcess(args, ready_timeout=60)).base_url

        good = [sim(), sim()]
        template, slow, flag = sim(), sim(), sim(max_model_len=16)
        httpx.post(f"{template}/admin/faults", json={"chat_template": "llama3"}, timeout=5).raise_for_status()
        step = httpx.get(f"{slow}/admin/config", timeout=5).json()["step_base_ms"]
        httpx.post(f"{slow}/admin/config", json={"step_base_ms": step * 10}, timeout=5).raise_for_status()
        prepare(cp, NAMESPACE)
        override = Path(tempfile.mkdtemp(prefix="rollout-gate-")) / "endpoints"
        override.write_text("")
        stack.enter_context(OperatorProcess(cp, NAMESPACE, endpoint_override=f"@{override}", quiet=True))
        plan = [
            ("good-gate", good, True),
            ("good-nogate", good, False),
            ("template-gate", [template], True),
            ("template-nogate", [template], False),
            ("flag-gate", [flag], True),
            ("slow-gate", [slow], True),
        ]
        rows = [
            scenario(
                cp,
                override,
                name,
                good,
                new,
                gate=g,
                interval=args.interval,
                deadline=args.deadline,
                window=window,
            )
            for name, new, g in plan
        ]
    head = "| scenario | gate | outcome | spec change → done, s | min ready endpoints | client requests "
    head += "| HTTP errors | answered by the broken revision |"
    print(
        f"\nrollout gate, 2 replicas, probe interval {args.interval} s, "
        f"progressDeadlineSeconds {args.deadline}"
    )
    print(
        f"(the client's columns: the {window:.0f} s from the spec change, or to the rollout's end if later)"
    )
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.scenario} | {'on' if r.gate else 'off'} | {r.outcome} | {r.seconds:.1f} | {r.min_ready} | "
            f"{r.requests} | {r.errors} | {r.broken} |"
        )
    on = next(r.seconds for r in rows if r.scenario == "good" and r.gate)
    off = next(r.seconds for r in rows if r.scenario == "good" and not r.gate)
    print(
        f"\ncost of proving a good revision: {on:.1f} s with the gate vs {off:.1f} s without "
        f"= {on / off:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

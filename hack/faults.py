"""Faults made to happen on a real control plane while the operator runs as a process: a watch gap that
ends in 410 with deletes inside it, an API server killed mid-burst, etcd paused, the leader SIGKILLed,
one name deleted and recreated a hundred times. Each scenario returns a `Row` of what it measured;
tests/cluster/test_faults.py asserts on the rows, bench/operator_faults.py prints them.

Convergence is read from both sides: the API server's lists (kubectl) and the operator's own /metrics
(`servedmodel_cache_objects` per kind, `servedmodel_probe_scheduled_models`). Converged means the cache
holds exactly what the API holds, every ServedModel's status has observed its generation, and each has
its Deployment, owned by its current uid.

`start(namespace, env)` starts one healthy operator and returns it (tests/cluster/conftest.py's and
bench/bench_support.py's processes both fit `Operator`).
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

import controlplane

API = "/apis/inference.servedmodel.io/v1alpha1"
# What the fault tests' API server runs with: watches served from etcd (no watch cache to hide a gap)
# and a compaction every 10 s, so a resourceVersion from before a gap is soon gone (410 on resume).
FAULT_APISERVER_FLAGS = ("--watch-cache=false", "--etcd-compaction-interval=10s")
CONVERGE_TIMEOUT_S = 120.0
SETTLE_S = 10.0  # watched after convergence for anything recreated or re-applied


class Operator(Protocol):
    proc: subprocess.Popen[bytes]
    health_port: int

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def metrics(self) -> str: ...


Start = Callable[[str, dict[str, str]], Operator]


@dataclass
class Row:
    fault: str
    converge_s: float | None  # from the fault's end until converged; None: not within the timeout
    ghosts: int = 0  # objects the operator's cache (or probe) holds that the API no longer has
    duplicates: int = 0  # after convergence: children of deleted owners created, Deployments re-applied
    restarts: int = 0  # operator processes that exited
    events_per_transition: float = 1.0  # the most Events posted for one (object, reason, message)
    detail: str = ""
    samples: list[float] = field(default_factory=list)  # leader kills: each failover's seconds
    health_during: str = ""  # what /healthz and /readyz answered while the API server was away


def health(op: Operator) -> str:
    """'healthz <code>, readyz <code>: <first line of its body>'."""
    out = []
    for path in ("healthz", "readyz"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{op.health_port}/{path}", timeout=5) as r:
                code, body = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read().decode()
        except OSError as e:
            code, body = 0, str(e)
        out.append(f"{path} {code}" + (f": {body.splitlines()[0]}" if path == "readyz" and body else ""))
    return ", ".join(out)


def sm_body(name: str, *, probe: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "engine": {"kind": "simulator"},
        "resources": {"gpus": 0},
        # probed against no engine (a closed port): with the readiness gate no pod would ever be Ready
        "probe": {"enabled": True, "interval": 5, "readinessGate": False} if probe else {"enabled": False},
    }
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": spec,
    }


def metric(op: Operator, sample: str, **labels: str) -> float:
    try:
        text = op.metrics()
    except (OSError, urllib.error.URLError):
        return float("nan")
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == sample and set(labels.items()) <= set(s.labels.items())
    )


def items(cp: controlplane.ControlPlane, namespace: str, what: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = cp.get_json(what, "-n", namespace, timeout=60)["items"]
    return out


def create(
    cp: controlplane.ControlPlane, namespace: str, names: Sequence[str], *, probe: bool = False
) -> None:
    path = f"{API}/namespaces/{namespace}/servedmodels"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: cp.request("POST", path, sm_body(n, probe=probe)), names))


def delete(cp: controlplane.ControlPlane, namespace: str, kind_path: str, names: Sequence[str]) -> None:
    def one(name: str) -> None:
        try:
            cp.request("DELETE", f"{kind_path}/{name}")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, names))


def picture(
    cp: controlplane.ControlPlane, namespace: str, op: Operator, *, probing: bool
) -> tuple[bool, int, str]:
    """(converged, ghosts, what differs) for the operator `op` over `namespace`."""
    models = items(cp, namespace, "servedmodels")
    deployments = items(cp, namespace, "deployments")
    uids = {m["metadata"]["uid"]: m for m in models}
    owned = {
        ref["uid"]
        for d in deployments
        for ref in d["metadata"].get("ownerReferences") or []
        if ref.get("kind") == "ServedModel"
    }
    cached_models = metric(op, "servedmodel_cache_objects", kind="ServedModel")
    cached_deps = metric(op, "servedmodel_cache_objects", kind="Deployment")
    ghosts = max(0, int(cached_models) - len(models)) if cached_models == cached_models else 0
    problems = []
    if cached_models != len(models):
        problems.append(f"cache holds {cached_models:.0f} ServedModels, the API {len(models)}")
    if cached_deps != len(deployments):
        problems.append(f"cache holds {cached_deps:.0f} Deployments, the API {len(deployments)}")
    if probing:
        scheduled = metric(op, "servedmodel_probe_scheduled_models")
        ghosts = max(ghosts, int(scheduled) - len(models)) if scheduled == scheduled else ghosts
        if scheduled != len(models):
            problems.append(f"the probe schedules {scheduled:.0f} ServedModels, the API has {len(models)}")
    unobserved = [
        m["metadata"]["name"]
        for m in models
        if (m.get("status") or {}).get("observedGeneration") != m["metadata"].get("generation")
    ]
    if unobserved:
        problems.append(
            f"{len(unobserved)} without a status of their generation ({', '.join(unobserved[:3])})"
        )
    orphaned = [u for u in uids if u not in owned]
    if orphaned:
        problems.append(f"{len(orphaned)} ServedModels without their Deployment")
    return not problems, ghosts, "; ".join(problems)


def wait_converged(
    cp: controlplane.ControlPlane,
    namespace: str,
    op: Operator,
    since: float,
    *,
    probing: bool = False,
    timeout: float = CONVERGE_TIMEOUT_S,
) -> tuple[float | None, int, str]:
    """(seconds from `since` to convergence or None, ghosts at the end, the last difference)."""
    deadline = time.monotonic() + timeout
    ghosts, why = 0, ""
    while time.monotonic() < deadline:
        try:
            ok, ghosts, why = picture(cp, namespace, op, probing=probing)
        except (controlplane.ControlPlaneError, OSError, ValueError) as e:
            ok, why = False, f"API: {e}"
        if ok:
            return time.monotonic() - since, ghosts, ""
        time.sleep(1.0)
    return None, ghosts, why


def children_of_the_deleted(
    cp: controlplane.ControlPlane, namespace: str, created_after: str, live_uids: set[str]
) -> int:
    """Deployments and Services created after `created_after` (RFC 3339) for owners no longer there."""
    n = 0
    for what in ("deployments", "services"):
        for obj in items(cp, namespace, what):
            refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("kind") == "ServedModel"]
            if (
                refs
                and refs[0]["uid"] not in live_uids
                and obj["metadata"]["creationTimestamp"] >= created_after
            ):
                n += 1
    return n


def events_per_transition(cp: controlplane.ControlPlane, namespace: str) -> float:
    seen: Counter[tuple[str, str, str]] = Counter()
    for e in items(cp, namespace, "events"):
        if (e.get("source") or {}).get("component") == "servedmodel-operator":
            seen[(e["involvedObject"].get("uid") or "", e.get("reason") or "", e.get("message") or "")] += (
                int(e.get("count") or 1)
            )
    return float(max(seen.values(), default=1))


def generations(cp: controlplane.ControlPlane, namespace: str) -> dict[str, int]:
    return {
        d["metadata"]["name"]: int(d["metadata"]["generation"]) for d in items(cp, namespace, "deployments")
    }


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _finish(
    fault: str, cp: controlplane.ControlPlane, namespace: str, op: Operator, since: float, *, probing: bool
) -> Row:
    converge_s, ghosts, why = wait_converged(cp, namespace, op, since, probing=probing)
    # Counted from here: a pass that was already applying when its ServedModel was deleted may create
    # its children once more (garbage collection takes them); a loop would create them again.
    marker = utc_now()
    before = generations(cp, namespace)
    time.sleep(SETTLE_S)
    live = {m["metadata"]["uid"] for m in items(cp, namespace, "servedmodels")}
    after = generations(cp, namespace)
    rolled = sum(1 for k, g in after.items() if k in before and g != before[k])
    _ok, late_ghosts, _why = picture(cp, namespace, op, probing=probing)
    return Row(
        fault,
        converge_s,
        ghosts=max(ghosts, late_ghosts),
        duplicates=children_of_the_deleted(cp, namespace, marker, live) + rolled,
        restarts=0 if op.alive() else 1,
        events_per_transition=events_per_transition(cp, namespace),
        detail=why,
    )


def wait_ready(
    cp: controlplane.ControlPlane, namespace: str, op: Operator, n: int, timeout: float = 180.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = items(cp, namespace, "servedmodels")
        if len(models) == n and all(
            (m.get("status") or {}).get("observedGeneration") == m["metadata"].get("generation")
            for m in models
        ):
            return
        if not op.alive():
            raise RuntimeError("the operator exited")
        time.sleep(1.0)
    raise RuntimeError(f"{n} ServedModels not reconciled within {timeout:.0f}s")


ENV = {"SERVEDMODEL_METRICS_AUTH": "false"}


# ---- the scenarios -------------------------------------------------------------------------------


def relist_410(cp: controlplane.ControlPlane, start: Start, namespace: str, n: int = 20) -> Row:
    """The operator frozen (SIGSTOP); half the models deleted; the API server restarted (its watches cut)
    and etcd compacted past them; the operator thawed: its watches resume at a compacted
    resourceVersion (410) and must relist, pruning what the list lacks."""
    op = start(namespace, ENV)
    names = [f"m{i:02d}" for i in range(n)]
    create(cp, namespace, names, probe=True)
    wait_ready(cp, namespace, op, n)
    proc = op.proc
    proc.send_signal(signal.SIGSTOP)
    try:
        delete(cp, namespace, f"{API}/namespaces/{namespace}/servedmodels", names[: n // 2])
        cp.kill("kube-apiserver")
        cp.restart("kube-apiserver")
        time.sleep(25.0)  # two compactions: the operator's resourceVersions are gone
    finally:
        proc.send_signal(signal.SIGCONT)
    return _finish("410 relist (deletes in the gap)", cp, namespace, op, time.monotonic(), probing=True)


def apiserver_restart(cp: controlplane.ControlPlane, start: Start, namespace: str, n: int = 30) -> Row:
    """The API server SIGKILLed mid-burst and restarted 20 s later; right after, a third of the models
    deleted and one Deployment deleted behind the operator's back."""
    op = start(namespace, ENV)
    names = [f"m{i:02d}" for i in range(n)]
    create(cp, namespace, names[: n // 2])
    burst = ThreadPoolExecutor(1)
    rest = burst.submit(create_tolerant, cp, namespace, names[n // 2 :])
    time.sleep(0.5)
    cp.kill("kube-apiserver")
    time.sleep(10.0)
    during = health(op)  # the watches are down: alive, not ready, and it says which watch
    time.sleep(10.0)
    cp.restart("kube-apiserver")
    rest.result()
    burst.shutdown()
    create_tolerant(cp, namespace, names)  # what the kill refused
    delete(cp, namespace, f"{API}/namespaces/{namespace}/servedmodels", names[: n // 3])
    delete(cp, namespace, f"/apis/apps/v1/namespaces/{namespace}/deployments", [names[-1]])
    row = _finish("API server SIGKILL + restart", cp, namespace, op, time.monotonic(), probing=False)
    row.health_during = during
    return row


def create_tolerant(cp: controlplane.ControlPlane, namespace: str, names: Sequence[str]) -> None:
    """Create what does not exist yet, riding out an API server that is away (bounded: 60 s)."""
    path = f"{API}/namespaces/{namespace}/servedmodels"
    for name in names:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                cp.request("POST", path, sm_body(name))
                break
            except urllib.error.HTTPError as e:
                if e.code == 409:
                    break
                if time.monotonic() > deadline:
                    raise
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(1.0)


def etcd_pause(
    cp: controlplane.ControlPlane, start: Start, namespace: str, seconds: float, n: int = 10
) -> Row:
    """etcd SIGSTOPped for `seconds` (the API server hangs, then fails every request); then models are
    deleted and created. The operator must ride it out (same pid) and converge."""
    op = start(namespace, ENV)
    names = [f"m{i:02d}" for i in range(n)]
    create(cp, namespace, names)
    wait_ready(cp, namespace, op, n)
    cp.pause("etcd")
    alive_during = True
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            alive_during = alive_during and op.alive()
            time.sleep(1.0)
    finally:
        cp.resume("etcd")
    delete(cp, namespace, f"{API}/namespaces/{namespace}/servedmodels", names[:3])
    create_tolerant(cp, namespace, [f"new{i}" for i in range(3)])
    row = _finish(f"etcd paused {seconds:.0f} s", cp, namespace, op, time.monotonic(), probing=False)
    row.restarts += 0 if alive_during else 1
    return row


def leader_kill(
    cp: controlplane.ControlPlane, start: Start, namespace: str, rounds: int = 1, n: int = 10
) -> Row:
    """Two operators on one namespace; the leader SIGKILLed `rounds` times (a new follower started after
    each). Measures the failover (kill → the follower leads) and checks the follower wrote nothing while
    it followed and no Deployment's generation moved."""
    ops = [start(namespace, ENV), start(namespace, ENV)]
    create(cp, namespace, [f"m{i:02d}" for i in range(n)])
    wait_ready(cp, namespace, ops[0], n)
    failovers: list[float] = []
    follower_writes = 0.0
    duplicates = 0
    for _ in range(rounds):
        deadline = time.monotonic() + 60.0
        while True:
            leaders = [o for o in ops if metric(o, "servedmodel_leader") == 1.0]
            if len(leaders) == 1:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(leaders)} leaders among {len(ops)} operators")
            time.sleep(0.5)
        leader = leaders[0]
        follower = next(o for o in ops if o is not leader)
        follower_writes += sum(
            metric(follower, "servedmodel_kube_api_requests_by_verb", verb=v)
            for v in ("PATCH", "POST", "DELETE")
        )
        before = generations(cp, namespace)
        held = leader_lease(cp, leader)
        leader.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while metric(follower, "servedmodel_leader") != 1.0:
            if time.monotonic() - killed > 120.0:
                raise RuntimeError("the follower did not take over within 120 s")
            time.sleep(0.2)
        failovers.append(time.monotonic() - killed)
        taken = leader_lease(cp, follower)
        transitions = [lease["spec"].get("leaseTransitions", 0) for lease in (held, taken)]
        if taken["metadata"]["name"] != held["metadata"]["name"] or transitions[1] != transitions[0] + 1:
            raise RuntimeError(f"the follower leads without the killed leader's Lease: {held} -> {taken}")
        time.sleep(3.0)  # the new leader's first passes
        after = generations(cp, namespace)
        duplicates += sum(1 for k, g in after.items() if before.get(k, g) != g)
        ops = [follower, start(namespace, ENV)]
    row = _finish(f"leader SIGKILL x{rounds}", cp, namespace, ops[0], time.monotonic(), probing=False)
    row.duplicates += duplicates + int(follower_writes)
    row.samples = failovers
    row.detail = (
        f"failover p50 {statistics.median(failovers):.1f} s, max {max(failovers):.1f} s; "
        f"follower writes {follower_writes:.0f}" + (f"; {row.detail}" if row.detail else "")
    )
    return row


def leader_lease(cp: controlplane.ControlPlane, op: Operator) -> dict[str, Any]:
    """The leader-election Lease `op` holds (its holder identity is `<host>_<pid>_<suffix>`,
    handlers/startup.holder_identity); RuntimeError when it holds none."""
    for lease in cp.request("GET", "/apis/coordination.k8s.io/v1/leases")["items"]:
        holder = lease["spec"].get("holderIdentity") or ""
        if lease["metadata"]["name"].startswith("servedmodel-operator") and f"_{op.pid}_" in holder:
            return dict(lease)
    raise RuntimeError(f"operator pid {op.pid} holds no servedmodel-operator Lease")


def delete_recreate(cp: controlplane.ControlPlane, start: Start, namespace: str, rounds: int = 100) -> Row:
    """One name deleted and created again `rounds` times, as fast as the API takes it, while the probe
    writes its status every cycle; then it must have a status, its Deployment owned by its last uid,
    and the cache must hold exactly one of each."""
    op = start(namespace, ENV)
    path = f"{API}/namespaces/{namespace}/servedmodels"
    for _ in range(rounds):
        try:
            cp.request("DELETE", f"{path}/flip")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        while True:
            try:
                cp.request("POST", path, sm_body("flip", probe=True))
                break
            except urllib.error.HTTPError as e:
                if e.code != 409:  # still being deleted
                    raise
                time.sleep(0.05)
    return _finish(f"delete + recreate x{rounds}", cp, namespace, op, time.monotonic(), probing=True)


def table(rows: list[Row]) -> str:
    head = "| fault | converged after, s | ghosts | duplicates | operator restarts | Events per transition "
    head += "| notes |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        conv = f"{r.converge_s:.1f}" if r.converge_s is not None else "**never**"
        lines.append(
            f"| {r.fault} | {conv} | {r.ghosts} | {r.duplicates} | {r.restarts} | "
            f"{r.events_per_transition:.0f} | {r.detail} |"
        )
    return "\n".join(lines)

"""The operator's readiness gate, honoured by a real kubelet: a ServedModel (engine.kind simulator, the
simulator image built by hack/images.py from images/simulator/Containerfile) whose engine pod lands on
realnode.REAL_NODE. The kubelet runs the container and its /health probes; the operator, a real
`servedmodel run` on this machine with no endpoint override, probes the pod at its pod IP over the CNI
bridge and sets the gate condition; only then does the kubelet report the pod Ready. Then a client pod
on the node reaches the ServedModel's Service by its ClusterIP, and the API server through the
`kubernetes` Service, both through kube-proxy's rules.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_real_node import delete_and_wait, wait_pod

import controlplane
import images
import realnode
from servedmodel.api.conditions import SERVING
from servedmodel.api.probe import READINESS_GATE_CONDITION

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 180.0


def _condition(conds: list[dict[str, Any]] | None, kind: str) -> str | None:
    for c in conds or []:
        if c.get("type") == kind:
            return str(c.get("status"))
    return None


def served_model(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "engine": {"kind": "simulator", "image": images.reference("simulator"), "maxModelLen": 4096},
            "resources": {"gpus": 0},
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": realnode.REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "probe": {"interval": 5, "readinessGate": True, "firstByteTimeout": 5, "timeout": 20},
        },
    }


# A client in a pod on the node: python from the simulator image, as restricted Pod Security asks.
CLIENT = """
import json, os, ssl, sys, time, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
api = os.environ["KUBERNETES_SERVICE_HOST"] + ":" + os.environ["KUBERNETES_SERVICE_PORT"]
out, deadline = {"kubernetes": api}, time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen("http://" + sys.argv[1] + "/v1/models", timeout=5) as r:
            out["models"] = [m["id"] for m in json.load(r)["data"]]
        req = urllib.request.Request(
            "https://" + api + "/version", headers={"Authorization": "Bearer " + open(sa + "/token").read()}
        )
        ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            out["version"] = json.load(r)["gitVersion"]
        break
    except OSError as e:
        out["error"] = repr(e)
        if time.monotonic() > deadline:
            break
        time.sleep(1)
open("/dev/termination-log", "w").write(json.dumps(out))
sys.exit(0 if "version" in out else 1)
"""


def client_pod(name: str, image: str, target: str) -> dict[str, Any]:
    """A pod that GETs http://<target>/v1/models and the API server's /version through the `kubernetes`
    Service (its ServiceAccount's token and CA), writing what it got as its termination message."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": realnode.REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", CLIENT, target],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def run_client(cp: controlplane.ControlPlane, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    """Run a client pod to its end; what it wrote as its termination message (and its exit code)."""
    name = pod["metadata"]["name"]
    cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    done = wait_pod(
        cp,
        namespace,
        name,
        "finished",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
        timeout=WAIT_S,
    )
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    out: dict[str, Any] = json.loads(terminated.get("message") or "{}")
    out["exitCode"] = terminated["exitCode"]
    delete_and_wait(cp, namespace, name)
    return out


def test_operator_gate_opens_a_real_engine_pod(
    control_plane: controlplane.ControlPlane,
    real_node: realnode.RealNode,
    namespace: str,
    operator_log: Callable[[], str],
) -> None:
    cp = control_plane
    archive, ref = images.ensure("simulator")
    real_node.ctr("images", "import", "--all-platforms", str(archive))
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(served_model("qwen")))

    def engine_pod() -> dict[str, Any] | None:
        pods = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")
        live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
        return live[0] if len(live) == 1 else None

    deadline = time.monotonic() + WAIT_S
    pod = None
    while pod is None and time.monotonic() < deadline:
        pod = engine_pod()
        time.sleep(0.5)
    assert pod is not None, f"no engine pod after {WAIT_S:.0f} s:\n{operator_log()}"
    name = pod["metadata"]["name"]
    assert pod["spec"]["readinessGates"] == [{"conditionType": READINESS_GATE_CONDITION}]
    assert pod["spec"]["containers"][0]["image"] == ref

    # The kubelet's /health probes pass first: containers ready, the pod held back by the gate until the
    # operator's probe completed a chat request at the pod's IP.
    pod = wait_pod(
        cp,
        namespace,
        name,
        "ContainersReady",
        lambda p: _condition(p.get("status", {}).get("conditions"), "ContainersReady") == "True",
        timeout=WAIT_S,
    )
    assert pod["spec"]["nodeName"] == realnode.REAL_NODE
    pod = wait_pod(
        cp,
        namespace,
        name,
        "Ready (the gate opened)",
        lambda p: _condition(p.get("status", {}).get("conditions"), "Ready") == "True",
        timeout=WAIT_S,
    )
    conds = {c["type"]: c for c in pod["status"]["conditions"]}
    assert conds[READINESS_GATE_CONDITION]["status"] == "True"
    # In that order: containers ready (the kubelet), the gate (the operator), Ready (the kubelet again).
    order = [conds[t]["lastTransitionTime"] for t in ("ContainersReady", READINESS_GATE_CONDITION, "Ready")]
    assert order == sorted(order), conds
    # A real process: the image's non-root user, seccomp filtering (RuntimeDefault), no capabilities.
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    tasks = real_node.ctr("tasks", "ls").stdout.splitlines()[1:]
    pid = next(int(line.split()[1]) for line in tasks if line.split()[0] == container_id)
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    assert status["Uid"].split()[0] == "1001"
    assert status["Seccomp"].strip() == "2"
    assert int(status["CapEff"], 16) == 0
    served = cp.get_json("servedmodel", "qwen", "-n", namespace)
    assert _condition((served.get("status") or {}).get("conditions"), SERVING) == "True", operator_log()
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/health", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/v1/models", timeout=5) as r:
        models = [m["id"] for m in json.load(r)["data"]]

    # kube-proxy: a pod on the node reaches the engine by its Service's ClusterIP, and the API server by the
    # `kubernetes` Service (its endpoint kube-apiserver's address on the bridge), with its ServiceAccount.
    service = cp.get_json("service", "qwen-engine", "-n", namespace)
    cluster_ip = service["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(controlplane.SERVICE_CIDR)
    got = run_client(cp, namespace, client_pod("client", ref, f"{cluster_ip}:8000"))
    assert got["exitCode"] == 0, got
    assert got["models"] == models, got
    assert got["kubernetes"] == "10.0.0.1:443", got
    assert got["version"] == controlplane.versions()["K8S_VERSION"], got

    cp.kubectl("delete", "-n", namespace, "servedmodel", "qwen", "--wait=false")
    # The Deployment goes with its owner (garbage collection), then the pod: the kubelet tears it down.
    deadline = time.monotonic() + 60
    while engine_pod() is not None or _pods_left(cp, namespace):
        assert time.monotonic() < deadline, "the engine pod outlived its ServedModel by 60 s"
        time.sleep(0.5)


def _pods_left(cp: controlplane.ControlPlane, namespace: str) -> bool:
    return bool(cp.get_json("pods", "-n", namespace)["items"])


def _degraded_reason(cp: controlplane.ControlPlane, namespace: str, name: str) -> str | None:
    status = cp.get_json("servedmodel", name, "-n", namespace).get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "Degraded" and c.get("status") == "True":
            return str(c.get("reason"))
    return None


def test_kubelet_failures_surface_as_reasons(
    control_plane: controlplane.ControlPlane,
    real_node: realnode.RealNode,
    namespace: str,
    operator_log: Callable[[], str],
) -> None:
    """What a real kubelet reports, in the ServedModel's status: an image that does not exist (the pull
    from `localhost`, on this machine, is refused: ErrImagePull, then ImagePullBackOff) and an engine that
    exits at start (an argument the simulator refuses, exit 2: restarted until CrashLoopBackOff)."""
    cp = control_plane
    archive, _ = images.ensure("simulator")
    real_node.ctr("images", "import", "--all-platforms", str(archive))
    missing = served_model("nopull")
    missing["spec"]["engine"]["image"] = "localhost/servedmodel/does-not-exist:dev"
    crashing = served_model("crash")
    crashing["spec"]["engine"]["extraArgs"] = ["--no-such-flag"]
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all([missing, crashing]))
    want = {"nopull": "ImagePullBackOff", "crash": "CrashLoopBackOff"}
    seen: dict[str, str | None] = {}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        seen = {name: _degraded_reason(cp, namespace, name) for name in want}
        if seen == want:
            break
        time.sleep(1)
    assert seen == want, f"{seen}\n{cp.kubectl('get', 'pods', '-n', namespace, '-o', 'wide').stdout}"
    crash = cp.get_json("servedmodel", "crash", "-n", namespace)["status"]
    message = next(c["message"] for c in crash["conditions"] if c["type"] == "Degraded")
    assert "exit code 2" in message, message
    cp.kubectl("delete", "-n", namespace, "servedmodel", "nopull", "crash", "--wait=false")
    deadline = time.monotonic() + 60
    while _pods_left(cp, namespace):
        assert time.monotonic() < deadline, "the engine pods outlived their ServedModels by 60 s"
        time.sleep(0.5)


# One line per version of the ServedModel the API server sends a watch: phase, restarts, Degraded's
# status and reason and message, Serving's status and reason (the probe's).
_WATCH_FIELDS = (
    '{.status.phase}{"|"}{.status.restarts}{"|"}'
    '{.status.conditions[?(@.type=="Degraded")].status}{"|"}'
    '{.status.conditions[?(@.type=="Degraded")].reason}{"|"}'
    '{.status.conditions[?(@.type=="Degraded")].message}{"|"}'
    '{.status.conditions[?(@.type=="Serving")].status}{"|"}'
    '{.status.conditions[?(@.type=="Serving")].reason}{"\\n"}'
)


@contextlib.contextmanager
def watch_status(cp: controlplane.ControlPlane, namespace: str, name: str, out: Path) -> Iterator[Path]:
    """`kubectl get -w` of the ServedModel into `out`, a line per version written (none missed between
    polls, as a poll of a short outage could); stopped by its pid."""
    cmd = [str(cp.bin_dir / "kubectl"), f"--kubeconfig={cp.kubeconfig}", "get", "servedmodel", name]
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [*cmd, "-n", namespace, "--watch", "-o", f"jsonpath={_WATCH_FIELDS}"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _versions(watched: Path) -> list[dict[str, str]]:
    keys = ("phase", "restarts", "degraded", "reason", "message", "serving", "servingReason")
    return [dict(zip(keys, line.split("|"), strict=False)) for line in watched.read_text().splitlines()]


def test_killed_engine_restarts_and_recovers(
    control_plane: controlplane.ControlPlane,
    real_node: realnode.RealNode,
    namespace: str,
    operator_log: Callable[[], str],
    tmp_path: Path,
) -> None:
    """The engine container's process killed for real (SIGKILL to its pid on this machine): the kubelet
    restarts it in the same pod (restartCount 1, last exit 137), the ServedModel says so while it is down
    (Degraded, reason ContainerRestarted, the exit in the message) and counts it (status.restarts 1), and
    it recovers to Ready and Serving with the count kept."""
    cp = control_plane
    archive, _ = images.ensure("simulator")
    real_node.ctr("images", "import", "--all-platforms", str(archive))
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(served_model("killed")))

    def served() -> dict[str, Any]:
        return cp.get_json("servedmodel", "killed", "-n", namespace).get("status") or {}

    def serving(status: dict[str, Any]) -> bool:
        return status.get("phase") == "Ready" and _condition(status.get("conditions"), SERVING) == "True"

    deadline = time.monotonic() + WAIT_S
    while not serving(status := served()):
        assert time.monotonic() < deadline, f"not serving after {WAIT_S:.0f} s: {status}\n{operator_log()}"
        time.sleep(1)
    assert status.get("restarts") == 0, status
    (pod,) = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=killed")["items"]
    name = pod["metadata"]["name"]
    engine = pod["status"]["containerStatuses"][0]
    assert engine["restartCount"] == 0, engine
    container_id = engine["containerID"].removeprefix("containerd://")
    tasks = real_node.ctr("tasks", "ls").stdout.splitlines()[1:]
    pid = next(int(line.split()[1]) for line in tasks if line.split()[0] == container_id)
    assert "servedmodel" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"), pid

    with watch_status(cp, namespace, "killed", tmp_path / "watch.txt") as watched:
        os.kill(pid, signal.SIGKILL)
        # The kubelet restarts the container in the same pod: a new container, the old one's exit kept.
        pod = wait_pod(
            cp,
            namespace,
            name,
            "restarted once",
            lambda p: [c.get("restartCount") for c in p["status"].get("containerStatuses") or []] == [1],
            timeout=WAIT_S,
        )
        engine = pod["status"]["containerStatuses"][0]
        assert engine["lastState"]["terminated"]["exitCode"] == 137, engine
        assert engine["containerID"].removeprefix("containerd://") != container_id
        # While it is down: the failure and its reason in the ServedModel's status; then serving again.
        deadline = time.monotonic() + WAIT_S
        while True:
            versions = _versions(watched)
            down = [v for v in versions if v["degraded"] == "True" and v["reason"] == "ContainerRestarted"]
            if down and serving(status := served()):
                break
            assert time.monotonic() < deadline, f"{versions}\n{served()}\n{operator_log()}"
            time.sleep(1)
    assert down[0]["phase"] == "Degraded", down
    assert down[0]["restarts"] == "1", down
    assert f"pod {name}: container" in down[0]["message"], down
    assert "restart 1, last exit Error, exit code 137" in down[0]["message"], down
    # Recovered: the same pod, Ready and Serving, the restart still counted, nothing Degraded.
    assert status["restarts"] == 1, status
    assert _condition(status.get("conditions"), "Degraded") == "False", status
    (pod,) = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=killed")["items"]
    assert pod["metadata"]["name"] == name
    assert _condition(pod["status"]["conditions"], "Ready") == "True", pod["status"]
    cp.kubectl("delete", "-n", namespace, "servedmodel", "killed", "--wait=false")
    deadline = time.monotonic() + 60
    while _pods_left(cp, namespace):
        assert time.monotonic() < deadline, "the engine pod outlived its ServedModel by 60 s"
        time.sleep(0.5)

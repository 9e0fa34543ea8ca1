"""A real container on the real node: the engine simulator (python -m servedmodel.sim) in a pod on
realnode.REAL_NODE, its rootfs the locally built pause image with this machine's Python and the checkout
mounted read-only; the kubelet's readiness probe and this process reach it at its pod IP over the
CNI bridge."""

from __future__ import annotations

import ipaddress
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import controlplane
import realnode
from pause_image import PAUSE_IMAGE

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
SIM_PORT = 8000


def _ro_host(name: str, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": name, "hostPath": {"path": path, "type": "Directory"}}
    return volume, {"name": name, "mountPath": path, "readOnly": True}


def sim_pod(name: str) -> dict[str, Any]:
    paths = [("usr", "/usr"), ("lib", "/lib"), ("lib64", "/lib64"), ("src", str(ROOT))]
    # The venv's python links to its base installation (pyenv's under /root here): mount that too.
    if not any(Path(sys.base_prefix).is_relative_to(p) for _, p in paths):
        paths.append(("python", sys.base_prefix))
    mounts = [_ro_host(n, p) for n, p in paths]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": realnode.REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 2,
            "volumes": [v for v, _ in mounts],
            "containers": [
                {
                    "name": "engine",
                    "image": PAUSE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [
                        sys.executable,
                        "-m",
                        "servedmodel.sim",
                        "--host",
                        "0.0.0.0",
                        "--port",
                        str(SIM_PORT),
                    ],
                    "env": [
                        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                        {"name": "HOME", "value": "/tmp"},
                    ],
                    "volumeMounts": [m for _, m in mounts],
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": SIM_PORT},
                        "periodSeconds": 1,
                    },
                }
            ],
        },
    }


def _ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def wait_pod(
    cp: controlplane.ControlPlane,
    namespace: str,
    name: str,
    what: str,
    ok: Callable[[dict[str, Any]], bool],
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Poll pod `name` until ok(pod) holds; its last state in the error when it does not."""
    deadline = time.monotonic() + timeout
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if ok(pod):
            return pod
        time.sleep(0.5)
    raise AssertionError(f"pod {name}: not {what} after {timeout:.0f} s: {pod.get('status')}")


def test_simulator_pod_ready_on_real_node(
    bare_control_plane: controlplane.ControlPlane, real_node: realnode.RealNode, namespace: str
) -> None:
    cp = bare_control_plane
    cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", sim_pod("sim"))
    pod = wait_pod(cp, namespace, "sim", "Ready", _ready)
    assert pod["spec"]["nodeName"] == realnode.REAL_NODE
    ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert ip in ipaddress.ip_network(realnode.POD_CIDR)
    with urllib.request.urlopen(f"http://{ip}:{SIM_PORT}/health", timeout=5) as r:
        assert r.status == 200
    delete_and_wait(cp, namespace, "sim")


def delete_and_wait(cp: controlplane.ControlPlane, namespace: str, name: str, timeout: float = 30.0) -> None:
    """Delete a pod and wait until the kubelet has torn it down (containers stopped, the sandbox's network
    released by CNI DEL) and the API object is gone."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    cp.request("DELETE", path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            cp.request("GET", path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return
            raise
        time.sleep(0.2)
    raise AssertionError(f"pod {namespace}/{name} still there {timeout:.0f} s after its deletion")


def _engine_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    status: dict[str, Any] = statuses[0]
    return status


def test_killed_engine_container_is_restarted(
    bare_control_plane: controlplane.ControlPlane, real_node: realnode.RealNode, namespace: str
) -> None:
    """SIGKILL to the engine's process (through containerd, as the OOM killer or a crash would end it):
    the kubelet restarts the container in the same sandbox (same pod IP), the restart count rises, and
    the readiness probe makes the pod Ready again."""
    cp = bare_control_plane
    cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", sim_pod("sim"))
    pod = wait_pod(cp, namespace, "sim", "Ready", _ready)
    before = _engine_status(pod)
    assert before["restartCount"] == 0
    container_id = before["containerID"].removeprefix("containerd://")
    real_node.ctr("tasks", "kill", "-s", "SIGKILL", container_id)
    pod = wait_pod(
        cp,
        namespace,
        "sim",
        "restarted and Ready",
        lambda p: _engine_status(p).get("restartCount", 0) >= 1 and _ready(p),
        timeout=90,
    )
    after = _engine_status(pod)
    assert after["containerID"] != before["containerID"]
    assert after["lastState"]["terminated"]["exitCode"] == 137  # killed by SIGKILL
    ip = pod["status"]["podIP"]
    with urllib.request.urlopen(f"http://{ip}:{SIM_PORT}/health", timeout=5) as r:
        assert r.status == 200
    delete_and_wait(cp, namespace, "sim")

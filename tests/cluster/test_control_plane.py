"""The local control plane behaves like a cluster where the operator needs it to: GPU Deployments
schedule onto the fake (kwok) GPU node and become available, owned children are garbage-collected,
namespaces finish deleting, CEL rules reject objects with the API server's message, parallel
launches don't collide, and stopping leaves no process behind.

Deadlines below bound waits on a shared machine; they are not speed assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cluster_support
import pytest

import controlplane

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0


def wait_for(what: str, cond: Callable[[], bool], timeout: float = WAIT_S) -> None:
    cluster_support.wait_for(what, cond, timeout, interval=0.1)


def gone(cp: controlplane.ControlPlane, path: str) -> bool:
    try:
        cp.request("GET", path)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return True
        raise
    return False


def gpu_deployment(
    name: str, owner: dict[str, Any] | None = None, claim: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app": name}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.33.0",
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "4"}},
    }
    pod: dict[str, Any] = {"containers": [container]}
    if claim is not None:
        pod["volumes"] = [{"name": "cache", "persistentVolumeClaim": {"claimName": claim}}]
        container["volumeMounts"] = [{"name": "cache", "mountPath": "/root/.cache/huggingface"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod},
        },
    }


def test_version_matches_pin(bare_control_plane: controlplane.ControlPlane) -> None:
    version = bare_control_plane.request("GET", "/version")
    assert version["gitVersion"] == controlplane.versions()["K8S_VERSION"]
    client = json.loads(bare_control_plane.kubectl("version", "--client", "-o", "json").stdout)
    assert client["clientVersion"]["gitVersion"] == controlplane.versions()["K8S_VERSION"]


def test_gpu_node_advertises_gpus(bare_control_plane: controlplane.ControlPlane) -> None:
    node = bare_control_plane.request("GET", f"/api/v1/nodes/{controlplane.GPU_NODE}")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    assert node["spec"].get("taints") is None


def test_gpu_deployment_becomes_available(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    cp = bare_control_plane
    # Like the operator's: a weight-cache claim with no storage class, bound to a pre-created fake volume.
    pvc = {
        "metadata": {"name": "cache"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}},
    }
    cp.request("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", pvc)
    cp.request(
        "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", gpu_deployment("vllm", claim="cache")
    )
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/vllm"
    wait_for(
        "Deployment availableReplicas=1",
        lambda: cp.request("GET", path).get("status", {}).get("availableReplicas") == 1,
    )
    pods = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector=app%3Dvllm")["items"]
    assert [p["spec"]["nodeName"] for p in pods] == [controlplane.GPU_NODE]
    assert pods[0]["status"]["phase"] == "Running"
    claim = cp.request("GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/cache")
    assert claim["status"]["phase"] == "Bound"
    # kubectl shows the same thing a user would see.
    out = cp.kubectl(
        "-n", namespace, "get", "deployment", "vllm", "-o", "jsonpath={.status.availableReplicas}"
    )
    assert out.stdout == "1"


def test_deleting_owner_garbage_collects_children(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    cp = bare_control_plane
    owner = cp.request("POST", f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    cp.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/secrets",
        {"metadata": {"name": "child-secret", "ownerReferences": [ref]}, "stringData": {"k": "v"}},
    )
    cp.request("POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", gpu_deployment("child", ref))
    pods = f"/api/v1/namespaces/{namespace}/pods?labelSelector=app%3Dchild"
    wait_for("the child Deployment's Pod", lambda: len(cp.request("GET", pods)["items"]) == 1)

    cp.request("DELETE", f"/api/v1/namespaces/{namespace}/configmaps/owner")
    wait_for(
        "child Secret collected", lambda: gone(cp, f"/api/v1/namespaces/{namespace}/secrets/child-secret")
    )
    wait_for(
        "child Deployment collected",
        lambda: gone(cp, f"/apis/apps/v1/namespaces/{namespace}/deployments/child"),
    )
    rs = f"/apis/apps/v1/namespaces/{namespace}/replicasets?labelSelector=app%3Dchild"
    wait_for("its ReplicaSet collected", lambda: cp.request("GET", rs)["items"] == [])
    wait_for("its Pod deleted", lambda: cp.request("GET", pods)["items"] == [])


def test_namespace_deletion_completes(bare_control_plane: controlplane.ControlPlane) -> None:
    cp = bare_control_plane
    name = f"doomed-{int(time.time() * 1000) % 10**8}"
    cp.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    wait_for(
        "default ServiceAccount", lambda: not gone(cp, f"/api/v1/namespaces/{name}/serviceaccounts/default")
    )
    cp.request("POST", f"/apis/apps/v1/namespaces/{name}/deployments", gpu_deployment("vllm"))
    cp.request("POST", f"/api/v1/namespaces/{name}/configmaps", {"metadata": {"name": "c"}})
    wait_for("the Pod", lambda: len(cp.request("GET", f"/api/v1/namespaces/{name}/pods")["items"]) == 1)
    cp.request("DELETE", f"/api/v1/namespaces/{name}")
    wait_for(f"namespace {name} to disappear", lambda: gone(cp, f"/api/v1/namespaces/{name}"))


CEL_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.cel.servedmodel.io
spec:
  group: cel.servedmodel.io
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              minReplicas: {type: integer}
              maxReplicas: {type: integer}
            x-kubernetes-validations:
            - rule: self.minReplicas <= self.maxReplicas
              message: minReplicas must not exceed maxReplicas
"""


def widget(name: str, lo: int, hi: int) -> str:
    return json.dumps(
        {
            "apiVersion": "cel.servedmodel.io/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"minReplicas": lo, "maxReplicas": hi},
        }
    )


def test_cel_rule_rejects_bad_object_with_server_message(
    bare_control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    cp = bare_control_plane
    cp.kubectl("apply", "-f", "-", input=CEL_CRD)
    try:
        cp.wait_established("widgets.cel.servedmodel.io")
        cp.kubectl("-n", namespace, "create", "-f", "-", input=widget("good", 1, 2))
        bad = cp.kubectl("-n", namespace, "create", "-f", "-", input=widget("bad", 3, 2), check=False)
        assert bad.returncode != 0
        assert "minReplicas must not exceed maxReplicas" in bad.stderr
        assert "Invalid value" in bad.stderr
        assert gone(cp, f"/apis/cel.servedmodel.io/v1/namespaces/{namespace}/widgets/bad")
    finally:
        cp.kubectl("delete", "crd", "widgets.cel.servedmodel.io", "--wait=false", check=False)


def test_parallel_launches_do_not_collide(
    bare_control_plane: controlplane.ControlPlane, tmp_path: Path
) -> None:
    """Two more control planes, each launched by its own process at the same time (as two test runs
    would be), next to the session's: all ready, distinct ports and directories, and `down` stops them."""
    dirs = [tmp_path / "run-a", tmp_path / "run-b"]
    script = str(ROOT / "hack" / "controlplane.py")
    launches = [
        subprocess.Popen(
            [sys.executable, script, "up", "--dir", str(d)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in dirs
    ]
    infos: list[dict[str, Any]] = []
    try:
        for p in launches:
            _, err = p.communicate(timeout=WAIT_S)
            assert p.returncode == 0, err
        infos = [json.loads((d / "controlplane.json").read_text()) for d in dirs]
        ports = [set(i["ports"].values()) for i in infos] + [set(bare_control_plane.ports.values())]
        assert not ports[0] & ports[1]
        assert not ports[0] & ports[2]
        assert not ports[1] & ports[2]
        assert len({i["kubeconfig"] for i in infos} | {str(bare_control_plane.kubeconfig)}) == 3
        for d in dirs:
            kubectl = [str(bare_control_plane.bin_dir / "kubectl"), f"--kubeconfig={d / 'kubeconfig'}"]
            res = subprocess.run(
                [*kubectl, "get", "node", controlplane.GPU_NODE, "-o", "jsonpath={.metadata.name}"],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
            assert res.stdout == controlplane.GPU_NODE
    finally:
        for p in launches:
            if p.poll() is None:
                p.kill()
                p.wait()
        stopped = [controlplane.stop_dir(d) for d in dirs]
    for info, was_running in zip(infos, stopped, strict=False):
        assert {n for n, _ in was_running} == set(controlplane.COMPONENTS)
        for name, pid in info["pids"].items():
            assert not controlplane.process_alive(pid, str(bare_control_plane.bin_dir / name)), name
    # The session's control plane is untouched.
    assert bare_control_plane.get_text("/readyz") == "ok"
    assert all(p.poll() is None for p in bare_control_plane.procs.values())


def test_stop_on_failure_leaves_nothing_running(bare_control_plane: controlplane.ControlPlane) -> None:
    """A test body that raises inside the context manager still stops every component by pid."""
    seen: list[controlplane.ControlPlane] = []

    def body() -> None:
        with controlplane.running() as cp:
            seen.append(cp)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    cp = seen[0]
    pids = cp.pids()
    assert set(pids) == set(controlplane.COMPONENTS)
    for name, pid in pids.items():
        assert not controlplane.process_alive(pid, str(cp.bin_dir / name)), f"{name} ({pid}) survived"
    assert not cp.dir.exists()
    left = {pid for _, pid in controlplane.leftover_processes()}
    assert left == set(bare_control_plane.pids().values())

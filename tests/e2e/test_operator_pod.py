"""The README's install, for real: the operator from its own image and manifests, as pods on the real
node. `kubectl apply --server-side -k` of a kustomization that takes manifests/overlays/kubernetes as it
is and only sets the image to the locally built localhost/servedmodel/operator:dev (`images:`) and adds
the real node's selector and toleration (kwok's fake node runs no process; the real one is tainted) and an
arbitrary UID, as OpenShift's restricted-v2 assigns one (the engine gets another: spec.engine.runAsUser);
both images run as it with GID 0. Both
replicas run, one leading on the Lease. The namespace is the base's servedmodel-system, labelled Pod
Security `restricted` (enforce): the API server admits the operator's pods only if they comply. They run
as their own ServiceAccount with its real RBAC and in-cluster config (the `kubernetes` Service, through
kube-proxy, to kube-apiserver on the node's bridge), and reconcile a simulator ServedModel to Ready, its
probe's TTFT and TPOT in `kubectl get sm`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_real_node_operator import served_model

import controlplane
import images
import realnode

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "manifests" / "overlays" / "kubernetes"
OPERATOR_NS = "servedmodel-system"
OPERATOR_SELECTOR = "app.kubernetes.io/name=servedmodel-operator"
# Arbitrary UIDs, as OpenShift assigns them (in no /etc/passwd; the primary group is then 0).
OPERATOR_UID = 1000650000
ENGINE_UID = 1000650001
WAIT_S = 240.0


def kustomization(tmp: Path) -> Path:
    """A kustomization in `tmp` over the overlay: only the image and the node change."""
    tmp.mkdir(parents=True, exist_ok=True)
    ref = images.reference("operator")
    name, tag = ref.rsplit(":", 1)
    toleration = {"key": realnode.REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
    selector = {realnode.REAL_NODE_LABEL: "true"}
    patch = [
        {"op": "add", "path": "/spec/template/spec/nodeSelector", "value": selector},
        {"op": "add", "path": "/spec/template/spec/tolerations", "value": [toleration]},
        # What OpenShift's restricted-v2 does: a UID from the namespace's range, the image's group 0.
        {"op": "add", "path": "/spec/template/spec/securityContext/runAsUser", "value": OPERATOR_UID},
    ]
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(OVERLAY, tmp)],
                "images": [{"name": "quay.io/servedmodel/operator", "newName": name, "newTag": tag}],
                "patches": [
                    {
                        "target": {"kind": "Deployment", "name": "servedmodel-operator"},
                        "patch": yaml.safe_dump(patch),
                    }
                ],
            }
        )
    )
    return tmp


def _ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


@pytest.fixture
def installed(
    bare_control_plane: controlplane.ControlPlane, real_node: realnode.RealNode, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """The operator installed by `kubectl apply --server-side -k`; its pods once both are Ready. After the
    test the ServedModels go first, while the operator runs (its finalizers), then its Deployment (not the
    CRD: the other e2e tests on this cluster use it)."""
    cp = bare_control_plane
    for name in ("operator", "simulator"):
        archive, _ = images.ensure(name)
        real_node.ctr("images", "import", "--all-platforms", str(archive))
    kdir = kustomization(tmp_path / "install")
    cp.kubectl("apply", "--server-side", "-k", str(kdir), timeout=120)
    try:
        deadline = time.monotonic() + WAIT_S
        pods: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            items = cp.get_json("pods", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR)["items"]
            pods = [p for p in items if not p["metadata"].get("deletionTimestamp")]
            if len(pods) == 2 and all(_ready(p) for p in pods):
                break
            time.sleep(1)
        else:
            raise AssertionError(
                f"the operator's 2 pods not Ready after {WAIT_S:.0f} s:\n{_operator_state(cp)}"
            )
        yield {p["metadata"]["name"]: p for p in pods}
    finally:
        for ns in cp.get_json("namespaces", "-l", "test=true")["items"]:
            cp.kubectl("delete", "servedmodels", "--all", "-n", ns["metadata"]["name"], "--wait=true",
                       "--timeout=60s", check=False)  # fmt: skip
        cp.kubectl("delete", "deployment", "servedmodel-operator", "-n", OPERATOR_NS, "--wait=true",
                   "--timeout=60s", check=False)  # fmt: skip
        deadline = time.monotonic() + 60
        while cp.get_json("pods", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR)["items"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)


def _operator_state(cp: controlplane.ControlPlane) -> str:
    out = cp.kubectl("get", "deploy,rs,pods", "-n", OPERATOR_NS, "-o", "wide", check=False).stdout
    out += cp.kubectl("get", "events", "-n", OPERATOR_NS, check=False).stdout
    pods = cp.get_json("pods", "-n", OPERATOR_NS)
    for p in pods["items"]:
        out += json.dumps(p.get("status"), indent=1)[-3000:]
    return out


def test_the_operator_runs_from_its_image_and_manifests(
    control_plane: controlplane.ControlPlane, real_node: realnode.RealNode, namespace: str,
    installed: dict[str, Any],
) -> None:  # fmt: skip
    cp = control_plane
    # Admitted under Pod Security `restricted` (enforce), as its own ServiceAccount, on the real node, from
    # the local image; in-cluster config (no kubeconfig: the `kubernetes` Service through kube-proxy).
    ns = cp.get_json("namespace", OPERATOR_NS)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for pod in installed.values():
        assert pod["spec"]["serviceAccountName"] == "servedmodel-operator"
        assert pod["spec"]["nodeName"] == realnode.REAL_NODE
        assert pod["spec"]["containers"][0]["image"] == images.reference("operator")
        assert "KUBECONFIG" not in {e["name"] for e in pod["spec"]["containers"][0].get("env") or []}
    # One leads: it wrote the Lease through the API server, as its ServiceAccount.
    leases = cp.get_json("leases", "-n", OPERATOR_NS)["items"]
    holders = {(lease["spec"].get("holderIdentity") or "") for lease in leases}
    assert any(h.startswith(tuple(installed)) for h in holders), (holders, sorted(installed))

    # A ServedModel it reconciles: namespace labelled restricted too, the engine on the real node.
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    model = served_model("qwen")
    model["spec"]["engine"]["runAsUser"] = ENGINE_UID
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(model))
    deadline = time.monotonic() + WAIT_S
    row: dict[str, str] = {}
    while time.monotonic() < deadline:
        row = sm_row(cp, namespace, "qwen")
        if row.get("READY") == "1/1" and row.get("TTFT") and row.get("TPOT"):
            break
        time.sleep(2)
    shown = f"{row}\n" + cp.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
    shown += _operator_state(cp)
    assert row.get("READY") == "1/1", shown
    assert row.get("TTFT"), shown
    assert row.get("TPOT"), shown
    assert float(row["TTFT"]) > 0
    assert float(row["TPOT"]) > 0
    # (The TTFT column is .status.probe.client.ttftMs: a second read could meet a later cycle read in one
    # lump on this loaded machine, which publishes no TTFT by design.)
    # The processes on the host: the arbitrary UIDs, group 0 (the images' group-0 layout is what lets them
    # run), as the operator and as the engine.
    engine = cp.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/instance=qwen")["items"][0]
    assert process_ids(real_node, engine) == (ENGINE_UID, 0)
    for pod in installed.values():
        assert process_ids(real_node, pod) == (OPERATOR_UID, 0)


def process_ids(node: realnode.RealNode, pod: dict[str, Any]) -> tuple[int, int]:
    """The (uid, gid) of a pod's first container's process, read from /proc on the host."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    tasks = node.ctr("tasks", "ls").stdout.splitlines()[1:]
    pid = next(int(line.split()[1]) for line in tasks if line.split()[0] == container_id)
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(status["Uid"].split()[0]), int(status["Gid"].split()[0])


def sm_row(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get sm <name>` as column -> cell (cells cut at the header's column starts: an empty cell
    stays empty)."""
    lines = cp.kubectl("get", "sm", name, "-n", namespace, check=False).stdout.splitlines()
    if len(lines) < 2:
        return {}
    header, line = lines[0], lines[1]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): line[a:b].strip() for a, b in zip(starts, ends, strict=True)}

"""The generated CRD in a real kube-apiserver: it is accepted as structural, invalid ServedModels are
rejected with a message naming the field (CEL and OpenAPI rules), defaults are filled in as pydantic
would, the scale subresource and printer columns work, and two field managers share status.conditions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import controlplane
from servedmodel.api import API_GROUP, API_VERSION, PLURAL, ServedModel

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
INVALID = yaml.safe_load((ROOT / "tests" / "golden" / "invalid_crs.yaml").read_text())
BASE_SPEC = {"model": "Qwen/Qwen2.5-7B-Instruct"}


def body(name: str = "qwen", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    merged = dict(BASE_SPEC)
    for key, value in (spec or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "ServedModel",
        "metadata": {"name": name},
        "spec": merged,
    }


def create(cp: controlplane.ControlPlane, ns: str, obj: dict[str, Any]) -> Any:
    return cp.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(obj), check=False)


def get(cp: controlplane.ControlPlane, ns: str, name: str, *extra: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(
        cp.kubectl("get", "servedmodel", name, "-n", ns, "-o", "json", *extra).stdout
    )
    return out


def status_path(ns: str, name: str) -> str:
    return f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{ns}/{PLURAL}/{name}/status"


def create_with_status(cp: controlplane.ControlPlane, ns: str, status: dict[str, Any]) -> None:
    """Creates body("qwen") and merges `status` into its status subresource (what a controller would)."""
    assert create(cp, ns, body("qwen")).returncode == 0
    cp.request(
        "PATCH", status_path(ns, "qwen"), {"status": status}, content_type="application/merge-patch+json"
    )


def test_crd_is_established_and_structural(control_plane: controlplane.ControlPlane) -> None:
    crd = json.loads(control_plane.kubectl("get", "crd", f"{PLURAL}.{API_GROUP}", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NamesAccepted") == "True"
    assert conditions.get("NonStructuralSchema") in (None, "False")


@pytest.mark.parametrize("case", INVALID, ids=[c["case"] for c in INVALID])
def test_invalid_servedmodel_rejected_naming_the_field(
    control_plane: controlplane.ControlPlane, namespace: str, case: dict[str, Any]
) -> None:
    res = create(control_plane, namespace, body(case.get("name", "qwen"), case.get("spec")))
    assert res.returncode != 0, f"{case['case']} was accepted"
    assert case["field"] in res.stderr, res.stderr


def test_valid_servedmodel_is_defaulted_like_the_model(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    res = create(control_plane, namespace, body("qwen", {"engine": {}, "resources": {}, "probe": {}}))
    assert res.returncode == 0, res.stderr
    stored = get(control_plane, namespace, "qwen")
    spec = stored["spec"]
    assert spec["replicas"] == 1
    assert spec["engine"]["kind"] == "vllm"
    assert spec["engine"]["tensorParallelSize"] == 1
    assert spec["engine"]["startupTimeoutSeconds"] == 1800
    assert spec["resources"] == {"gpus": 1, "gpuResourceName": "nvidia.com/gpu"}
    assert spec["probe"]["enabled"] is True
    parsed = ServedModel.model_validate(stored)
    assert parsed.spec.engine.startup_timeout_seconds == 1800


def test_external_mode_with_api_key_is_accepted(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    spec = {"endpoint": "http://qwen.ai.svc:8000", "engine": {"apiKeySecretRef": {"name": "k", "key": "key"}}}
    res = create(control_plane, namespace, body("qwen-ext", spec))
    assert res.returncode == 0, res.stderr


def test_scale_subresource(control_plane: controlplane.ControlPlane, namespace: str) -> None:
    cp = control_plane
    create_with_status(cp, namespace, {"replicas": 1, "selector": "app.kubernetes.io/instance=qwen"})
    cp.kubectl("scale", "servedmodel", "qwen", "-n", namespace, "--replicas=2")
    assert get(cp, namespace, "qwen")["spec"]["replicas"] == 2
    scale = json.loads(
        cp.kubectl("get", "sm", "qwen", "-n", namespace, "--subresource=scale", "-o", "json").stdout
    )
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["replicas"] == 1
    assert scale["status"]["selector"] == "app.kubernetes.io/instance=qwen"


def test_printer_columns(control_plane: controlplane.ControlPlane, namespace: str) -> None:
    cp = control_plane
    create_with_status(
        cp,
        namespace,
        {
            "phase": "Ready",
            "ready": "1/1",
            "probe": {
                "serving": "1/1",
                "client": {"ttftMs": 41.5, "tpotMs": 7.25},
                "scheduler": {"running": 3, "waiting": 1},
            },
        },
    )
    lines = cp.kubectl("get", "sm", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "MODEL",
        "READY",
        "PHASE",
        "SERVING",
        "TTFT",
        "TPOT",
        "RUNNING",
        "WAITING",
        "ADAPTERS",
        "AGE",
    ]
    row = lines[1].split()
    assert row[:9] == ["qwen", "Qwen/Qwen2.5-7B-Instruct", "1/1", "Ready", "1/1", "41.5", "7.25", "3", "1"]


def test_two_field_managers_own_their_conditions(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    cp = control_plane
    assert create(cp, namespace, body("qwen")).returncode == 0

    def apply_condition(manager: str, type_: str) -> None:
        patch = {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": "ServedModel",
            "metadata": {"name": "qwen"},
            "status": {"conditions": [{"type": type_, "status": "True", "reason": "Test", "message": ""}]},
        }
        cp.request(
            "PATCH",
            f"{status_path(namespace, 'qwen')}?fieldManager={manager}&force=true",
            patch,
            content_type="application/apply-patch+yaml",
        )

    apply_condition("servedmodel-operator", "Ready")
    apply_condition("servedmodel-probe", "Serving")
    # Re-applying one manager's set must not remove the other's entry.
    apply_condition("servedmodel-operator", "Ready")
    types = sorted(c["type"] for c in get(cp, namespace, "qwen")["status"]["conditions"])
    assert types == ["Ready", "Serving"]

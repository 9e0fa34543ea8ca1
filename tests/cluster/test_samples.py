"""manifests/samples/ apply cleanly to a real API server (really created, then read back), and the
objects render() makes from each are accepted by the API server's own validation (server-side dry run
of the PVC, Deployment and Service; Route and ServiceMonitor need OpenShift/Prometheus CRDs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import controlplane
from servedmodel.api import ServedModel
from servedmodel.render import RenderContext, render

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
CASES = sorted((ROOT / "tests" / "golden" / "cases").glob("*.yaml"))


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_applies(control_plane: controlplane.ControlPlane, namespace: str, path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    name = doc["metadata"]["name"]
    control_plane.kubectl("apply", "--server-side", "-n", namespace, "-f", str(path))
    stored = json.loads(
        control_plane.kubectl("get", "servedmodel", name, "-n", namespace, "-o", "json").stdout
    )
    assert stored["spec"]["model"] == doc["spec"]["model"]
    # What the API server stored (with its defaults) is what the operator will parse.
    assert ServedModel.model_validate(stored).name == name


@pytest.mark.parametrize("path", SAMPLES + CASES, ids=[f"{p.parent.name}/{p.stem}" for p in SAMPLES + CASES])
def test_rendered_children_pass_api_server_validation(
    control_plane: controlplane.ControlPlane, namespace: str, path: Path
) -> None:
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["namespace"] = namespace
    objects = [
        o
        for o in render(ServedModel.model_validate(doc), RenderContext())
        if o["apiVersion"] in {"v1", "apps/v1", "autoscaling/v2"}
    ]
    # External mode (spec.endpoint) deploys nothing, and is the only mode that may render nothing.
    assert bool(objects) != bool(doc["spec"].get("endpoint")), [o["kind"] for o in objects]
    for obj in objects:
        res = control_plane.kubectl(
            "apply", "--server-side", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False
        )
        assert res.returncode == 0, f"{obj['kind']}: {res.stderr}"

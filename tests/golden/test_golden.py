"""Golden tests: tests/golden/cases/<case>.yaml (a ServedModel) → tests/golden/expected/<case>.yaml (every
object render() makes, byte for byte). `UPDATE_GOLDEN=1 pytest tests/golden` rewrites the expected files;
review the diff like code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from servedmodel.api import ServedModel
from servedmodel.render import RenderContext, render, to_yaml

HERE = Path(__file__).resolve().parent
CASES = sorted((HERE / "cases").glob("*.yaml"))
PLAIN = RenderContext()
# Cases named openshift* render as if route.openshift.io and monitoring.coreos.com were discovered.
OPENSHIFT = RenderContext(has_route_api=True, has_service_monitor_api=True)


# Cases named keda* render as if keda.sh (KEDA, OpenShift's Custom Metrics Autoscaler) were discovered too.
KEDA = RenderContext(has_route_api=True, has_service_monitor_api=True, has_keda_api=True)


# Cases named wake* render as if KEDA and its HTTP add-on (http.keda.sh) were discovered, the add-on's
# external scaler at the operator's default address (the scaleToZero wake-up, render/wake.py).
WAKE = RenderContext(
    has_keda_api=True,
    has_http_add_on_api=True,
    http_scaler_address="keda-add-ons-http-external-scaler.keda:9090",
)


# Cases named inference-pool* render as if the Gateway API Inference Extension's APIs were discovered.
INFERENCE = RenderContext(has_inference_pool_api=True, has_inference_objective_api=True)


# Cases named workers* render as if leaderworkerset.x-k8s.io (LeaderWorkerSet) were discovered.
LWS = RenderContext(has_lws_api=True)


def _context(case: Path) -> RenderContext:
    if case.stem.startswith("workers"):
        return LWS
    if case.stem.startswith("wake"):
        return WAKE
    if case.stem.startswith("inference-pool"):
        return INFERENCE
    if case.stem.startswith("keda"):
        return KEDA
    return OPENSHIFT if case.stem.startswith("openshift") else PLAIN


def _golden(case: Path) -> str:
    cr = ServedModel.model_validate(yaml.safe_load(case.read_text()))
    objects = render(cr, _context(case))
    header = (
        f"# Rendered from tests/golden/cases/{case.name} by servedmodel.render "
        "(UPDATE_GOLDEN=1 pytest tests/golden rewrites this file).\n"
    )
    return header + (to_yaml(objects) if objects else "# Nothing: external mode deploys nothing.\n")


def _updating() -> bool:
    """UPDATE_GOLDEN=1 rewrites the expected files, so every golden test passes: refused under CI."""
    if os.environ.get("UPDATE_GOLDEN") != "1":
        return False
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(
            f"UPDATE_GOLDEN=1 is refused under CI (CI={os.environ['CI']}): it rewrites the expected files, "
            "so every golden test would pass; regenerate them locally and review the diff",
            pytrace=False,
        )
    return True


def test_cases_cover_the_table() -> None:
    stems = {c.stem for c in CASES}
    assert {"qwen-7b-1gpu", "qwen-tp2", "cache-pvc", "external-endpoint", "simulator", "openshift"} <= stems
    assert {"autoscaling-hpa", "keda-openshift", "inference-pool", "wake-from-zero"} <= stems
    assert {"qwen-0.5b-cpu", "qwen-0.5b-cpu-defaults"} <= stems


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden(case: Path) -> None:
    expected = HERE / "expected" / case.name
    actual = _golden(case)
    if _updating():
        expected.write_text(actual)
    assert expected.exists(), f"no golden file; run UPDATE_GOLDEN=1 pytest {Path(__file__).name}"
    assert actual == expected.read_text(), f"{case.name}: rendering changed; UPDATE_GOLDEN=1 rewrites it"


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_files_are_valid_multi_document_yaml(case: Path) -> None:
    docs = [d for d in yaml.safe_load_all((HERE / "expected" / case.name).read_text()) if d is not None]
    for doc in docs:
        assert {"apiVersion", "kind", "metadata", "spec"} <= doc.keys()

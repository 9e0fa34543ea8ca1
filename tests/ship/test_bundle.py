"""The OLM bundle: current, consistent with base and the CRD, and valid for OLM.

Two validators besides our own checks:
- operator-framework/api's `operator-verify manifests` (the library `operator-sdk bundle validate` uses),
  built from the Go module proxy (tests/ship/conftest.py), when Go is available;
- the real API server against OLM's own ClusterServiceVersion CRD schema: tests/cluster/test_manifests.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from servedmodel.api.model import ServedModel

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "manifests" / "bundle"
CSV_FILE = BUNDLE / "manifests" / "servedmodel-operator.clusterserviceversion.yaml"
CRD_FILE = ROOT / "crds" / "inference.servedmodel.io_servedmodels.yaml"
BASE = ROOT / "manifests" / "base"
SAMPLES = ROOT / "manifests" / "samples"

# OLM's descriptor vocabulary (operator-framework docs, "Descriptors"): every x-descriptor starts so.
KNOWN_DESCRIPTOR_PREFIXES = (
    "urn:alm:descriptor:com.tectonic.ui:",
    "urn:alm:descriptor:io.kubernetes:",
    "urn:alm:descriptor:io.kubernetes.phase",
    "urn:alm:descriptor:io.kubernetes.conditions",
    "urn:alm:descriptor:org.w3:link",
)
CSV_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\.v\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?$")


def load(path: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1, path
    obj: dict[str, Any] = docs[0]
    return obj


@pytest.fixture(scope="module")
def csv() -> dict[str, Any]:
    return load(CSV_FILE)


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    crd = load(CRD_FILE)
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def schema_at(schema: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    """The schema node of an OLM descriptor path (dots between fields, [N] or .N for array items)."""
    node: dict[str, Any] | None = schema
    for part in re.split(r"\.|\[", dotted.replace("]", "")):
        if node is None:
            return None
        if part.isdigit():
            node = node.get("items")
            continue
        node = node.get("properties", {}).get(part)
    return node


def test_bundle_is_generated_from_crd_base_and_samples() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "gen_bundle.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr + "\nrun `.venv/bin/python hack/gen_bundle.py` and commit"


def test_schema_at_follows_properties_and_items(crd_schema: dict[str, Any]) -> None:
    assert schema_at(crd_schema, "spec.model") is not None
    assert schema_at(crd_schema, "status.conditions[0].type") is not None
    assert schema_at(crd_schema, "spec.noSuchField") is None


def test_descriptor_paths_exist_in_the_crd(csv: dict[str, Any], crd_schema: dict[str, Any]) -> None:
    owned = csv["spec"]["customresourcedefinitions"]["owned"]
    assert len(owned) == 1
    missing = []
    for kind, root in (("specDescriptors", "spec"), ("statusDescriptors", "status")):
        for d in owned[0][kind]:
            if schema_at(crd_schema, f"{root}.{d['path']}") is None:
                missing.append(f"{root}.{d['path']}")
            assert d["x-descriptors"], d
            for xd in d["x-descriptors"]:
                assert xd.startswith(KNOWN_DESCRIPTOR_PREFIXES), xd
    assert not missing, f"descriptor paths not in the CRD schema: {missing}"


def test_console_shows_what_the_issue_asks_for(csv: dict[str, Any], crd_schema: dict[str, Any]) -> None:
    owned = csv["spec"]["customresourcedefinitions"]["owned"][0]
    spec = {d["path"]: d["x-descriptors"] for d in owned["specDescriptors"]}
    status = {d["path"]: d["x-descriptors"] for d in owned["statusDescriptors"]}
    assert "model" in spec
    assert "replicas" in spec
    assert "engine.kind" in spec
    assert "probe.enabled" in spec
    assert spec["replicas"] == ["urn:alm:descriptor:com.tectonic.ui:podCount"]
    assert status["endpoint"] == ["urn:alm:descriptor:org.w3:link"]
    assert status["phase"] == ["urn:alm:descriptor:io.kubernetes.phase"]
    assert status["conditions"] == ["urn:alm:descriptor:io.kubernetes.conditions"]
    for path in ("probe.client.ttftMs", "probe.client.tpotMs", "probe.scheduler.waiting", "ready"):
        assert path in status, path
    # A conditions descriptor must point at an array of metav1.Condition-shaped objects.
    cond = schema_at(crd_schema, "status.conditions")
    assert cond is not None
    assert cond["type"] == "array"
    assert {"type", "status", "reason", "lastTransitionTime"} <= set(cond["items"]["properties"])
    # The select options of engine.kind are exactly the CRD's enum.
    kinds = schema_at(crd_schema, "spec.engine.kind")
    assert kinds is not None
    options = sorted(x.rsplit(":", 1)[1] for x in spec["engine.kind"] if ":select:" in x)
    assert options == sorted(kinds["enum"])


def test_owned_crd_matches_the_crd(csv: dict[str, Any]) -> None:
    crd = load(CRD_FILE)
    owned = csv["spec"]["customresourcedefinitions"]["owned"][0]
    assert owned["name"] == crd["metadata"]["name"]
    assert owned["kind"] == crd["spec"]["names"]["kind"]
    assert owned["version"] in [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    # The bundle's CRD copy is the CRD (plus the base's part-of label).
    crd["metadata"].setdefault("labels", {})["app.kubernetes.io/part-of"] = "servedmodel"
    assert load(BUNDLE / "manifests" / CRD_FILE.name) == crd


def test_install_strategy_is_the_base(csv: dict[str, Any]) -> None:
    install = csv["spec"]["install"]
    assert install["strategy"] == "deployment"
    deployment = load(BASE / "deployment.yaml")
    [dep] = install["spec"]["deployments"]
    assert dep["name"] == deployment["metadata"]["name"]
    assert dep["spec"] == deployment["spec"]
    [perm] = install["spec"]["clusterPermissions"]
    assert perm["serviceAccountName"] == load(BASE / "service_account.yaml")["metadata"]["name"]
    assert perm["serviceAccountName"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert perm["rules"] == load(BASE / "cluster_role.yaml")["rules"]
    # Least privilege holds in the bundle too: no Secrets cluster-wide, no wildcards.
    for rule in perm["rules"]:
        assert "secrets" not in rule["resources"], rule
        assert "*" not in rule["verbs"], rule
        assert "*" not in rule["resources"], rule
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert csv["metadata"]["annotations"]["containerImage"] == image
    assert image in [r["image"] for r in csv["spec"]["relatedImages"]]


def test_metadata_and_install_modes(csv: dict[str, Any]) -> None:
    assert CSV_NAME.match(csv["metadata"]["name"]), csv["metadata"]["name"]
    assert csv["metadata"]["name"].endswith(f".v{csv['spec']['version']}")
    modes = {m["type"]: m["supported"] for m in csv["spec"]["installModes"]}
    assert set(modes) == {"OwnNamespace", "SingleNamespace", "MultiNamespace", "AllNamespaces"}
    assert modes["AllNamespaces"] is True
    assert csv["metadata"]["annotations"]["capabilities"] in (
        "Basic Install",
        "Seamless Upgrades",
        "Full Lifecycle",
        "Deep Insights",
        "Auto Pilot",
    )
    ann = load(BUNDLE / "metadata" / "annotations.yaml")["annotations"]
    assert ann["operators.operatorframework.io.bundle.mediatype.v1"] == "registry+v1"
    assert ann["operators.operatorframework.io.bundle.manifests.v1"] == "manifests/"
    assert ann["operators.operatorframework.io.bundle.metadata.v1"] == "metadata/"
    assert ann["operators.operatorframework.io.bundle.package.v1"] == csv["metadata"]["name"].split(".")[0]
    default = ann["operators.operatorframework.io.bundle.channel.default.v1"]
    assert default in ann["operators.operatorframework.io.bundle.channels.v1"].split(",")
    dockerfile = (BUNDLE / "bundle.Dockerfile").read_text()
    for key, value in ann.items():
        assert f"LABEL {key}={value}" in dockerfile


def test_alm_examples_are_the_samples_and_valid(csv: dict[str, Any]) -> None:
    examples = json.loads(csv["metadata"]["annotations"]["alm-examples"])
    samples = [
        d
        for p in sorted(SAMPLES.glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d and d.get("kind") == "ServedModel"
    ]
    assert len(samples) >= 5
    key = lambda o: o["metadata"]["name"]  # noqa: E731
    assert sorted(examples, key=key) == sorted(samples, key=key)
    for ex in examples:
        assert ex["apiVersion"] == "inference.servedmodel.io/v1alpha1"
        ServedModel.model_validate({**ex, "metadata": {**ex["metadata"], "namespace": "default"}})
    # The console's "Create" form starts from the first: the 7B Qwen on one GPU.
    assert examples[0]["spec"]["model"] == "Qwen/Qwen2.5-7B-Instruct"


def test_every_bundle_object_is_a_kind_olm_installs() -> None:
    supported = {
        "ClusterServiceVersion",
        "CustomResourceDefinition",
        "Service",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Secret",
        "ServiceAccount",
        "ServiceMonitor",
        "PrometheusRule",
        "PodDisruptionBudget",
        "PriorityClass",
        "VerticalPodAutoscaler",
        "ConsoleYAMLSample",
        "ConsoleQuickStart",
        "ConsoleCLIDownload",
        "ConsoleLink",
    }
    for path in sorted((BUNDLE / "manifests").glob("*.yaml")):
        obj = load(path)
        assert obj["kind"] in supported, f"{path.name}: OLM does not install a {obj['kind']}"
        assert "namespace" not in obj["metadata"] or obj["kind"] == "ClusterServiceVersion", path.name


def test_operator_verify_finds_no_error(operator_verify: Path) -> None:
    """operator-framework/api's bundle validators (CSV, CRD, bundle; plus OperatorHub and objects)."""
    res = subprocess.run(
        [str(operator_verify), "manifests", "--operatorhub_validate", "--object_validate", str(BUNDLE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = res.stdout + res.stderr
    assert res.returncode == 0, output
    errors = [line for line in output.splitlines() if "level=error" in line or "level=fatal" in line]
    assert not errors, "\n".join(errors)


def test_operator_verify_catches_a_broken_bundle(operator_verify: Path, tmp_path: Path) -> None:
    """The validator is really looking: an example of an unknown kind and no install mode are errors."""
    broken = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(BUNDLE), str(broken)], check=True, timeout=30)
    csv_path = broken / "manifests" / CSV_FILE.name
    text = csv_path.read_text().replace('"kind": "ServedModel"', '"kind": "ServedModelTypo"')
    csv_path.write_text(text.replace("supported: true", "supported: false"))
    res = subprocess.run(
        [str(operator_verify), "manifests", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = res.stdout + res.stderr
    assert "example must have a provided API" in output
    assert "none of InstallModeTypes are supported" in output

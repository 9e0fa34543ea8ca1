"""Every kustomization, sample and bundle object is accepted by a real API server.

`kubectl apply --server-side --dry-run=server` runs everything the server does short of storing:
schema and CEL validation, field validation (unknown fields are errors), admission (Pod Security
"restricted" included). The CRDs it needs besides ours are the upstream ones, from the Go module proxy
(hack/olm_tools.py): the Prometheus Operator's (ServiceMonitor, PrometheusRule) and OLM's
ClusterServiceVersion, so our CSV is checked against OLM's own schema.

This module runs its own control plane: installing monitoring and OLM CRDs and aggregated
ClusterRoles must not change what the other cluster tests see.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_support import own_control_plane

import controlplane
import olm_tools

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
KUSTOMIZATIONS = ["base", "overlays/kubernetes", "overlays/openshift", "monitoring"]
SAMPLES = sorted((MANIFESTS / "samples").glob("*.yaml"))
BUNDLE = MANIFESTS / "bundle" / "manifests"
CSV_FILE = BUNDLE / "servedmodel-operator.clusterserviceversion.yaml"
MONITORING_CRDS = ["servicemonitors", "podmonitors", "prometheusrules"]
# Namespaces that exist on the target clusters before anything of ours is applied.
PREEXISTING_NAMESPACES = ["servedmodel-system", "openshift-config-managed"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[controlplane.ControlPlane]:
    def fetch() -> list[Path]:
        crds = [olm_tools.olm_crd("clusterserviceversions")]
        crds += [olm_tools.prometheus_operator_crd(plural) for plural in MONITORING_CRDS]
        return [*crds, ROOT / "crds" / "inference.servedmodel.io_servedmodels.yaml"]

    with own_control_plane(fetch) as (cp, crds):
        args = [a for p in crds for a in ("-f", str(p))]
        cp.kubectl("apply", "--server-side", *args, timeout=120)
        for path in crds:
            cp.wait_established(yaml.safe_load(path.read_text())["metadata"]["name"])
        for ns in PREEXISTING_NAMESPACES:
            cp.kubectl("create", "namespace", ns)
        yield cp


def dry_run(
    cp: controlplane.ControlPlane, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(
        "apply", "--server-side", "--dry-run=server", *args, check=False, input=input, timeout=120
    )


def rendered(path: str) -> list[dict[str, Any]]:
    """What kustomize renders for a kustomization (the same kubectl, offline)."""
    res = subprocess.run(
        [str(controlplane.default_bin_dir() / "kubectl"), "kustomize", str(MANIFESTS / path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomization_applies(cluster: controlplane.ControlPlane, path: str) -> None:
    res = dry_run(cluster, "-k", str(MANIFESTS / path))
    assert res.returncode == 0, f"apply -k {path}:\n{res.stderr}"
    objects = rendered(path)
    assert len([line for line in res.stdout.splitlines() if "(server dry run)" in line]) == len(objects)


def test_openshift_overlay_puts_the_dashboard_where_the_console_reads_it() -> None:
    objects = rendered("overlays/openshift")
    [cm] = [o for o in objects if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["namespace"] == "openshift-config-managed"
    assert cm["metadata"]["labels"]["console.openshift.io/dashboard"] == "true"
    json.loads(cm["data"]["grafana-dashboard.json"])
    assert {o["kind"] for o in objects} >= {
        "ServiceMonitor",
        "PrometheusRule",
        "Deployment",
        "CustomResourceDefinition",
    }


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_applies(cluster: controlplane.ControlPlane, sample: Path, tmp_path: Path) -> None:
    """Each sample as users apply it: `-f`, and `-k` from a kustomization holding just that sample."""
    res = dry_run(cluster, "-n", "default", "-f", str(sample))
    assert res.returncode == 0, f"{sample.name}:\n{res.stderr}"
    assert "servedmodel.inference.servedmodel.io/" in res.stdout
    shutil.copy(sample, tmp_path / sample.name)
    kustomization = {"resources": [sample.name], "namespace": "default"}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    res = dry_run(cluster, "-k", str(tmp_path))
    assert res.returncode == 0, f"{sample.name} via -k:\n{res.stderr}"
    assert "servedmodel.inference.servedmodel.io/" in res.stdout


def test_operator_pod_passes_restricted_pod_security(cluster: controlplane.ControlPlane) -> None:
    """servedmodel-system enforces "restricted"; a Pod from the Deployment's template is admitted there."""
    [dep] = [o for o in rendered("base") if o["kind"] == "Deployment"]
    template = dep["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "psa-check",
            "namespace": "servedmodel-system",
            "labels": template["metadata"]["labels"],
        },
        "spec": {**template["spec"], "serviceAccountName": "default"},
    }
    cluster.kubectl(
        "label",
        "namespace",
        "servedmodel-system",
        "pod-security.kubernetes.io/enforce=restricted",
        "--overwrite",
    )
    res = dry_run(cluster, "-f", "-", input=json.dumps(pod))
    assert res.returncode == 0, res.stderr
    # The same check rejects a pod that is not restricted (so the label is really enforced).
    pod["spec"] = {**pod["spec"], "securityContext": {}}
    pod["spec"]["containers"] = [{**c, "securityContext": {}} for c in pod["spec"]["containers"]]
    res = dry_run(cluster, "-f", "-", input=json.dumps(pod))
    assert res.returncode != 0
    assert "violates PodSecurity" in res.stderr


def csv_without_namespace() -> dict[str, Any]:
    """The CSV as OLM sees it in a catalog; its placeholder namespace is replaced by the install's."""
    csv: dict[str, Any] = yaml.safe_load(CSV_FILE.read_text())
    csv["metadata"].pop("namespace", None)
    return csv


def test_csv_is_valid_against_olms_schema(cluster: controlplane.ControlPlane) -> None:
    res = dry_run(cluster, "-n", "default", "-f", "-", input=json.dumps(csv_without_namespace()))
    assert res.returncode == 0, res.stderr
    assert "clusterserviceversion.operators.coreos.com/servedmodel-operator.v" in res.stdout
    # OLM's schema is really enforced: a mistyped field and an unknown one are refused.
    csv = csv_without_namespace()
    csv["spec"]["installModes"][0]["supported"] = "yes"
    res = dry_run(cluster, "-n", "default", "-f", "-", input=json.dumps(csv))
    assert res.returncode != 0
    assert "installModes" in res.stderr
    csv = csv_without_namespace()
    csv["spec"]["customresourcedefinitions"]["owned"][0]["specDescriptor"] = []
    res = dry_run(cluster, "-n", "default", "-f", "-", input=json.dumps(csv))
    assert res.returncode != 0
    assert "specDescriptor" in res.stderr


def test_bundle_objects_apply(cluster: controlplane.ControlPlane) -> None:
    """What OLM creates from the bundle besides the CSV, in the operator's namespace."""
    files = sorted(p for p in BUNDLE.glob("*.yaml") if p != CSV_FILE)
    res = dry_run(cluster, "-n", "servedmodel-system", *[a for p in files for a in ("-f", str(p))])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("(server dry run)") == len(files)


def test_alm_examples_apply(cluster: controlplane.ControlPlane) -> None:
    csv = yaml.safe_load(CSV_FILE.read_text())
    examples = json.loads(csv["metadata"]["annotations"]["alm-examples"])
    items = {"apiVersion": "v1", "kind": "List", "items": examples}
    res = dry_run(cluster, "-n", "default", "-f", "-", input=json.dumps(items))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("(server dry run)") == len(examples)

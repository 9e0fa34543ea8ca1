"""The OLM bundle (manifests/bundle) installed by OLM itself: operator-registry's opm makes a file-based
catalog of it and serves it, OLM's catalog operator resolves a Subscription against that catalog and runs
the InstallPlan, OLM's olm operator runs the ClusterServiceVersion's install strategy. All three built from
the Go module proxy by hack/build-olm.sh (OLM_VERSION in hack/versions.env), run out of cluster by this test
on a control plane of the module's own (OLM creates cluster-wide objects and copies the CSV into every
namespace), each stopped by its pid (hack/olm_rig.py).

No bundle image: the catalog carries the manifests inline (hack/olm_rig.py says where OLM takes that
path), so nothing is unpacked by a Job. The operator's pod is kwok's (no process runs), which is what lets
the CSV reach Succeeded: OLM waits for its Deployment to be available.

Proven: the InstallPlan is Complete with no bundle lookup, every bundle object is a step OLM created, the
ServedModel CRD is served (a sample ServedModel is stored), the CSV is Succeeded, and the Deployment,
ServiceAccount and RBAC that exist are OLM's, made from our CSV. Bounded waits, no timing assertions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_support import own_control_plane, wait_for

import controlplane
import olm_rig
import olm_tools
from required import absent

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
BUNDLE_MANIFESTS = ROOT / "manifests" / "bundle" / "manifests"
CSV_FILE = BUNDLE_MANIFESTS / "servedmodel-operator.clusterserviceversion.yaml"
SAMPLE = ROOT / "manifests" / "samples" / "simulator.yaml"
CRD = "servedmodels.inference.servedmodel.io"
OLM_NAMESPACE = "olm"  # the operators' namespace and the global catalog namespace, as upstream deploys it
INSTALL_NAMESPACE = "servedmodel-system"
CATALOG = "servedmodel-catalog"
MONITORING_CRDS = ["servicemonitors", "prometheusrules"]  # kinds in the bundle OLM creates as they are
WAIT_S = 240.0


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


@pytest.fixture(scope="module")
def cluster() -> Iterator[controlplane.ControlPlane]:
    """A control plane of the module's own with OLM's CRDs and the Prometheus Operator's (the bundle's
    ServiceMonitor and PrometheusRule are created as they are); not the ServedModel CRD: OLM installs it."""
    if reason := olm_rig.missing():
        absent(reason)

    def fetch() -> list[Path]:
        return [*olm_rig.crd_files(), *(olm_tools.prometheus_operator_crd(p) for p in MONITORING_CRDS)]

    with own_control_plane(fetch) as (cp, crds):
        cp.kubectl("apply", "--server-side", *[a for p in crds for a in ("-f", str(p))], timeout=120)
        for path in crds:
            cp.wait_established(load(path)["metadata"]["name"])
        for ns in (OLM_NAMESPACE, INSTALL_NAMESPACE):
            cp.kubectl("create", "namespace", ns)
        yield cp


def get(cp: controlplane.ControlPlane, *what: str) -> dict[str, Any] | None:
    res = cp.kubectl("get", *what, "-o", "json", check=False)
    if res.returncode != 0:
        if "NotFound" in res.stderr:
            return None
        raise AssertionError(res.stderr)
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def test_olm_installs_the_bundle(cluster: controlplane.ControlPlane, tmp_path: Path) -> None:
    cp = cluster
    csv_file = load(CSV_FILE)
    csv_name = csv_file["metadata"]["name"]
    rendered = olm_rig.render_catalog(tmp_path / "catalog")
    assert rendered["name"] == csv_name
    assert not rendered.get("image"), "the catalog's bundle must carry its objects, not an image"
    assert get(cp, "crd", CRD) is None, "the ServedModel CRD must come from OLM's install, not be here before"

    with (
        olm_rig.OpmServe(tmp_path / "catalog") as opm,
        olm_rig.OlmOperator(cp, OLM_NAMESPACE) as olm,
        olm_rig.CatalogOperator(cp, OLM_NAMESPACE) as catalog,
    ):
        rig = (opm, olm, catalog)

        def logs() -> str:
            return "\n".join(f"--- {p.what} ---\n{p.log_text()[-4000:]}" for p in rig)

        def alive() -> None:
            for p in rig:
                p.alive()

        wait_for("opm serve listening", opm.ready, timeout=60, detail=logs)
        docs: list[dict[str, Any]] = [
            {
                "apiVersion": "operators.coreos.com/v1alpha1",
                "kind": "CatalogSource",
                "metadata": {"name": CATALOG, "namespace": OLM_NAMESPACE},
                "spec": {"sourceType": "grpc", "address": opm.address, "displayName": "ServedModel (test)"},
            },
            {
                "apiVersion": "operators.coreos.com/v1",
                "kind": "OperatorGroup",
                "metadata": {"name": "servedmodel", "namespace": INSTALL_NAMESPACE},
                "spec": {},  # no targetNamespaces: AllNamespaces, the one install mode the CSV supports
            },
            {
                "apiVersion": "operators.coreos.com/v1alpha1",
                "kind": "Subscription",
                "metadata": {"name": "servedmodel-operator", "namespace": INSTALL_NAMESPACE},
                "spec": {
                    "name": rendered["package"],
                    "channel": "alpha",
                    "source": CATALOG,
                    "sourceNamespace": OLM_NAMESPACE,
                    "installPlanApproval": "Automatic",
                },
            },
        ]
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

        def catalog_ready() -> str | None:
            alive()
            cs = get(cp, "catalogsource", "-n", OLM_NAMESPACE, CATALOG) or {}
            state = (cs.get("status") or {}).get("connectionState") or {}
            return "ok" if state.get("lastObservedState") == "READY" else None

        wait_for("the CatalogSource's connection READY", catalog_ready, timeout=WAIT_S, detail=logs)

        def install_plan() -> dict[str, Any] | None:
            alive()
            sub = get(cp, "subscription", "-n", INSTALL_NAMESPACE, "servedmodel-operator") or {}
            ref = (sub.get("status") or {}).get("installPlanRef")
            if not ref:
                return None
            plan = get(cp, "installplan", "-n", INSTALL_NAMESPACE, ref["name"])
            phase = ((plan or {}).get("status") or {}).get("phase")
            if phase == "Failed":
                pytest.fail(f"InstallPlan failed: {json.dumps(plan['status'], indent=1)}\n{logs()}")
            return plan if phase == "Complete" else None

        plan = wait_for("the InstallPlan Complete", install_plan, timeout=WAIT_S, detail=logs)
        status = plan["status"]
        assert not status.get("bundleLookups"), "OLM unpacked a bundle image instead of the inline objects"
        assert plan["spec"]["clusterServiceVersionNames"] == [csv_name]
        # Every object of the bundle is a step of this plan that OLM created (the Subscription's own step
        # aside); the secret is OLM's BundleSecret kind.
        steps = {
            (s["resource"]["kind"].replace("BundleSecret", "Secret"), s["resource"]["name"]): s["status"]
            for s in status["plan"]
        }
        bundle = {
            (d["kind"], d["metadata"]["name"])
            for d in (load(p) for p in sorted(BUNDLE_MANIFESTS.glob("*.yaml")))
        }
        assert bundle <= steps.keys(), f"bundle objects without a step: {bundle - steps.keys()}"
        not_created = {k: v for k, v in steps.items() if k in bundle and v not in ("Created", "Present")}
        assert not not_created, not_created

        # The CRD is OLM's and served: a sample ServedModel is stored and read back.
        cp.wait_established(CRD)
        crd = get(cp, "crd", CRD)
        assert crd is not None
        sample = load(SAMPLE)
        sample["metadata"]["namespace"] = INSTALL_NAMESPACE
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(sample))
        stored = get(cp, "servedmodel", "-n", INSTALL_NAMESPACE, sample["metadata"]["name"])
        assert stored is not None
        assert stored["spec"]["model"] == sample["spec"]["model"]

        # The install strategy: OLM made the Deployment from the CSV (owned by the CSV, its pod template
        # ours), the ServiceAccount and the cluster RBAC; the CSV reaches Succeeded once kwok's pod is
        # Ready and the Deployment available.
        def csv_succeeded() -> dict[str, Any] | None:
            alive()
            csv = get(cp, "csv", "-n", INSTALL_NAMESPACE, csv_name)
            phase = ((csv or {}).get("status") or {}).get("phase")
            return csv if phase == "Succeeded" else None

        csv = wait_for("the CSV Succeeded", csv_succeeded, timeout=WAIT_S, detail=logs)
        assert csv["status"]["reason"] == "InstallSucceeded"
        strategy = csv_file["spec"]["install"]["spec"]
        want = strategy["deployments"][0]
        deployment = get(cp, "deployment", "-n", INSTALL_NAMESPACE, want["name"])
        assert deployment is not None
        owners = {(o["kind"], o["name"]) for o in deployment["metadata"].get("ownerReferences") or []}
        assert ("ClusterServiceVersion", csv_name) in owners
        assert deployment["metadata"]["labels"].get("olm.owner") == csv_name
        containers = deployment["spec"]["template"]["spec"]["containers"]
        wanted = want["spec"]["template"]["spec"]["containers"]
        assert [(c["name"], c["image"]) for c in containers] == [(c["name"], c["image"]) for c in wanted]
        assert (deployment.get("status") or {}).get("availableReplicas", 0) >= 1
        account = strategy["clusterPermissions"][0]["serviceAccountName"]
        assert get(cp, "serviceaccount", "-n", INSTALL_NAMESPACE, account) is not None
        # A ClusterRole with the CSV's clusterPermissions rules, bound to that ServiceAccount, both OLM's.
        wanted_rules = strategy["clusterPermissions"][0]["rules"]
        roles = get(cp, "clusterrole", "-l", f"olm.owner={csv_name}") or {}
        role_names = {r["metadata"]["name"] for r in roles["items"] if r.get("rules") == wanted_rules}
        assert role_names, "no ClusterRole with the CSV's clusterPermissions rules"
        bindings = get(cp, "clusterrolebinding", "-l", f"olm.owner={csv_name}") or {}
        bound = {
            (b["roleRef"]["name"], s["kind"], s.get("namespace"), s["name"])
            for b in bindings["items"]
            for s in b.get("subjects") or []
        }
        assert any((r, "ServiceAccount", INSTALL_NAMESPACE, account) in bound for r in role_names), bound

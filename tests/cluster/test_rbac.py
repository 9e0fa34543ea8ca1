"""The operator's RBAC (manifests/base) is sufficient and no wider.

Sufficient: manifests/base is applied for real, and the operator runs as its ServiceAccount (a token
from the TokenRequest API, `kubectl create token`, in its own kubeconfig) through a whole life: the
simulator sample is created, reconciled to Ready (kwok makes the Deployment available), probed for real
(the probe goes to an engine simulator on loopback: kwok pods listen nowhere), and deleted. The
operator's log must hold no authorization error.

No wider: `kubectl auth can-i --as` the ServiceAccount is "no" for what it must never do.

This module runs its own control plane: base installs cluster-wide ClusterRoles (aggregated into
admin/edit/view) and the Prometheus Operator's CRDs, which must not change what other tests see.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cluster_support
import pytest
import yaml

import controlplane
import olm_tools
from servedmodel.access import ALLOW_ANNOTATION
from servedmodel.sim.process import SimulatorProcess

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "simulator.yaml"
OPERATOR_NS = "servedmodel-system"
SA = "servedmodel-operator"
SA_USER = f"system:serviceaccount:{OPERATOR_NS}:{SA}"
WAIT_S = 120.0
STOP_TIMEOUT_S = 15.0

# OpenShift serves Routes from its own API server; a bare one gets this stand-in CRD so the operator
# renders and applies a Route (with the verbs it has) as it would on OpenShift.
ROUTE_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "routes.route.openshift.io"},
    "spec": {
        "group": "route.openshift.io",
        "scope": "Namespaced",
        "names": {"plural": "routes", "singular": "route", "kind": "Route", "listKind": "RouteList"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[controlplane.ControlPlane]:
    def fetch() -> Path:
        return olm_tools.prometheus_operator_crd("servicemonitors")

    with cluster_support.own_control_plane(fetch) as (cp, servicemonitors):
        cp.kubectl(
            "apply", "--server-side", "-f", str(servicemonitors), "-f", "-", input=json.dumps(ROUTE_CRD)
        )
        cp.kubectl("apply", "--server-side", "-k", str(ROOT / "manifests" / "base"), timeout=120)
        # The admission policy that holds the operator's pods/status writes to its own engine pods.
        cp.kubectl("apply", "--server-side", "-k", str(ROOT / "manifests" / "policies"), timeout=60)
        for crd in (
            "servicemonitors.monitoring.coreos.com",
            "routes.route.openshift.io",
            "servedmodels.inference.servedmodel.io",
        ):
            cp.wait_established(crd)
        policy_in_force(cp)
        yield cp


def policy_in_force(cp: controlplane.ControlPlane) -> None:
    """Wait until the API server enforces the pods/status admission policy: it loads a new policy and its
    binding asynchronously, and a fresh-clone CI run had the test's first refused write let through."""
    namespace = "vap-probe"
    cp.kubectl("create", "namespace", namespace)
    _pod(cp, namespace, "not-ours", {"app": "probe"})
    gate = "inference.servedmodel.io/serving"
    cluster_support.wait_for(
        "the pods/status admission policy in force",
        lambda: _patch_status(cp, namespace, "not-ours", gate)[0] == 403 or None,
        60,
    )
    cp.kubectl("delete", "namespace", namespace, "--wait=false")


def sa_kubeconfig(cp: controlplane.ControlPlane, path: Path) -> Path:
    """A kubeconfig holding only the ServiceAccount's token (nothing of the admin's)."""
    token = cp.kubectl("create", "token", SA, "-n", OPERATOR_NS, "--duration=1h").stdout.strip()
    assert token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": cp.server, "certificate-authority": str(cp.ca_file)}}
        ],
        "users": [{"name": SA, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": SA}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def can_i(cp: controlplane.ControlPlane, *args: str) -> str:
    res = cp.kubectl("auth", "can-i", *args, "--as", SA_USER, check=False)
    return res.stdout.strip()


def wait_for(what: str, probe: Callable[[], Any], log: Callable[[], str]) -> Any:
    def detail() -> str:
        return f"operator log:\n{log()}"

    return cluster_support.wait_for(what, probe, WAIT_S, interval=0.5, detail=detail)


def get(cp: controlplane.ControlPlane, *args: str) -> dict[str, Any] | None:
    res = cp.kubectl("get", *args, "-o", "json", check=False)
    if res.returncode != 0:
        return None
    obj: dict[str, Any] = json.loads(res.stdout)
    return obj


@contextlib.contextmanager
def operator_as_service_account(
    kubeconfig: Path, log_path: Path, endpoint_override: str
) -> Iterator[Callable[[], str]]:
    """`servedmodel run --all-namespaces` (what the Deployment runs) with the SA's kubeconfig; yields a
    log reader; stopped by its pid (SIGTERM, then SIGKILL), pass or fail."""
    health_port, metrics_port = controlplane.free_ports(2)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SERVEDMODEL_")},
        "KUBECONFIG": str(kubeconfig),
        "SERVEDMODEL_HEALTH_PORT": str(health_port),
        "SERVEDMODEL_METRICS_PORT": str(metrics_port),
        "SERVEDMODEL_ENDPOINT_OVERRIDE": endpoint_override,
        "PYTHONUNBUFFERED": "1",
        # As the Deployment's downward API sets it: the Lease lives in the operator's namespace, where
        # manifests/base/leader_election_role.yaml grants it (and nowhere else).
        "POD_NAMESPACE": OPERATOR_NS,
    }
    # Nothing may fall back to in-cluster credentials or the admin's kubeconfig.
    env.pop("KUBERNETES_SERVICE_HOST", None)
    args = [sys.executable, "-m", "servedmodel.cli", "run", "--all-namespaces", "--bind-address", "127.0.0.1"]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def log() -> str:
        return log_path.read_text(errors="replace")

    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"operator exited with {proc.returncode}:\n{log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=2.0) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        wait_for("the operator's /healthz", healthy, log)
        yield log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)


def test_full_cycle_as_the_service_account(cluster: controlplane.ControlPlane, tmp_path: Path) -> None:
    cp = cluster
    namespace = "rbac-models"
    cp.kubectl("create", "namespace", namespace)
    sample = yaml.safe_load(SAMPLE.read_text())
    name = sample["metadata"]["name"]
    spec = sample["spec"]
    # Every child kind: the weight-cache PVC, the Route and the ServiceMonitor (both APIs exist here),
    # and the HPA of spec.autoscaling (read back for status.autoscaling; the Deployment's replicas
    # handed over, which reads the live Deployment).
    sample["spec"] = {
        **spec,
        "cache": {"size": "1Gi"},
        "expose": {"route": True},
        "monitoring": {"serviceMonitor": True},
        "autoscaling": {"maxReplicas": 2, "targets": {"waitingRequestsPerReplica": 4}},
        # The readiness gate: the probe's pods/status writes pass manifests/policies' admission policy.
        "probe": {**spec.get("probe", {}), "readinessGate": True},
    }
    sim_args = [spec["model"], "--max-model-len", str(spec["engine"]["maxModelLen"])]
    kubeconfig = sa_kubeconfig(cp, tmp_path / "sa.kubeconfig")
    with (
        SimulatorProcess([*sim_args, "--sim-step-base-ms", "2"], ready_timeout=60) as sim,
        operator_as_service_account(
            kubeconfig, tmp_path / "operator.log", f"{namespace}/{name}={sim.base_url}"
        ) as log,
    ):
        cp.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(sample))

        def ready_and_probed() -> dict[str, Any] | None:
            obj = get(cp, "servedmodel", name, "-n", namespace)
            status = (obj or {}).get("status") or {}
            probe = status.get("probe") or {}
            # A cycle whose stream the loaded machine read in one lump publishes no TTFT (report.py's
            # publishable_figures, by design); the next cycle, 10 s on, does.
            timed = (probe.get("client") or {}).get("ttftMs") is not None
            serving = status.get("phase") == "Ready" and probe.get("result") == "Success"
            return obj if serving and timed else None

        obj = wait_for("Ready and a successful probe with a TTFT", ready_and_probed, log)
        assert obj["status"]["probe"]["client"]["ttftMs"] > 0
        kinds = ("deployment", "service", "persistentvolumeclaim", "servicemonitor", "route", "hpa")
        for kind in kinds:
            child = get(cp, kind, "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
            assert child is not None, kind
            assert child["items"], f"no {kind} made by the operator"
        events = get(cp, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
        assert events is not None

        cp.kubectl("delete", "servedmodel", name, "-n", namespace, "--wait=false")
        wait_for(
            "the ServedModel to be gone", lambda: get(cp, "servedmodel", name, "-n", namespace) is None, log
        )
        text = log()
    # A 403 from the API server always says Forbidden (reason and message); kopf and the client log it.
    denied = [line for line in text.splitlines() if "forbidden" in line.lower()]
    assert not denied, "authorization errors in the operator's log:\n" + "\n".join(denied)


@pytest.mark.parametrize(
    "args",
    [
        ("get", "secrets", "--all-namespaces"),
        ("list", "secrets", "-n", "default"),
        ("get", "secrets", "-n", OPERATOR_NS),
        ("delete", "nodes"),
        ("create", "pods", "-n", "default"),
        ("create", "pods/exec", "-n", "default"),
        ("patch", "pods", "-n", "default"),  # only pods/status, for the readiness gate
        ("delete", "namespaces"),
        ("create", "clusterrolebindings"),
        ("escalate", "clusterroles"),
        ("update", "customresourcedefinitions"),
        ("create", "serviceaccounts/token", "-n", OPERATOR_NS),
        ("delete", "servedmodels.inference.servedmodel.io", "-n", "default"),
        ("patch", "servedmodels.inference.servedmodel.io", "-n", "default"),  # only their status
        ("update", "leases.coordination.k8s.io", "-n", "default"),  # Leases: its own namespace only
        ("create", "servedmodels.inference.servedmodel.io", "-n", "default"),
        ("update", "deployments.apps", "-n", "default"),
        ("create", "daemonsets.apps", "-n", "kube-system"),
        ("create", "roles.rbac.authorization.k8s.io", "-n", "default"),
        # chat template ConfigMaps are read, never written
        ("create", "configmaps", "-n", "default"),
        ("patch", "configmaps", "-n", "default"),
        ("delete", "configmaps", "-n", "default"),
        ("watch", "endpointslices.discovery.k8s.io", "--all-namespaces"),  # nothing reads them
        ("get", "/metrics"),  # its own /metrics is for Prometheus (servedmodel-metrics-reader)
        ("create", "localsubjectaccessreviews.authorization.k8s.io", "-n", "default"),
    ],
    ids=lambda a: " ".join(a),
)
def test_what_the_operator_must_not_do(cluster: controlplane.ControlPlane, args: tuple[str, ...]) -> None:
    assert can_i(cluster, *args) == "no"


@pytest.mark.parametrize(
    "args",
    [
        ("watch", "servedmodels.inference.servedmodel.io", "--all-namespaces"),
        # The subresource (a "/status" suffix would name an object called status).
        ("patch", "servedmodels.inference.servedmodel.io", "--subresource=status", "-n", "default"),
        ("patch", "deployments.apps", "-n", "default"),
        ("list", "pods", "--all-namespaces"),
        ("patch", "pods", "--subresource=status", "-n", "default"),  # the probe's readiness gate
        # The control loop's cache: one watch per child kind.
        ("watch", "deployments.apps", "--all-namespaces"),
        ("watch", "services", "--all-namespaces"),
        ("watch", "persistentvolumeclaims", "--all-namespaces"),
        ("watch", "pods", "--all-namespaces"),
        # Leader election: its Lease, in the operator's namespace only (a Role).
        ("update", "leases.coordination.k8s.io", "-n", OPERATOR_NS),
        ("create", "events", "-n", "default"),
        ("watch", "configmaps", "--all-namespaces"),  # chat templates (label-filtered watch)
        ("get", "configmaps", "-n", "default"),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
        ("patch", "horizontalpodautoscalers.autoscaling", "-n", "default"),
        ("get", "horizontalpodautoscalers.autoscaling", "-n", "default"),
        ("delete", "horizontalpodautoscalers.autoscaling", "-n", "default"),
        # /metrics behind TokenReview + SubjectAccessReview (handlers/metrics.py).
        ("create", "tokenreviews.authentication.k8s.io"),
        ("create", "subjectaccessreviews.authorization.k8s.io"),
    ],
    ids=lambda a: " ".join(a),
)
def test_what_the_operator_needs(cluster: controlplane.ControlPlane, args: tuple[str, ...]) -> None:
    assert can_i(cluster, *args) == "yes"


@pytest.mark.parametrize("resource", ["scaledobjects", "triggerauthentications"])
def test_keda_objects_are_granted_without_keda_installed(
    cluster: controlplane.ControlPlane, resource: str
) -> None:
    """A SubjectAccessReview, as `kubectl auth can-i` cannot name a group the API server does not serve."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": SA_USER,
            "resourceAttributes": {
                "group": "keda.sh",
                "resource": resource,
                "verb": "patch",
                "namespace": "default",
            },
        },
    }
    out = cluster.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    assert out["status"]["allowed"] is True, out["status"]


def test_secrets_are_granted_per_namespace(cluster: controlplane.ControlPlane) -> None:
    """The documented RoleBinding to servedmodel-operator-secret-reader opens one namespace, no more."""
    cp = cluster
    cp.kubectl("create", "namespace", "team-a")
    cp.kubectl("create", "namespace", "team-b")
    cp.kubectl(
        "create",
        "rolebinding",
        "servedmodel-operator-secrets",
        "-n",
        "team-a",
        "--clusterrole=servedmodel-operator-secret-reader",
        f"--serviceaccount={OPERATOR_NS}:{SA}",
    )
    assert can_i(cp, "get", "secrets", "-n", "team-a") == "yes"
    assert can_i(cp, "list", "secrets", "-n", "team-a") == "no"
    assert can_i(cp, "get", "secrets", "-n", "team-b") == "no"
    assert can_i(cp, "get", "secrets", "--all-namespaces") == "no"


def test_people_get_servedmodels_through_the_built_in_roles(cluster: controlplane.ControlPlane) -> None:
    """servedmodel-edit/view are aggregated into admin, edit and view."""
    cp = cluster
    cp.kubectl("create", "namespace", "team-c")
    cp.kubectl("create", "rolebinding", "alice-edit", "-n", "team-c", "--clusterrole=edit", "--user=alice")
    cp.kubectl("create", "rolebinding", "bob-view", "-n", "team-c", "--clusterrole=view", "--user=bob")

    def as_user(user: str, *args: str) -> str:
        return cp.kubectl("auth", "can-i", *args, "-n", "team-c", "--as", user, check=False).stdout.strip()

    sm = "servedmodels.inference.servedmodel.io"
    assert as_user("alice", "create", sm) == "yes"
    assert as_user("alice", "delete", sm) == "yes"
    assert as_user("bob", "get", sm) == "yes"
    assert as_user("bob", "create", sm) == "no"
    assert as_user("bob", "patch", f"{sm}/status") == "no"


def test_api_key_secret_is_read_only_where_granted(
    cluster: controlplane.ControlPlane, tmp_path: Path
) -> None:
    """The probe needs the engine's API key from a Secret in the model's namespace: refused (and said so
    in status) until the namespace's owner binds servedmodel-operator-secret-reader there; then it works.
    The key never shows in status or the log."""
    cp = cluster
    namespace = "keyed"
    api_key = "sk-" + os.urandom(12).hex()
    cp.kubectl("create", "namespace", namespace)
    cp.kubectl("create", "secret", "generic", "engine-key", "-n", namespace, f"--from-literal=key={api_key}")
    # The Secret's owner allows this ServedModel (servedmodel.access); the RBAC grant is the other half.
    cp.kubectl("annotate", "secret", "engine-key", "-n", namespace, f"{ALLOW_ANNOTATION}=qwen-keyed")
    sample = yaml.safe_load(SAMPLE.read_text())
    name = "qwen-keyed"
    spec = sample["spec"]
    sample["metadata"]["name"] = name
    sample["spec"] = {
        **spec,
        "engine": {**spec["engine"], "apiKeySecretRef": {"name": "engine-key", "key": "key"}},
        "probe": {**spec.get("probe", {}), "interval": 5},
    }
    sim_args = [spec["model"], "--max-model-len", str(spec["engine"]["maxModelLen"]), "--api-key", api_key]
    kubeconfig = sa_kubeconfig(cp, tmp_path / "sa.kubeconfig")
    with SimulatorProcess([*sim_args, "--sim-step-base-ms", "2"], ready_timeout=60) as sim:
        with operator_as_service_account(
            kubeconfig, tmp_path / "operator.log", f"{namespace}/{name}={sim.base_url}"
        ) as log:
            cp.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(sample))

            def probe_status() -> dict[str, Any]:
                obj = get(cp, "servedmodel", name, "-n", namespace) or {}
                probe: dict[str, Any] = (obj.get("status") or {}).get("probe") or {}
                return probe

            refused = wait_for(
                "the probe to report the Secret refused",
                lambda: probe_status() if probe_status().get("reason") == "SecretUnavailable" else None,
                log,
            )
            assert "403" in refused["message"]
            cp.kubectl(
                "create",
                "rolebinding",
                "servedmodel-operator-secrets",
                "-n",
                namespace,
                "--clusterrole=servedmodel-operator-secret-reader",
                f"--serviceaccount={OPERATOR_NS}:{SA}",
            )
            wait_for(
                "a successful probe with the key", lambda: probe_status().get("result") == "Success", log
            )
            text = log()
        obj = get(cp, "servedmodel", name, "-n", namespace)
    assert api_key not in json.dumps(obj)
    assert api_key not in text


# `kubectl auth can-i --list` as the operator's ServiceAccount: every rule it holds cluster-wide, one
# line each (resources, non-resource URLs, verbs), minus what every authenticated user holds anyway
# (system:basic-user, system:discovery, system:public-info-viewer: self reviews, /api, /healthz, …).
EXPECTED_RIGHTS = {
    ("customresourcedefinitions.apiextensions.k8s.io", "[list watch]"),
    ("servedmodels.inference.servedmodel.io", "[get list watch]"),
    ("servedmodels.inference.servedmodel.io/status", "[patch]"),
    ("servedmodels.inference.servedmodel.io/finalizers", "[update]"),
    ("deployments.apps", "[get list watch create patch delete]"),
    ("replicasets.apps", "[list]"),
    ("services", "[get list watch create patch delete]"),
    ("persistentvolumeclaims", "[list watch create patch delete]"),
    ("pods", "[list watch]"),
    ("pods/status", "[patch]"),
    ("configmaps", "[get list watch]"),
    ("events", "[create list watch]"),
    ("routes.route.openshift.io", "[get list create patch delete]"),
    ("routes.route.openshift.io/custom-host", "[create]"),
    ("servicemonitors.monitoring.coreos.com", "[list create patch delete]"),
    ("horizontalpodautoscalers.autoscaling", "[get list watch create patch delete]"),
    ("scaledobjects.keda.sh", "[list watch create patch delete]"),
    ("triggerauthentications.keda.sh", "[list watch create patch delete]"),
    ("httpscaledobjects.http.keda.sh", "[list create patch delete]"),
    ("inferencepools.inference.networking.k8s.io", "[list create patch delete]"),
    ("inferenceobjectives.inference.networking.x-k8s.io", "[list create patch delete]"),
    ("leaderworkersets.leaderworkerset.x-k8s.io", "[get list create patch delete]"),
    ("tokenreviews.authentication.k8s.io", "[create]"),
    ("subjectaccessreviews.authorization.k8s.io", "[create]"),
}
EVERYONES = {"selfsubjectreviews.authentication.k8s.io", "selfsubjectaccessreviews.authorization.k8s.io",
             "selfsubjectrulesreviews.authorization.k8s.io"}  # fmt: skip


def rights(cp: controlplane.ControlPlane, *args: str) -> set[tuple[str, str]]:
    """(resource, or [non-resource URL], verbs) from `kubectl auth can-i --list --as` the ServiceAccount;
    a rule limited to resourceNames keeps them in the name (resource[names])."""
    out = cp.kubectl("auth", "can-i", "--list", "--as", SA_USER, *args).stdout
    found = set()
    for line in out.splitlines()[1:]:  # Resources  Non-Resource URLs  Resource Names  Verbs
        groups = re.findall(r"\[[^\]]*\]", line)
        if len(groups) < 3:
            continue
        names, verbs = groups[-2], groups[-1]
        name = groups[0] if line.startswith(" ") else line.split()[0]
        found.add((name + (names if names != "[]" else ""), verbs))
    return found


def test_the_operators_effective_rights(cluster: controlplane.ControlPlane) -> None:
    """What `kubectl auth can-i --list` shows for the operator, cluster-wide and in a model namespace:
    exactly its ClusterRole (no Secret anywhere, no resourceNames), printed for the record."""
    out = cluster.kubectl("auth", "can-i", "--list", "--as", SA_USER).stdout
    print(out)
    found = {r for r in rights(cluster) if r[0] not in EVERYONES and not r[0].startswith("[")}
    assert found == EXPECTED_RIGHTS
    assert not any("secrets" in r[0] for r in rights(cluster, "-n", "default"))
    # Non-resource URLs: only what every authenticated user may get (/api, /healthz, …), not /metrics.
    urls = {r[0] for r in rights(cluster) if r[0].startswith("[")}
    assert "[/metrics]" not in urls


def _pod(cp: controlplane.ControlPlane, namespace: str, name: str, labels: dict[str, str]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "containers": [{"name": "c", "image": "example.com/none:1"}],
            "readinessGates": [{"conditionType": "inference.servedmodel.io/serving"}],
        },
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(pod))


def _patch_status(cp: controlplane.ControlPlane, namespace: str, pod: str, condition: str) -> tuple[int, str]:
    """PATCH pods/status as the operator's ServiceAccount (its own token: kubectl would GET first, which
    the operator may not), one condition by strategic merge; (HTTP status, body)."""
    token = cp.kubectl("create", "token", SA, "-n", OPERATOR_NS, "--duration=10m").stdout.strip()
    body = {"status": {"conditions": [{"type": condition, "status": "True", "reason": "Test"}]}}
    req = urllib.request.Request(
        f"{cp.server}/api/v1/namespaces/{namespace}/pods/{pod}/status",
        data=json.dumps(body).encode(),
        method="PATCH",
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/strategic-merge-patch+json",
        },
    )
    context = ssl.create_default_context(cafile=str(cp.ca_file))
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def test_pod_status_writes_are_held_to_the_operators_own_pods_and_condition(
    cluster: controlplane.ControlPlane,
) -> None:
    """RBAC grants patch on every pods/status; the ValidatingAdmissionPolicy (manifests/policies) lets
    the operator's ServiceAccount write only its own condition of pods labelled managed-by it."""
    cp = cluster
    namespace = "vap"
    cp.kubectl("create", "namespace", namespace)
    _pod(cp, namespace, "engine", {"app.kubernetes.io/managed-by": "servedmodel-operator"})
    _pod(cp, namespace, "someone-elses", {"app": "db"})
    gate = "inference.servedmodel.io/serving"
    code, body = _patch_status(cp, namespace, "engine", gate)
    assert code == 200, body
    code, body = _patch_status(cp, namespace, "someone-elses", gate)
    assert code == 403, body
    assert "servedmodel-operator-pod-status" in body
    assert "only of its own engine pods" in body
    code, body = _patch_status(cp, namespace, "engine", "Ready")
    assert code == 403, body
    assert "only its own pod condition" in body
    # Nobody else is held by it: the admin writes any pod's status.
    body = {"status": {"conditions": [{"type": gate, "status": "False", "reason": "Admin"}]}}
    cp.kubectl(
        "patch", "pod", "someone-elses", "-n", namespace, "--subresource=status", "--type=strategic",
        "-p", json.dumps(body),
    )  # fmt: skip

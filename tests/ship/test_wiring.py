"""The base's pieces point at each other: Service → pods, ServiceMonitor → Service, probes and env →
container ports, the alert's job → the Service, ServiceAccount → bindings. A typo here fails no schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from servedmodel.config import OPERATOR_IMAGE, OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "manifests" / "base"
MONITORING = ROOT / "manifests" / "monitoring"


def load(path: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(path.read_text())
    return obj


def container() -> dict[str, Any]:
    [c] = load(BASE / "deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return c


def test_service_selects_the_operator_pod_and_port() -> None:
    dep = load(BASE / "deployment.yaml")
    svc = load(BASE / "service.yaml")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port_names = {p["name"]: p["containerPort"] for p in container()["ports"]}
    [port] = svc["spec"]["ports"]
    assert port["targetPort"] in port_names


def test_ports_match_the_operators_settings() -> None:
    c = container()
    env = {e["name"]: e.get("value") for e in c["env"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    defaults = OperatorConfig()
    assert int(env["SERVEDMODEL_METRICS_PORT"]) == ports["metrics"] == defaults.metrics_port
    assert int(env["SERVEDMODEL_HEALTH_PORT"]) == ports["health"] == defaults.health_port
    # handlers/health.py: /healthz (the loop answers) for liveness, /readyz (caches synced) for readiness.
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert c["image"] == OPERATOR_IMAGE


def test_two_replicas_one_leader() -> None:
    """Leader election needs its Lease Role in the operator's namespace, the pod's name as the holder
    identity, and a rollout that never takes both replicas away."""
    dep = load(BASE / "deployment.yaml")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container()["env"]}
    assert env["POD_NAME"] == "metadata.name"
    assert env["POD_NAMESPACE"] == "metadata.namespace"
    role, binding = yaml.safe_load_all((BASE / "leader_election_role.yaml").read_text())
    assert role["kind"] == "Role"
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "list", "create", "update", "delete"],
        }
    ]
    assert binding["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    pdb = load(BASE / "pod_disruption_budget.yaml")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_restricted_security_context() -> None:
    pod = load(BASE / "deployment.yaml")["spec"]["template"]["spec"]
    c = container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # OpenShift assigns the UID: a fixed one would be refused by restricted-v2.
    assert "runAsUser" not in pod["securityContext"]
    assert "runAsUser" not in c["securityContext"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"].keys() == {"cpu", "memory"}


def test_service_monitor_and_alert_find_the_service() -> None:
    svc = load(BASE / "service.yaml")
    sm = load(MONITORING / "operator_service_monitor.yaml")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    rule = (MONITORING / "prometheus_rule.yaml").read_text()
    # Prometheus Operator's job label is the Service's name.
    assert f'up{{job="{svc["metadata"]["name"]}"}}' in rule


def test_bindings_name_the_service_account_the_pod_uses() -> None:
    sa = load(BASE / "service_account.yaml")["metadata"]["name"]
    pod = load(BASE / "deployment.yaml")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa
    binding = load(BASE / "cluster_role_binding.yaml")
    assert binding["roleRef"]["name"] == load(BASE / "cluster_role.yaml")["metadata"]["name"]
    [subject] = binding["subjects"]
    ns = load(BASE / "namespace.yaml")["metadata"]["name"]
    assert (subject["kind"], subject["name"], subject["namespace"]) == ("ServiceAccount", sa, ns)
    assert load(BASE / "kustomization.yaml")["namespace"] == ns

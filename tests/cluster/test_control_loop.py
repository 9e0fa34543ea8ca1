"""The control loop's behaviour against the real API server: a persistent server error on apply
(Degraded/ApplyFailed, an Event, backoff instead of a hot loop), and
deletion without waiting on the operator. Counted, never timed.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from cluster_support import apply, condition, metric_sum, served_model, wait_for

import controlplane

# The `operator` fixture's OperatorProcess (tests/cluster/conftest.py; conftests are not importable).
OperatorProcess = Any

pytestmark = pytest.mark.cluster


def sm(cp: controlplane.ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    res = cp.kubectl("get", "sm", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def model(name: str, **spec: Any) -> dict[str, Any]:
    return served_model(name, **{"probe": {"enabled": False}, **spec})


def failing_webhook(namespace: str) -> dict[str, Any]:
    """Services of `namespace` go through a webhook nothing answers: the API server says 500."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"refuse-services-{namespace}"},
        "webhooks": [
            {
                "name": "refuse.services.example.com",
                "clientConfig": {"url": "https://127.0.0.1:9/validate"},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["services"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }
        ],
    }


def test_persistent_server_error_is_degraded_apply_failed_with_backoff(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    webhook = failing_webhook(namespace)
    apply(cp, "default", webhook)
    try:
        apply(cp, namespace, model("broken"))

        def apply_failed() -> Any:
            obj = sm(cp, namespace, "broken")
            return obj if condition(obj, "Degraded").get("reason") == "ApplyFailed" else None

        obj = wait_for("Degraded ApplyFailed", apply_failed, detail=lambda: operator.log(30))
        message = condition(obj, "Degraded")["message"]
        assert message.startswith("Service/broken-engine: 500 ")
        assert "failed calling webhook" in message
        assert obj["status"]["phase"] == "Degraded"
        events = json.loads(
            cp.kubectl(
                "get",
                "events",
                "-n",
                namespace,
                "--field-selector",
                "involvedObject.name=broken",
                "-o",
                "json",
            ).stdout
        )["items"]
        assert any(e["type"] == "Warning" and "ApplyFailed" in e["message"] for e in events), events

        # Backoff, not a hot loop: count the failed passes over a while (each retry waits twice as long).
        failures = metric_sum(operator, "servedmodel_controller_failures_total")
        time.sleep(10.0)
        more = metric_sum(operator, "servedmodel_controller_failures_total") - failures
        assert more <= 6, f"{more} failed passes in 10 s: not backing off"
        assert "[" + namespace + "/broken] reconcile failed" in operator.log()
    finally:
        cp.kubectl("delete", "validatingwebhookconfiguration", webhook["metadata"]["name"], check=False)

    # The error goes away: the next retry applies and the model becomes Ready.
    wait_for(
        "phase Ready after the webhook is gone",
        lambda: (sm(cp, namespace, "broken") or {}).get("status", {}).get("phase") == "Ready",
        timeout=400,
    )


def test_deletion_writes_nothing_and_waits_on_nothing(
    control_plane: controlplane.ControlPlane, namespace: str, operator: OperatorProcess
) -> None:
    cp = control_plane
    for i in range(5):
        apply(cp, namespace, model(f"d{i}"))
    wait_for(
        "five Ready",
        lambda: all(
            (sm(cp, namespace, f"d{i}") or {}).get("status", {}).get("phase") == "Ready" for i in range(5)
        ),
    )
    writes = metric_sum(operator, "servedmodel_status_writes_total")
    cp.kubectl("delete", "sm", "--all", "-n", namespace, "--wait=true", "--timeout=60s")
    assert all(sm(cp, namespace, f"d{i}") is None for i in range(5))
    time.sleep(2.0)
    assert metric_sum(operator, "servedmodel_status_writes_total") == writes
    log = operator.log()
    assert "cancelled" not in log
    assert "Traceback" not in log

"""The security model on the real control plane (docs/operations.md, "Security model"): what a namespace
user bound only to servedmodel-edit can make the operator do, and who can read its /metrics.

- A Secret without its owner's opt-in (annotation inference.servedmodel.io/allowed-servedmodels) is never
  sent: a loopback listener standing in for the user's "engine" receives no request carrying it, and the
  Serving condition names the Secret (SecretNotAllowed).
- An endpoint outside the operator's allow-list is never contacted (TargetNotAllowed); an endpoint with
  a path or query of the user's choosing does not pass the API server (the CRD's pattern).
- An engine that echoes the API key back gets it into no status, Event or operator log line.
- /metrics: 401 without a token or with a forged one, 403 for a ServiceAccount without the right, 200 for
  one bound to servedmodel-metrics-reader (the TokenReview and SubjectAccessReview are the API server's).
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_support import condition, get, served_model, wait_for

import controlplane
from servedmodel.access import ALLOW_ANNOTATION, SECRET_NOT_ALLOWED, TARGET_NOT_ALLOWED
from servedmodel.api import names

OperatorProcess = Any  # tests/cluster/conftest.py's (conftests are not importable)

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "manifests" / "base"
TENANT = "tenant-bob"
PASSWORD = "db-pass-7c41d09e2b"  # a test value
DEFAULT_TARGETS = "*.svc,*.svc.cluster.local"  # the operator's default allow-list


class Listener:
    """A loopback HTTP server that records each request's path and Authorization header and answers
    /health 200, everything else 401 with the Authorization header echoed in vLLM's error shape."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                auth = self.headers.get("Authorization") or ""
                outer.requests.append((self.path, auth))
                status, body = (200, b"") if self.path == "/health" else (401, b"")
                if status == 401:
                    body = json.dumps({"error": {"message": f"invalid API key: {auth}"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def carrying(self, value: str) -> list[tuple[str, str]]:
        return [r for r in self.requests if value in r[1]]


@pytest.fixture
def listener() -> Iterator[Listener]:
    lis = Listener()
    try:
        yield lis
    finally:
        lis.close()


@pytest.fixture
def tenant(control_plane: controlplane.ControlPlane, namespace: str) -> Callable[..., Any]:
    """`tenant("apply", ...)`: kubectl as a user bound only to servedmodel-edit in the test's namespace
    (who cannot read the namespace's Secrets themself)."""
    cp = control_plane
    cp.kubectl("apply", "--server-side", "-f", str(BASE / "user_cluster_roles.yaml"))
    cp.kubectl(
        "create", "rolebinding", "bob-servedmodels", "-n", namespace, "--clusterrole=servedmodel-edit",
        f"--user={TENANT}",
    )  # fmt: skip
    assert can(cp, namespace, "create", "servedmodels.inference.servedmodel.io") == "yes"
    assert can(cp, namespace, "get", "secrets") == "no"
    assert can(cp, namespace, "create", "pods") == "no"

    def as_tenant(*args: str, **kw: Any) -> Any:
        return cp.kubectl(*args, "--as", TENANT, **kw)

    return as_tenant


def can(cp: controlplane.ControlPlane, namespace: str, *args: str) -> str:
    res = cp.kubectl("auth", "can-i", *args, "-n", namespace, "--as", TENANT, check=False)
    return str(res.stdout.strip())


def db_credentials(cp: controlplane.ControlPlane, namespace: str, allowed: str | None = None) -> None:
    """The namespace's unrelated Secret (created by its owner, not the tenant)."""
    cp.kubectl(
        "create",
        "secret",
        "generic",
        "db-credentials",
        "-n",
        namespace,
        f"--from-literal=password={PASSWORD}",
    )
    if allowed is not None:
        cp.kubectl("annotate", "secret", "db-credentials", "-n", namespace, f"{ALLOW_ANNOTATION}={allowed}")


def external(name: str, url: str, **spec: Any) -> dict[str, Any]:
    manifest = served_model(name, endpoint=url, servedModelName="qwen", probe={"interval": 5}, **spec)
    del manifest["spec"]["resources"]
    manifest["spec"].setdefault("engine", {}).pop("maxModelLen", None)
    return manifest


def tenant_apply(as_tenant: Callable[..., Any], namespace: str, manifest: dict[str, Any]) -> Any:
    return as_tenant("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)


def serving_reason(cp: controlplane.ControlPlane, namespace: str, name: str, reason: str) -> Any:
    def probe() -> dict[str, Any] | None:
        cond = condition(get(cp, namespace, "servedmodel", name), "Serving")
        return cond if cond.get("reason") == reason else None

    return probe


def no_override(namespace: str) -> str:
    """An override for another ServedModel only: this test's models go to their spec.endpoint."""
    return f"{namespace}/not-this-one=http://127.0.0.1:9"


def events(cp: controlplane.ControlPlane, namespace: str) -> str:
    return str(cp.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)


def test_a_tenant_cannot_make_the_operator_send_a_secret_without_its_owners_opt_in(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    tenant: Callable[..., Any],
    listener: Listener,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    cp = control_plane
    db_credentials(cp, namespace)
    op = start_operator(namespaces=[namespace], endpoint_override=no_override(namespace))
    key_ref = {"apiKeySecretRef": {"name": "db-credentials", "key": "password"}}
    res = tenant_apply(tenant, namespace, external("exfil", listener.url, engine=key_ref))
    assert res.returncode == 0, res.stderr
    cond = wait_for(
        "Serving=False SecretNotAllowed", serving_reason(cp, namespace, "exfil", SECRET_NOT_ALLOWED)
    )
    assert cond["status"] == "False"
    assert "Secret db-credentials" in cond["message"]
    assert ALLOW_ANNOTATION in cond["message"]
    assert listener.carrying(PASSWORD) == []
    assert listener.requests == []  # refused before the first request
    obj = get(cp, namespace, "servedmodel", "exfil")
    assert PASSWORD not in json.dumps(obj)
    assert PASSWORD not in events(cp, namespace)
    assert PASSWORD not in op.log()


def test_an_endpoint_outside_the_allow_list_is_refused_and_a_path_never_passes_the_api_server(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    tenant: Callable[..., Any],
    listener: Listener,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    cp = control_plane
    # The operator's default allow-list (in-cluster Service names): loopback is the operator's own pod.
    start_operator(
        namespaces=[namespace],
        endpoint_override=no_override(namespace),
        env={"SERVEDMODEL_ALLOWED_TARGETS": DEFAULT_TARGETS},
    )
    res = tenant_apply(tenant, namespace, external("reach", listener.url))
    assert res.returncode == 0, res.stderr
    cond = wait_for(
        "Serving=False TargetNotAllowed", serving_reason(cp, namespace, "reach", TARGET_NOT_ALLOWED)
    )
    assert cond["message"].startswith(f"spec.endpoint {listener.url}: host 127.0.0.1 is not in")
    assert listener.requests == []
    res = tenant_apply(tenant, namespace, external("collect", f"{listener.url}/collect?from=tenant"))
    assert res.returncode != 0
    assert "spec.endpoint" in res.stderr
    assert listener.requests == []


def test_an_echoing_engine_never_gets_the_key_into_status_events_or_the_log(
    control_plane: controlplane.ControlPlane,
    namespace: str,
    tenant: Callable[..., Any],
    listener: Listener,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    cp = control_plane
    db_credentials(cp, namespace, allowed="echo")  # the owner allows this one ServedModel
    op = start_operator(namespaces=[namespace], endpoint_override=no_override(namespace))
    key_ref = {"apiKeySecretRef": {"name": "db-credentials", "key": "password"}}
    res = tenant_apply(tenant, namespace, external("echo", listener.url, engine=key_ref))
    assert res.returncode == 0, res.stderr
    cond = wait_for("Serving=False Unauthorized", serving_reason(cp, namespace, "echo", "Unauthorized"))
    assert listener.carrying(PASSWORD), "the allowed key is sent to the allowed endpoint"
    assert "401" in cond["message"]
    obj = get(cp, namespace, "servedmodel", "echo")
    assert PASSWORD not in json.dumps(obj)
    assert PASSWORD not in events(cp, namespace)
    assert PASSWORD not in op.log()


def fetch(port: int, token: str | None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_metrics_need_a_token_that_may_get_metrics(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    cp = control_plane
    cp.kubectl("apply", "--server-side", "-f", str(BASE / "metrics_reader_cluster_role.yaml"))
    for sa in ("scraper", "nosy"):
        cp.kubectl("create", "serviceaccount", sa, "-n", namespace)
    cp.kubectl(
        "create", "clusterrolebinding", f"{namespace}-scraper", "--clusterrole=servedmodel-metrics-reader",
        f"--serviceaccount={namespace}:scraper",
    )  # fmt: skip
    try:
        scraper = cp.kubectl("create", "token", "scraper", "-n", namespace).stdout.strip()
        nosy = cp.kubectl("create", "token", "nosy", "-n", namespace).stdout.strip()
        op = start_operator(namespaces=[namespace], env={"SERVEDMODEL_METRICS_AUTH": "true"})
        assert fetch(op.metrics_port, None) == 401
        assert fetch(op.metrics_port, "forged-" + nosy[-12:]) == 401
        assert fetch(op.metrics_port, nosy) == 403
        assert fetch(op.metrics_port, scraper) == 200
        assert fetch(op.metrics_port, cp.token) == 200  # system:masters
        assert fetch(op.metrics_port, nosy) == 403  # still, and from the cache
        assert scraper not in op.log()
    finally:
        cp.kubectl("delete", "clusterrolebinding", f"{namespace}-scraper", check=False)


def test_the_engine_network_policy_selects_the_engines_and_applies(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """manifests/policies/engine_network_policy.yaml (opt-in, per model namespace) is accepted by the API
    server and selects exactly what the operator labels its engine pods with."""
    path = ROOT / "manifests" / "policies" / "engine_network_policy.yaml"
    cp = control_plane
    cp.kubectl("apply", "-n", namespace, "-f", str(path))
    policy = get(cp, namespace, "networkpolicy", "servedmodel-engines")
    assert policy is not None
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= names.standard_labels("qwen", "vllm").items()
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [names.ENGINE_PORT_NAME]

"""The k8s client against a real HTTP server on loopback that answers like an API server would.

Retries, error mapping and the wire shape of server-side apply are checked here; tests/cluster/
checks the same client against a real kube-apiserver.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from servedmodel.k8s import (
    ApiError,
    ConflictError,
    Credentials,
    CredentialsError,
    KubeClient,
    UnreachableError,
    load_credentials,
)
from servedmodel.k8s.credentials import from_kubeconfig


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class FakeApiServer:
    """Routes (method, path) to a list of (status, body, headers) answers, the last one repeating."""

    url: str = ""
    answers: dict[tuple[str, str], list[tuple[int, Any, dict[str, str]]]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    def on(self, method: str, path: str, *answers: tuple[int, Any] | tuple[int, Any, dict[str, str]]) -> None:
        self.answers[(method, path)] = [(a[0], a[1], a[2] if len(a) > 2 else {}) for a in answers]  # type: ignore[misc]

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.seen.append(
            Seen(
                request.method,
                request.path,
                dict(request.query),
                dict(request.headers),
                json.loads(raw) if raw else None,
            )
        )
        queue = self.answers.get((request.method, request.path))
        if not queue:
            status = {"kind": "Status", "status": "Failure", "reason": "NotFound", "message": "not found"}
            return web.json_response(status, status=404)
        status_code, body, headers = queue.pop(0) if len(queue) > 1 else queue[0]
        return web.json_response(body, status=status_code, headers=headers)


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        await runner.cleanup()


@pytest.fixture
def client_for(api: FakeApiServer) -> Callable[..., KubeClient]:
    def make(**kwargs: Any) -> KubeClient:
        kwargs.setdefault("backoff_base_s", 0.001)
        return KubeClient(Credentials(server=api.url, token="s3cr3t-token"), **kwargs)

    return make


DEPLOY = "/apis/apps/v1/namespaces/ns1/deployments/m1"


async def test_get_retries_5xx_then_succeeds(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.on(
        "GET", DEPLOY, (503, status_body(503, "ServiceUnavailable", "etcd")), (200, {"kind": "Deployment"})
    )
    async with client_for() as client:
        obj = await client.get("apps/v1", "deployments", "ns1", "m1")
    assert obj == {"kind": "Deployment"}
    assert [s.method for s in api.seen] == ["GET", "GET"]
    assert api.seen[0].headers["Authorization"] == "Bearer s3cr3t-token"


async def test_retry_is_bounded(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    api.on("GET", DEPLOY, (429, status_body(429, "TooManyRequests", "slow down"), {"Retry-After": "0"}))
    async with client_for(attempts=3) as client:
        with pytest.raises(ApiError) as err:
            await client.get("apps/v1", "deployments", "ns1", "m1")
    assert (err.value.status, err.value.reason, err.value.message) == (429, "TooManyRequests", "slow down")
    assert len(api.seen) == 3


async def test_client_errors_are_not_retried_and_carry_the_status(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.on("PATCH", DEPLOY, (422, status_body(422, "Invalid", 'Deployment "m1" is invalid: spec.replicas')))
    api.on(
        "PATCH", "/apis/apps/v1/namespaces/ns1/deployments/m2", (409, status_body(409, "Conflict", "owned"))
    )
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "m1", "namespace": "ns1"}}
    async with client_for() as client:
        with pytest.raises(ApiError) as err:
            await client.apply(obj, "mgr")
        with pytest.raises(ConflictError):
            await client.apply({**obj, "metadata": {"name": "m2", "namespace": "ns1"}}, "mgr", force=False)
    assert err.value.status == 422
    assert err.value.reason == "Invalid"
    assert "spec.replicas" in err.value.message
    assert len(api.seen) == 2


async def test_not_found(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    async with client_for() as client:
        assert await client.get("apps/v1", "deployments", "ns1", "m1") is None
        assert await client.delete("v1", "services", "ns1", "gone") is False
    assert api.seen[1].method == "DELETE"
    assert api.seen[1].body["propagationPolicy"] == "Background"


async def test_apply_wire_shape(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "m1", "namespace": "ns1"},
        "spec": {},
    }
    api.on("PATCH", DEPLOY, (200, {**obj, "status": {}}))
    async with client_for() as client:
        result = await client.apply(obj, "servedmodel-operator")
    assert result["status"] == {}
    seen = api.seen[0]
    assert seen.headers["Content-Type"] == "application/apply-patch+yaml"
    assert seen.query == {"fieldManager": "servedmodel-operator", "force": "true"}
    assert seen.body == obj


async def test_apply_status_targets_the_subresource(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    path = "/apis/inference.servedmodel.io/v1alpha1/namespaces/ns1/servedmodels/m1/status"
    api.on("PATCH", path, (200, {"status": {"phase": "Ready"}}))
    status = {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True", "reason": "Available"}]}
    async with client_for() as client:
        await client.apply_status(
            "inference.servedmodel.io/v1alpha1", "servedmodels", "ns1", "m1", status, "servedmodel-probe"
        )
    seen = api.seen[0]
    assert seen.path == path
    assert seen.query["fieldManager"] == "servedmodel-probe"
    assert seen.body == {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "m1", "namespace": "ns1"},
        "status": status,
    }


async def test_list_follows_pages_and_selects(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    path = "/api/v1/namespaces/ns1/pods"
    api.on(
        "GET",
        path,
        (200, {"items": [{"n": 1}], "metadata": {"continue": "abc"}}),
        (200, {"items": [{"n": 2}], "metadata": {}}),
    )
    api.on("GET", "/apis/discovery.k8s.io/v1/namespaces/ns1/endpointslices", (200, {"items": [{"e": 1}]}))
    async with client_for() as client:
        pods = await client.list("v1", "pods", "ns1", label_selector="app=m1")
        slices = await client.list_endpoint_slices("ns1", "m1")
    assert pods == [{"n": 1}, {"n": 2}]
    assert slices == [{"e": 1}]
    assert api.seen[0].query == {"limit": "500", "labelSelector": "app=m1"}
    assert api.seen[1].query["continue"] == "abc"
    assert api.seen[2].query["labelSelector"] == "kubernetes.io/service-name=m1"


async def test_discovery_and_unknown_kinds(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    api.on(
        "GET",
        "/apis/example.io/v1",
        (
            200,
            {
                "resources": [
                    {"name": "widgets", "kind": "Widget", "namespaced": False},
                    {"name": "widgets/status"},
                ]
            },
        ),
    )
    api.on("GET", "/apis/example.io/v1/widgets/w", (200, {"kind": "Widget"}))
    async with client_for() as client:
        assert await client.discover("route.openshift.io/v1") is False
        assert await client.discover("example.io/v1") is True
        assert await client.discover("example.io/v1") is True  # cached: one GET
        assert await client.get("example.io/v1", "Widget", None, "w") == {"kind": "Widget"}
    assert [s.path for s in api.seen].count("/apis/example.io/v1") == 1


async def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with KubeClient(
        Credentials(server=f"http://127.0.0.1:{port}"), attempts=2, backoff_base_s=0.001
    ) as c:
        with pytest.raises(UnreachableError) as err:
            await c.get("v1", "pods", "ns", "p")
    assert err.value.status == 0


async def test_create_event(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    api.on("POST", "/api/v1/namespaces/ns1/events", (201, {"kind": "Event"}))
    cr = {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "m1", "namespace": "ns1", "uid": "u-1"},
    }
    async with client_for() as client:
        await client.create_event(cr, type="Normal", reason="Ready", message="1/1 replicas available")
    body = api.seen[0].body
    assert body["involvedObject"]["uid"] == "u-1"
    assert (body["type"], body["reason"]) == ("Normal", "Ready")


# ---- credentials ----------------------------------------------------------------------------------


def write_kubeconfig(
    path: Path, *, server: str, user: dict[str, Any], cluster: dict[str, Any] | None = None
) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "ctx",
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
        "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_kubeconfig_token_and_relative_token_file(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    kc = write_kubeconfig(
        tmp_path / "kc",
        server="https://127.0.0.1:6443/",
        user={"tokenFile": "tok"},
        cluster={"insecure-skip-tls-verify": True},
    )
    creds = load_credentials(kc)
    assert creds.server == "https://127.0.0.1:6443"
    assert creds.bearer_token() == "from-file"
    assert creds.namespace == "team"
    assert creds.ssl_context() is not None
    assert "from-file" not in repr(creds)


def test_kubeconfig_from_env_merges_first_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_kubeconfig(tmp_path / "a", server="http://127.0.0.1:1", user={"token": "A"})
    second = write_kubeconfig(tmp_path / "b", server="http://127.0.0.1:2", user={"token": "B"})
    monkeypatch.setenv("KUBECONFIG", f"{first}:{tmp_path / 'missing'}:{second}")
    creds = load_credentials()
    assert (creds.server, creds.bearer_token()) == ("http://127.0.0.1:1", "A")


def test_kubeconfig_ca_data_must_be_a_certificate(tmp_path: Path) -> None:
    kc = write_kubeconfig(
        tmp_path / "kc",
        server="https://127.0.0.1:6443",
        user={"token": "t"},
        cluster={"certificate-authority-data": base64.b64encode(b"not a pem").decode()},
    )
    creds = from_kubeconfig([kc])
    assert creds.ca_data == "not a pem"
    with pytest.raises(Exception):  # noqa: B017, PT011 - ssl raises its own error types per OpenSSL build
        creds.ssl_context()


def test_kubeconfig_exec_plugins_are_refused(tmp_path: Path) -> None:
    kc = write_kubeconfig(tmp_path / "kc", server="https://x", user={"exec": {"command": "aws"}})
    with pytest.raises(CredentialsError, match="exec"):
        from_kubeconfig([kc])


def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from servedmodel.k8s.credentials import in_cluster

    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "namespace").write_text("ops")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = in_cluster(tmp_path)
    assert creds.server == "https://[fd00::1]:443"
    assert (creds.bearer_token(), creds.namespace) == ("sa-token", "ops")

"""The k8s client against a real HTTP server on loopback that answers like an API server would.

Retries, error mapping and the wire shape of server-side apply are checked here; tests/cluster/
checks the same client against a real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from aiohttp import web
from lightkube import KubeConfig
from lightkube.config.models import Cluster, User

from servedmodel.k8s import (
    ApiError,
    ConflictError,
    CredentialsError,
    GoneError,
    Identity,
    KubeClient,
    UnreachableError,
    load_identity,
)
from servedmodel.k8s import client as k8s_client
from servedmodel.k8s.cache import slim
from servedmodel.k8s.identity import from_config


def identity(server: str, **user: Any) -> Identity:
    return from_config(KubeConfig.from_one(cluster=Cluster(server=server), user=User(**user)), "test")


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
    delay_s: float = 0.0
    accept_tokens: set[str] | None = None  # None: any Authorization is fine
    concurrency: int = 0
    peak_concurrency: int = 0

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
        if self.accept_tokens is not None:
            auth = request.headers.get("Authorization", "")
            if auth.removeprefix("Bearer ") not in self.accept_tokens:
                return web.json_response(status_body(401, "Unauthorized", "Unauthorized"), status=401)
        self.concurrency += 1
        self.peak_concurrency = max(self.peak_concurrency, self.concurrency)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.concurrency -= 1
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


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` on a loopback port: its runner (to clean up) and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner, server.url = await serve(app)
    try:
        yield server
    finally:
        await runner.cleanup()


@pytest.fixture
def client_for(api: FakeApiServer) -> Callable[..., KubeClient]:
    def make(**kwargs: Any) -> KubeClient:
        kwargs.setdefault("backoff_base_s", 0.001)
        return KubeClient(identity(api.url, token="s3cr3t-token"), **kwargs)

    return make


DEPLOY = "/apis/apps/v1/namespaces/ns1/deployments/m1"
DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "m1", "namespace": "ns1"}}


async def test_get_retries_5xx_then_succeeds(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.on("GET", DEPLOY, (503, status_body(503, "ServiceUnavailable", "etcd")), (200, DEPLOYMENT))
    async with client_for() as client:
        obj = await client.get("apps/v1", "deployments", "ns1", "m1")
        assert client.requests[("GET", 503)] == 1
        assert client.requests[("GET", 200)] == 1
        assert client.request_count == 2
    assert obj == DEPLOYMENT
    assert [s.method for s in api.seen] == ["GET", "GET"]
    assert api.seen[0].headers["Authorization"] == "Bearer s3cr3t-token"
    assert api.seen[0].headers["User-Agent"] == "servedmodel-operator"


async def test_retry_is_bounded(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    api.on("GET", DEPLOY, (429, status_body(429, "TooManyRequests", "slow down")))
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
    async with client_for() as client:
        with pytest.raises(ApiError) as err:
            await client.apply(DEPLOYMENT, "mgr")
        with pytest.raises(ConflictError):
            await client.apply(
                {**DEPLOYMENT, "metadata": {"name": "m2", "namespace": "ns1"}}, "mgr", force=False
            )
    assert err.value.status == 422
    assert err.value.reason == "Invalid"
    assert "spec.replicas" in err.value.message
    assert len(api.seen) == 2


async def test_not_found(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    async with client_for() as client:
        assert await client.get("apps/v1", "deployments", "ns1", "m1") is None
        assert await client.delete("v1", "services", "ns1", "gone") is False
    assert api.seen[1].method == "DELETE"
    assert api.seen[1].query["propagationPolicy"] == "Background"


async def test_apply_wire_shape(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    obj = {**DEPLOYMENT, "spec": {"replicas": 2}}
    api.on("PATCH", DEPLOY, (200, {**obj, "status": {"replicas": 0}}))
    async with client_for() as client:
        result = await client.apply(obj, "servedmodel-operator")
    assert result["status"] == {"replicas": 0}
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
    assert seen.headers["Content-Type"] == "application/apply-patch+yaml"
    assert seen.query == {"fieldManager": "servedmodel-probe", "force": "true"}
    assert seen.body == {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "m1", "namespace": "ns1"},
        "status": status,
    }


async def test_apply_status_unread_sends_the_same_apply_and_leaves_the_answer_undecoded(
    api: FakeApiServer, client_for: Callable[..., KubeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's write where a watch feeds its cache: the same request as apply_status, the answer read
    off the connection but not decoded; a refusal is still its ApiError."""
    path = "/apis/inference.servedmodel.io/v1alpha1/namespaces/ns1/servedmodels/m1/status"
    ready = (200, {"status": {"phase": "Ready"}})
    api.on("PATCH", path, ready, (409, status_body(409, "Conflict", "held")), ready)
    decoded: list[bytes] = []

    def loads(data: bytes) -> Any:
        decoded.append(data)
        return json.loads(data)

    monkeypatch.setattr(k8s_client, "json", SimpleNamespace(loads=loads, dumps=json.dumps))
    status = {"probe": {"result": "Success"}}
    gv = "inference.servedmodel.io/v1alpha1"
    async with client_for() as client:
        assert (
            await client.apply_status_unread(gv, "servedmodels", "ns1", "m1", status, "servedmodel-probe")
            is None
        )
        assert decoded == []
        with pytest.raises(ConflictError):
            await client.apply_status_unread(gv, "servedmodels", "ns1", "m1", status, "servedmodel-probe")
        await client.apply_status(gv, "servedmodels", "ns1", "m1", status, "servedmodel-probe")
    assert api.seen[0].path == path
    assert api.seen[0].headers["Content-Type"] == "application/apply-patch+yaml"
    assert api.seen[0].query == {"fieldManager": "servedmodel-probe", "force": "true"}
    assert [s.body for s in api.seen] == [api.seen[2].body] * 3  # the same apply as apply_status's
    assert len(decoded) == 2  # the 409's Status, and apply_status's answer


async def test_list_follows_pages_and_selects(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    path = "/api/v1/namespaces/ns1/pods"
    pod = {"apiVersion": "v1", "kind": "Pod"}
    api.on(
        "GET",
        path,
        (200, {"items": [{**pod, "metadata": {"name": "a"}}], "metadata": {"continue": "abc"}}),
        (200, {"items": [{**pod, "metadata": {"name": "b"}}], "metadata": {}}),
    )
    rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "m1-5d9c"}}
    api.on("GET", "/apis/apps/v1/namespaces/ns1/replicasets", (200, {"items": [rs]}))
    async with client_for() as client:
        pods = await client.list("v1", "pods", "ns1", label_selector="app=m1,tier")
        replica_sets = await client.list(
            "apps/v1", "replicasets", "ns1", label_selector={"app.kubernetes.io/instance": "m1"}
        )
    assert [p["metadata"]["name"] for p in pods] == ["a", "b"]
    assert [r["metadata"]["name"] for r in replica_sets] == ["m1-5d9c"]
    assert api.seen[0].query == {"limit": "500", "labelSelector": "app=m1,tier"}
    assert api.seen[1].query["continue"] == "abc"
    assert api.seen[2].query["labelSelector"] == "app.kubernetes.io/instance=m1"


async def test_discovery_and_unknown_kinds(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    api.on("GET", "/apis/monitoring.coreos.com/v1/namespaces/default/servicemonitors", (200, {"items": []}))
    async with client_for() as client:
        assert await client.discover("route.openshift.io/v1") is False  # 404: not served
        assert await client.discover("monitoring.coreos.com/v1") is True
        assert await client.discover("monitoring.coreos.com/v1") is True  # cached: one request
        # An unregistered kind is the caller's mistake, never a 404 that could be read as "deleted".
        with pytest.raises(LookupError, match="register"):
            await client.get("example.io/v1", "widgets", None, "w")
    assert len(api.seen) == 2


async def test_discovery_asked_at_once_is_one_request(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.delay_s = 0.05
    api.on("GET", "/apis/keda.sh/v1alpha1/namespaces/default/scaledobjects", (200, {"items": []}))
    async with client_for() as client:
        answers = await asyncio.gather(*(client.discover("keda.sh/v1alpha1") for _ in range(20)))
        assert answers == [True] * 20
        assert await client.discover("route.openshift.io/v1") is False
    assert [s.path for s in api.seen] == [
        "/apis/keda.sh/v1alpha1/namespaces/default/scaledobjects",
        "/apis/route.openshift.io/v1/namespaces/default/routes",
    ]


async def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with KubeClient(identity(f"http://127.0.0.1:{port}"), attempts=2, backoff_base_s=0.001) as c:
        with pytest.raises(UnreachableError) as err:
            await c.get("v1", "pods", "ns", "p")
        assert c.requests[("GET", 0)] == 2
    assert err.value.status == 0
    assert f"127.0.0.1:{port}" in err.value.message


async def test_create_event(api: FakeApiServer, client_for: Callable[..., KubeClient]) -> None:
    api.on("POST", "/api/v1/namespaces/ns1/events", (201, {"apiVersion": "v1", "kind": "Event"}))
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


async def test_an_event_whose_retry_finds_it_posted_is_not_an_error(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    """The first POST's answer was lost (a 503 here); the retry, the very same Event by name, is refused
    409: it was posted. A 409 on the first try is the caller's to see."""
    path = "/api/v1/namespaces/ns1/events"
    conflict = (409, status_body(409, "AlreadyExists", "events already exists"))
    api.on("POST", path, (503, status_body(503, "ServiceUnavailable", "lost")), conflict)
    cr = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns1"}}
    async with client_for() as client:
        event = await client.create_event(cr, type="Normal", reason="Ready", message="m")
        assert event["reason"] == "Ready"
        assert api.seen[0].body["metadata"]["name"] == api.seen[1].body["metadata"]["name"]
        with pytest.raises(ConflictError):
            await client.create_event(cr, type="Normal", reason="Ready", message="m")


async def test_in_flight_requests_are_capped(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.delay_s = 0.05
    api.on("GET", DEPLOY, (200, DEPLOYMENT))
    async with client_for(max_inflight=3) as client:
        await asyncio.gather(*(client.get("apps/v1", "deployments", "ns1", "m1") for _ in range(12)))
    assert len(api.seen) == 12
    assert api.peak_concurrency == 3


async def test_401_rereads_a_rotated_token_file(api: FakeApiServer, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old")
    api.accept_tokens = {"new"}
    api.on("GET", DEPLOY, (200, DEPLOYMENT))
    async with KubeClient(identity(api.url, token_file=str(token)), backoff_base_s=0.001) as client:
        token.write_text("new")  # rotated after the first read (the client read it at the first request)
        await client.identity.credential()  # first read happens here: "new"... so rotate again below
        token.write_text("newer")
        api.accept_tokens = {"newer"}
        assert await client.get("apps/v1", "deployments", "ns1", "m1") == DEPLOYMENT
    assert [s.headers["Authorization"] for s in api.seen] == ["Bearer new", "Bearer newer"]


async def test_401_on_a_write_rereads_a_rotated_token_file(api: FakeApiServer, tmp_path: Path) -> None:
    """The writes go over the lean client (not httpx): the same refresh on 401, once."""
    token = tmp_path / "token"
    token.write_text("old")
    api.on("PATCH", DEPLOY, (200, DEPLOYMENT))
    async with KubeClient(identity(api.url, token_file=str(token)), backoff_base_s=0.001) as client:
        await client.identity.credential()  # read "old" now
        token.write_text("rotated")
        api.accept_tokens = {"rotated"}
        assert await client.apply(DEPLOYMENT, "servedmodel-operator") == DEPLOYMENT
        assert client.requests == {("PATCH", 401): 1, ("PATCH", 200): 1}
    assert [s.headers["Authorization"] for s in api.seen] == ["Bearer old", "Bearer rotated"]


async def test_writes_are_capped_retried_and_counted(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.delay_s = 0.05
    api.on("PATCH", DEPLOY, (503, status_body(503, "ServiceUnavailable", "busy")), (200, DEPLOYMENT))
    async with client_for(max_inflight=3) as client:
        await asyncio.gather(*(client.apply(DEPLOYMENT, "servedmodel-operator") for _ in range(12)))
        assert client.requests == {("PATCH", 503): 1, ("PATCH", 200): 12}
        assert client.in_flight == 0
    assert api.peak_concurrency == 3
    assert {s.headers["Authorization"] for s in api.seen} == {"Bearer s3cr3t-token"}


async def test_create_and_replace_send_json_and_map_a_conflict(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    api.on("POST", "/apis/apps/v1/namespaces/ns1/deployments", (201, DEPLOYMENT))
    api.on("PUT", DEPLOY, (409, status_body(409, "Conflict", "the object has been modified")))
    async with client_for() as client:
        assert await client.create(DEPLOYMENT) == DEPLOYMENT
        with pytest.raises(ConflictError, match="the object has been modified"):
            await client.replace(
                {**DEPLOYMENT, "metadata": {**DEPLOYMENT["metadata"], "resourceVersion": "7"}}
            )
    assert api.seen[0].headers["Content-Type"] == "application/json"
    assert api.seen[0].body == DEPLOYMENT
    assert api.seen[1].body["metadata"]["resourceVersion"] == "7"


async def test_watch_reassembles_events_split_across_reads(api: FakeApiServer) -> None:
    """A watch's events as the server flushes them: one split mid-line, two in one read, the last line
    without its newline; then an ERROR event (410) ends it as GoneError."""
    lines = [json.dumps({"type": t, "object": {"metadata": {"name": f"m{i}", "resourceVersion": str(i)}}})
             for i, t in enumerate(["ADDED", "MODIFIED", "BOOKMARK", "DELETED"])]  # fmt: skip
    error = json.dumps({"type": "ERROR", "object": status_body(410, "Expired", "too old resource version")})
    pieces = [
        lines[0][:10],
        lines[0][10:] + "\n" + lines[1][:3],
        lines[1][3:] + "\n\n" + lines[2] + "\n",
        lines[3],
    ]
    queries: list[dict[str, str]] = []

    async def watch(request: web.Request) -> web.StreamResponse:
        queries.append(dict(request.query))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for piece in pieces if len(queries) == 1 else [error + "\n"]:
            await response.write(piece.encode())
            await asyncio.sleep(0.02)  # each its own read
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/apis/apps/v1/namespaces/ns1/deployments", watch)
    runner, url = await serve(app)
    try:
        async with KubeClient(identity(url, token="t")) as client:
            events = [
                (t, o["metadata"]["name"])
                async for t, o in client.watch("apps/v1", "deployments", "ns1", resource_version="5")
            ]
            assert events == [("ADDED", "m0"), ("MODIFIED", "m1"), ("BOOKMARK", "m2"), ("DELETED", "m3")]
            with pytest.raises(GoneError, match="too old resource version"):
                async for _ in client.watch("apps/v1", "deployments", "ns1", resource_version="1"):
                    pass
    finally:
        await runner.cleanup()
    assert queries[0]["watch"] == "1"
    assert queries[0]["resourceVersion"] == "5"
    assert queries[0]["allowWatchBookmarks"] == "true"


# ---- identity -------------------------------------------------------------------------------------


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


def exec_plugin(tmp_path: Path, token: str, expires: str | None = None, api_version: str = "v1beta1") -> Path:
    """A real exec plugin: a script that prints an ExecCredential and counts its runs."""
    script = tmp_path / "plugin.py"
    status: dict[str, Any] = {"token": token, **({"expirationTimestamp": expires} if expires else {})}
    cred = {
        "apiVersion": f"client.authentication.k8s.io/{api_version}",
        "kind": "ExecCredential",
        "status": status,
    }
    script.write_text(
        "import json, os, pathlib, sys\n"
        f"runs = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "runs.write_text(str(int(runs.read_text() if runs.exists() else 0) + 1))\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "assert info['spec']['interactive'] is False, info\n"
        f"print(json.dumps({cred!r}))\n"
    )
    return script


def exec_identity(tmp_path: Path, token: str, expires: str, api_version: str = "v1beta1") -> Identity:
    """The identity of a kubeconfig whose user is exec_plugin(...)'s script, run by this Python."""
    script = exec_plugin(tmp_path, token, expires=expires, api_version=api_version)
    kc = write_kubeconfig(
        tmp_path / "kc",
        server="https://x",
        user={"exec": {"apiVersion": f"client.authentication.k8s.io/{api_version}", "command": sys.executable,
                       "args": [str(script)]}},
    )  # fmt: skip
    return load_identity(kc)


def test_kubeconfig_token_and_relative_token_file(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    kc = write_kubeconfig(
        tmp_path / "kc",
        server="https://127.0.0.1:6443/",
        user={"tokenFile": "tok"},
        cluster={"insecure-skip-tls-verify": True},
    )
    ident = load_identity(kc)
    assert ident.server == "https://127.0.0.1:6443"
    assert asyncio.run(ident.credential()).token == "from-file"
    assert ident.namespace == "team"
    assert ident.ssl_context() is not None
    assert "from-file" not in repr(ident)
    assert "from-file" not in repr(asyncio.run(ident.credential()))


def test_kubeconfig_from_env_first_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_kubeconfig(tmp_path / "a", server="http://127.0.0.1:1", user={"token": "A"})
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{first}")
    ident = load_identity()
    assert ident.server == "http://127.0.0.1:1"
    assert asyncio.run(ident.credential()).token == "A"


def test_kubeconfig_ca_data_must_be_a_certificate(tmp_path: Path) -> None:
    kc = write_kubeconfig(
        tmp_path / "kc",
        server="https://127.0.0.1:6443",
        user={"token": "t"},
        cluster={"certificate-authority-data": base64.b64encode(b"not a pem").decode()},
    )
    with pytest.raises(Exception):  # noqa: B017, PT011 - ssl raises its own error types per OpenSSL build
        load_identity(kc).ssl_context()


async def test_exec_plugin_runs_once_until_it_expires(tmp_path: Path) -> None:
    ident = exec_identity(tmp_path, "exec-token", "2999-01-01T00:00:00Z", api_version="v1")
    first = await ident.credential()
    second = await ident.credential()
    assert first.token == second.token == "exec-token"
    assert first.expiration is not None
    assert first.expiration.year == 2999
    assert (tmp_path / "runs").read_text() == "1"
    await ident.credential(refresh=True)  # a 401 seconds later: no second run within a second
    assert (tmp_path / "runs").read_text() == "1"


async def test_exec_plugin_expired_token_runs_again(tmp_path: Path) -> None:
    ident = exec_identity(tmp_path, "short", "2000-01-01T00:00:00Z")
    await ident.credential()
    await ident.credential()
    assert (tmp_path / "runs").read_text() == "2"


async def test_exec_plugin_failure_is_a_clear_error(tmp_path: Path) -> None:
    kc = write_kubeconfig(
        tmp_path / "kc",
        server="https://x",
        user={"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "no-such-aws-cli",
                       "installHint": "install the AWS CLI"}},
    )  # fmt: skip
    with pytest.raises(CredentialsError, match="install the AWS CLI"):
        await load_identity(kc).credential()


async def test_oidc_auth_provider(tmp_path: Path) -> None:
    def jwt(exp: int) -> str:
        claims = base64.urlsafe_b64encode(json.dumps({"exp": exp}).encode()).decode().rstrip("=")
        return f"e30.{claims}.sig"

    valid = write_kubeconfig(
        tmp_path / "ok", server="https://x",
        user={"auth-provider": {"name": "oidc", "config": {"id-token": jwt(32503680000)}}},
    )  # fmt: skip
    assert (await load_identity(valid).credential()).token == jwt(32503680000)
    expired = write_kubeconfig(
        tmp_path / "old", server="https://x",
        user={"auth-provider": {"name": "oidc", "config": {"id-token": jwt(946684800)}}},
    )  # fmt: skip
    with pytest.raises(CredentialsError, match="oidc-login"):
        await load_identity(expired).credential()
    gcp = write_kubeconfig(tmp_path / "gcp", server="https://x", user={"auth-provider": {"name": "gcp"}})
    with pytest.raises(CredentialsError, match="gke-gcloud-auth-plugin"):
        load_identity(gcp)


def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import servedmodel.k8s.identity as identity_module

    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "namespace").write_text("ops")
    (tmp_path / "ca.crt").write_text("")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setattr(identity_module, "SERVICE_ACCOUNT_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    ident = load_identity()
    assert ident.server == "https://[fd00::1]:443"
    assert ident.namespace == "ops"
    assert isinstance(ident.tokens, identity_module.TokenFile)
    assert asyncio.run(ident.credential()).token == "sa-token"


async def test_list_at_retries_a_5xx_and_pages_to_the_lists_resource_version(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    """The informers' list: a 503 is retried like every other request; pages are followed; items get the
    apiVersion and kind a list leaves out; the answer is the list's resourceVersion, to watch from."""
    path = "/apis/apps/v1/namespaces/a/deployments"
    api.on(
        "GET",
        path,
        (503, status_body(503, "ServiceUnavailable", "etcd")),
        (
            200,
            {"metadata": {"continue": "p2", "resourceVersion": "7"}, "items": [{"metadata": {"name": "x"}}]},
        ),
        (200, {"metadata": {"resourceVersion": "7"}, "items": [{"metadata": {"name": "y"}}]}),
    )
    async with client_for() as client:
        items, rv = await client.list_at("apps/v1", "deployments", "a", label_selector="k=v")
    assert rv == "7"
    assert [(i["kind"], i["apiVersion"], i["metadata"]["name"]) for i in items] == [
        ("Deployment", "apps/v1", "x"),
        ("Deployment", "apps/v1", "y"),
    ]
    assert [s.query.get("continue") for s in api.seen] == [None, None, "p2"]
    assert all(s.query["labelSelector"] == "k=v" for s in api.seen)


async def test_list_at_keeps_what_each_item_becomes_page_by_page(
    api: FakeApiServer, client_for: Callable[..., KubeClient]
) -> None:
    """The informers slim every item as its page arrives: a list of thousands of objects is never held
    whole (managedFields and all) until its last page."""
    path = "/apis/apps/v1/namespaces/a/deployments"
    managed = {"name": "x", "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {}}}]}
    api.on(
        "GET",
        path,
        (200, {"metadata": {"continue": "p2", "resourceVersion": "7"}, "items": [{"metadata": managed}]}),
        (200, {"metadata": {"resourceVersion": "7"}, "items": [{"metadata": {**managed, "name": "y"}}]}),
    )
    seen: list[str] = []

    def each(item: dict[str, Any]) -> dict[str, Any]:
        seen.append(f"{item['metadata']['name']} after {len(api.seen)} pages")
        return slim(item, item["kind"])

    async with client_for() as client:
        items, _ = await client.list_at("apps/v1", "deployments", "a", each=each)
    assert seen == ["x after 1 pages", "y after 2 pages"]
    assert [i["metadata"] for i in items] == [{"name": "x"}, {"name": "y"}]


async def test_apply_status_unread_sends_a_status_held_as_json_as_it_is(
    api: FakeApiServer, client_for: Callable[..., KubeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe holds its last patch as JSON: given `encoded`, the body is that JSON in the apply's
    identity, the same apply as from the dict, and the status is not encoded again."""
    path = "/apis/inference.servedmodel.io/v1alpha1/namespaces/ns1/servedmodels/m1/status"
    ready = (200, {"status": {"phase": "Ready"}})
    api.on("PATCH", path, ready, ready)
    status = {"probe": {"result": "Success", "message": "ünïcode"}, "conditions": [{"type": "Serving"}]}
    encoded: list[Any] = []

    def dumps(obj: Any, **kwargs: Any) -> str:
        encoded.append(obj)
        return json.dumps(obj, **kwargs)

    monkeypatch.setattr(k8s_client, "json", SimpleNamespace(loads=json.loads, dumps=dumps))
    gv = "inference.servedmodel.io/v1alpha1"
    held = json.dumps(status, separators=(",", ":"), ensure_ascii=False).encode()
    async with client_for() as client:
        await client.apply_status_unread(
            gv, "servedmodels", "ns1", "m1", {}, "servedmodel-probe", encoded=held
        )
        assert not [o for o in encoded if "status" in o]  # only the identity was encoded
        await client.apply_status_unread(gv, "servedmodels", "ns1", "m1", status, "servedmodel-probe")
    assert api.seen[0].body == api.seen[1].body
    assert api.seen[0].body["status"] == status
    assert api.seen[0].headers["Content-Type"] == "application/apply-patch+yaml"

"""The probe scheduler's access rules on loopback listeners (servedmodel.access in servedmodel.prober):
a Secret without its owner's opt-in is never read into a request, an endpoint outside the operator's
allow-list is never contacted, a redirect is never followed, TLS verification is not the ServedModel's
to switch off, and an engine that echoes the API key back gets it into no status, Event or log line."""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import replica_support
from replica_support import Cluster

from servedmodel.access import (
    ALLOW_ANNOTATION,
    INSECURE_TLS_NOT_ALLOWED,
    SECRET_NOT_ALLOWED,
    TARGET_NOT_ALLOWED,
)

KEY = "sk-tenant-db-password-5c1e0b"  # a test value


class Listener:
    """A loopback HTTP server that records every request (path, Authorization) and answers each with
    `status` and a JSON error that echoes the request's Authorization header back (a hostile or naive
    engine; /health answers 200), or with a redirect to `location`."""

    def __init__(self, status: int = 401, location: str | None = None) -> None:
        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                auth = self.headers.get("Authorization") or ""
                outer.requests.append((self.path, auth))
                if location is not None:
                    self.send_response(302)
                    self.send_header("Location", location + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/health":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"error": {"message": f"invalid key: {auth}", "echo": auth}}).encode()
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
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Listener:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def carried(self, value: str) -> list[tuple[str, str]]:
        return [r for r in self.requests if value in r[1]]


@pytest.fixture
def listener() -> Iterator[Listener]:
    with Listener() as lis:
        yield lis


class Keyed(Cluster):
    """The recorder of replica_support, with Secrets the scheduler may read."""

    def __init__(self, body: dict[str, Any], *secrets: dict[str, Any]) -> None:
        super().__init__(body)
        self.secrets = {s["metadata"]["name"]: s for s in secrets}
        self.secret_reads: list[str] = []

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        if plural == "secrets":
            self.secret_reads.append(name)
            return self.secrets.get(name)
        return await super().get(api_version, plural, namespace, name)


def secret(name: str, annotations: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns"}
    if annotations is not None:
        meta["annotations"] = annotations
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": encoded}


def external(url: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inference.servedmodel.io/v1alpha1",
        "kind": "ServedModel",
        "metadata": {"name": "qwen", "namespace": "ns", "generation": 1, "uid": "uid-qwen"},
        "spec": {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "servedModelName": "qwen",
            "endpoint": url,
            "probe": {"interval": 5, "checkLimits": False},
            **spec,
        },
    }


API_KEY_REF = {"engine": {"apiKeySecretRef": {"name": "db-credentials", "key": "password"}}}


def cycle(kube: Cluster, **config: Any) -> dict[str, Any]:
    """One probe cycle of ServedModel ns/qwen; the status patch it wrote."""

    async def main() -> dict[str, Any]:
        sched = replica_support.scheduler(kube, **config)
        sched.track(kube.body)
        try:
            result = await sched.run_cycle(("ns", "qwen"))
        finally:
            await sched.stop()
        assert result.written, result
        return kube.writes[-1][2]

    return asyncio.run(main())


def serving(patch: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in patch["conditions"] if c["type"] == "Serving")


def test_a_secret_without_the_opt_in_is_never_sent(listener: Listener) -> None:
    kube = Keyed(external(listener.url, **API_KEY_REF), secret("db-credentials", password=KEY))
    patch = cycle(kube)
    assert listener.requests == []  # nothing at all: the refusal comes before the first request
    assert patch["probe"]["reason"] == SECRET_NOT_ALLOWED
    cond = serving(patch)
    assert cond["status"] == "False"
    assert cond["reason"] == SECRET_NOT_ALLOWED
    assert "Secret db-credentials" in cond["message"]
    assert ALLOW_ANNOTATION in cond["message"]
    assert KEY not in json.dumps(patch)


def test_an_opt_in_for_another_servedmodel_is_no_opt_in(listener: Listener) -> None:
    other = secret("db-credentials", {ALLOW_ANNOTATION: "llama"}, password=KEY)
    patch = cycle(Keyed(external(listener.url, **API_KEY_REF), other))
    assert listener.carried(KEY) == []
    assert serving(patch)["reason"] == SECRET_NOT_ALLOWED


def test_an_echoing_engine_never_gets_the_key_into_status_events_or_the_log(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    allowed = secret("db-credentials", {ALLOW_ANNOTATION: "qwen"}, password=KEY)
    kube = Keyed(external(listener.url, **API_KEY_REF), allowed)
    with caplog.at_level(logging.DEBUG):
        patch = cycle(kube)
    assert listener.carried(KEY), "the allowed key is sent"
    assert serving(patch)["status"] == "False"
    assert "401" in serving(patch)["message"]
    assert KEY not in json.dumps(patch)
    assert KEY not in json.dumps(kube.events)
    assert KEY not in caplog.text


def test_an_endpoint_outside_the_allow_list_is_never_contacted(listener: Listener) -> None:
    kube = Keyed(external(listener.url))
    patch = cycle(kube, allowed_targets="*.svc,*.svc.cluster.local")  # the operator's default
    assert listener.requests == []
    cond = serving(patch)
    assert cond["reason"] == TARGET_NOT_ALLOWED
    assert cond["message"].startswith(f"spec.endpoint {listener.url}: host 127.0.0.1 is not in")


def test_a_prometheus_url_outside_the_allow_list_gets_no_token(listener: Listener) -> None:
    with Listener() as prom:
        source = {
            "type": "prometheus",
            "prometheus": {
                "url": prom.url.replace("127.0.0.1", "localhost"),
                "bearerTokenSecretRef": {"name": "thanos", "key": "token"},
            },
        }
        body = external(listener.url, probe={"interval": 5, "checkLimits": False, "metricsSource": source})
        token = secret("thanos", {ALLOW_ANNOTATION: "*"}, token=KEY)
        kube = Keyed(body, token)
        patch = cycle(kube)
        assert prom.requests == []
    assert kube.secret_reads == []  # refused before the Secret is read
    cond = serving(patch)
    assert cond["reason"] == TARGET_NOT_ALLOWED
    assert "spec.probe.metricsSource.prometheus.url" in cond["message"]


def test_tls_verification_is_not_the_servedmodels_to_switch_off(listener: Listener) -> None:
    source = {"type": "prometheus", "prometheus": {"url": listener.url, "insecureSkipVerify": True}}
    body = external(listener.url, probe={"interval": 5, "checkLimits": False, "metricsSource": source})
    patch = cycle(Keyed(body))
    assert listener.requests == []
    cond = serving(patch)
    assert cond["reason"] == INSECURE_TLS_NOT_ALLOWED
    assert "SERVEDMODEL_ALLOW_INSECURE_TLS" in cond["message"]
    # The cluster admin may allow it: then the source is used.
    patch = cycle(Keyed(body), allow_insecure_tls=True)
    assert serving(patch)["reason"] != INSECURE_TLS_NOT_ALLOWED


def test_a_redirect_is_never_followed() -> None:
    allowed = secret("db-credentials", {ALLOW_ANNOTATION: "qwen"}, password=KEY)
    with Listener() as elsewhere, Listener(location=elsewhere.url) as engine:
        patch = cycle(Keyed(external(engine.url, **API_KEY_REF), allowed))
        assert engine.requests, "the engine was asked"
        assert elsewhere.requests == []
    assert serving(patch)["status"] == "False"
    assert KEY not in json.dumps(patch)

"""The operator's /metrics behind TokenReview + SubjectAccessReview (handlers/metrics.MetricsAuthorizer),
on its real HTTP server, with the API server's two reviews played by a fake (the real ones:
tests/cluster/test_security.py)."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from typing import Any

import httpx
import pytest

from servedmodel.handlers import metrics
from servedmodel.k8s import ApiError

USERS = {"reader-token": "system:serviceaccount:monitoring:prometheus", "other-token": "alice"}


class Reviews:
    """The API server's answers: tokens in USERS authenticate; only the reader may get /metrics."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.fail = False

    async def __call__(self, review: dict[str, Any]) -> dict[str, Any]:
        self.seen.append(review)
        if self.fail:
            raise ApiError(503, "ServiceUnavailable", "down")
        spec = review["spec"]
        if review["kind"] == "TokenReview":
            user = USERS.get(spec["token"])
            status: dict[str, Any] = {"authenticated": user is not None}
            if user is not None:
                status["user"] = {"username": user, "groups": ["system:authenticated"], "uid": "u1"}
            return {**review, "status": status}
        assert review["kind"] == "SubjectAccessReview"
        allowed = spec["user"] == USERS["reader-token"] and spec["nonResourceAttributes"] == {
            "path": "/metrics",
            "verb": "get",
        }
        return {**review, "status": {"allowed": allowed}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(port: int, token: str | None, path: str = "/metrics") -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def test_metrics_answer_401_without_a_valid_token_403_without_the_right_200_with_it() -> None:
    reviews = Reviews()

    async def main() -> None:
        port = free_port()
        auth = metrics.MetricsAuthorizer(reviews, asyncio.get_running_loop(), allow_ttl_s=60)
        served = metrics.serve(port, "127.0.0.1", auth)
        assert served is not None
        server, _ = served
        try:
            code, _ = await asyncio.to_thread(fetch, port, None)
            assert code == 401
            assert reviews.seen == []  # no token, no API request
            code, _ = await asyncio.to_thread(fetch, port, "forged")
            assert code == 401
            code, body = await asyncio.to_thread(fetch, port, "other-token")
            assert code == 403
            assert "alice" in body
            code, body = await asyncio.to_thread(fetch, port, "reader-token")
            assert code == 200
            assert "servedmodel_reconcile_total" in body
            sar = reviews.seen[-1]
            assert sar["spec"]["user"] == USERS["reader-token"]
            assert sar["spec"]["uid"] == "u1"
            # A scrape within the cache's lifetime asks the API server nothing.
            before = len(reviews.seen)
            code, _ = await asyncio.to_thread(fetch, port, "reader-token")
            assert code == 200
            assert len(reviews.seen) == before
            # The path is what is authorised: /metrics only.
            code, _ = await asyncio.to_thread(fetch, port, "reader-token", "/other")
            assert code == 403
        finally:
            server.shutdown()
            server.server_close()

    asyncio.run(main())


def test_decisions_expire_and_a_failed_review_is_500_and_not_cached() -> None:
    reviews = Reviews()
    now = [0.0]

    async def main() -> None:
        auth = metrics.MetricsAuthorizer(
            reviews, asyncio.get_running_loop(), allow_ttl_s=60, deny_ttl_s=10, clock=lambda: now[0]
        )
        assert await auth.decide("Bearer reader-token", "get", "/metrics") == (200, "ok")
        assert await auth.decide("bearer reader-token", "get", "/metrics") == (200, "ok")
        assert auth.reviews == 2  # one TokenReview and one SubjectAccessReview
        now[0] = 61.0
        assert (await auth.decide("Bearer reader-token", "get", "/metrics"))[0] == 200
        assert auth.reviews == 4
        assert (await auth.decide("Bearer other-token", "get", "/metrics"))[0] == 403
        now[0] = 65.0
        assert (await auth.decide("Bearer other-token", "get", "/metrics"))[0] == 403
        assert auth.reviews == 6  # the denial was reused
        now[0] = 72.0
        reviews.fail = True
        assert (await auth.decide("Bearer other-token", "get", "/metrics"))[0] == 500
        reviews.fail = False
        assert (await auth.decide("Bearer other-token", "get", "/metrics"))[0] == 403
        assert (await auth.decide("Basic dXNlcjpwdw==", "get", "/metrics"))[0] == 401

    asyncio.run(main())


def test_the_token_is_not_what_the_cache_keeps() -> None:
    async def main() -> None:
        auth = metrics.MetricsAuthorizer(Reviews(), asyncio.get_running_loop())
        await auth.decide("Bearer reader-token", "get", "/metrics")
        assert "reader-token" not in repr(auth._decisions)

    asyncio.run(main())


@pytest.mark.parametrize("enabled", [True, False])
def test_the_config_switches_authentication(enabled: bool) -> None:
    from servedmodel.config import OperatorConfig

    class Client:
        async def create_review(self, review: dict[str, Any]) -> dict[str, Any]:
            return review

    async def main() -> metrics.MetricsAuthorizer | None:
        return metrics.authorizer(OperatorConfig(metrics_auth=enabled), Client())  # type: ignore[arg-type]

    assert (asyncio.run(main()) is not None) is enabled


def test_the_exposition_is_served_gzipped_and_by_name_to_prometheus_clients_parser() -> None:
    """The operator's own exposition app (no auth): what a Prometheus scrape asks, read back with
    prometheus_client's parser; the probe's per-ServedModel families included."""
    from prometheus_client.parser import text_string_to_metric_families

    from servedmodel.handlers.prober import PROBE_METRICS

    PROBE_METRICS.cycles.labels("ns", "served", "success").inc()
    port = free_port()
    served = metrics.serve(port, "127.0.0.1", None)
    assert served is not None
    server, _ = served
    try:
        plain = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "content-length" not in plain.headers  # sent piece by piece, the end is the close
        families = {f.name for f in text_string_to_metric_families(plain.text)}
        assert {"servedmodel_reconcile", "servedmodel_probe"} <= families
        zipped = httpx.get(
            f"http://127.0.0.1:{port}/metrics",
            params={"name[]": ["servedmodel_probe_total"]},
            headers={"Accept-Encoding": "gzip"},
            timeout=10,
        )
        assert zipped.headers["content-encoding"] == "gzip"
        only = list(text_string_to_metric_families(zipped.text))  # httpx unzips
        assert [f.name for f in only] == ["servedmodel_probe"]
        assert any(s.labels.get("name") == "served" for s in only[0].samples)
        whole = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept-Encoding": "gzip"}, timeout=10)
        assert whole.headers["content-encoding"] == "gzip"
        assert [f.name for f in text_string_to_metric_families(whole.text)] == [
            f.name for f in text_string_to_metric_families(plain.text)
        ]
        assert httpx.post(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 405
    finally:
        PROBE_METRICS.forget("ns", "served")
        server.shutdown()
        server.server_close()

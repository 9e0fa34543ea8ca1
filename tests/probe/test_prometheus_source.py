"""probe/prometheus.py: PromQL over the shared httpx client — against Debian's real prometheus, and
loopback HTTP servers standing in for a querier gateway (one that refuses the token, answers 503, or
never answers). Failures are classified, a query never outlives its cycle, and no thread is started."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web
from probe_support import PrometheusServer

from servedmodel.probe import errors, prometheus
from servedmodel.probe.prometheus import PrometheusMetrics, parse_vector

VECTOR = {
    "status": "success",
    "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "2"]}]},
}

BAD_QUERY = b'{"status":"error","errorType":"bad_data","error":"parse error"}'
MATRIX = b'{"status":"success","data":{"resultType":"matrix","result":[]}}'


@pytest.mark.parametrize(
    ("status", "body", "reason", "says"),
    [
        (401, b"", errors.UNAUTHORIZED, "bearer token was refused"),
        (403, b'{"status":"error"}', errors.UNAUTHORIZED, "HTTP 403"),
        (400, BAD_QUERY, errors.UNEXPECTED_STATUS, "bad_data"),
        (503, b"<html>unavailable</html>", errors.UNEXPECTED_STATUS, "not Prometheus' API"),
        (200, b"not json", errors.MALFORMED_RESPONSE, "not JSON"),
        (200, MATRIX, errors.MALFORMED_RESPONSE, "vector"),
    ],
    ids=["401", "403", "bad-query", "html-503", "not-json", "matrix"],
)
def test_answers_are_classified(status: int, body: bytes, reason: str, says: str) -> None:
    with pytest.raises(errors.ProbeFailure) as failed:
        parse_vector(status, body)
    assert failed.value.reason == reason
    assert says in failed.value.message


def test_a_vector_is_its_result() -> None:
    assert parse_vector(200, json.dumps(VECTOR).encode()) == VECTOR["data"]["result"]  # type: ignore[index]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as client:
        yield client


@pytest.mark.prometheus
async def test_real_prometheus_query_and_bad_query(
    prometheus: PrometheusServer, http: httpx.AsyncClient
) -> None:
    reader = PrometheusMetrics(http, prometheus.base_url, model="qwen", namespace="probe-ns")
    now = pytest.approx(time.time(), abs=300)  # the evaluation time: Prometheus's now, this machine's clock
    assert await reader.query("vector(1)") == [{"metric": {}, "value": [now, "1"]}]
    with pytest.raises(errors.ProbeFailure) as failed:
        await reader.query("sum(")
    assert failed.value.reason == errors.UNEXPECTED_STATUS
    assert "HTTP 400: bad_data" in failed.value.message


async def test_closed_port_is_connection_refused(http: httpx.AsyncClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reader = PrometheusMetrics(http, f"http://127.0.0.1:{port}", model="qwen", namespace=None)
    with pytest.raises(errors.ProbeFailure) as failed:
        await reader.snapshot()
    assert failed.value.reason == errors.CONNECTION_REFUSED


async def _serve(handler: Callable[[web.Request], Any]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/api/v1/query", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_bearer_token_is_sent_and_a_refused_one_is_unauthorized(http: httpx.AsyncClient) -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != "Bearer good":
            return web.Response(status=401, text="Unauthorized")
        return web.json_response(VECTOR)

    runner, url = await _serve(handler)
    try:
        good = PrometheusMetrics(http, url, model="qwen", namespace="ml", bearer_token="good")
        assert await good.query("up") == VECTOR["data"]["result"]  # type: ignore[index]
        bad = PrometheusMetrics(http, url, model="qwen", namespace="ml", bearer_token="s3cret-wrong")
        with pytest.raises(errors.ProbeFailure) as failed:
            await bad.query("up")
    finally:
        await runner.cleanup()
    assert seen == ["Bearer good", "Bearer s3cret-wrong"]
    assert failed.value.reason == errors.UNAUTHORIZED
    assert "s3cret" not in failed.value.message


@pytest.mark.parametrize(("unavailable", "ok"), [(2, True), (3, False)], ids=["recovers", "gives-up"])
async def test_gateway_errors_retry_bounded(http: httpx.AsyncClient, unavailable: int, ok: bool) -> None:
    calls = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls <= unavailable:
            return web.json_response(
                {"status": "error", "errorType": "unavailable", "error": "x"}, status=503
            )
        return web.json_response(VECTOR)

    runner, url = await _serve(handler)
    try:
        reader = PrometheusMetrics(http, url, model=None, namespace=None)
        if ok:
            assert await reader.query("up") == VECTOR["data"]["result"]  # type: ignore[index]
        else:
            with pytest.raises(errors.ProbeFailure) as failed:
                await reader.query("up")
            assert failed.value.reason == errors.UNEXPECTED_STATUS
            assert "HTTP 503: unavailable" in failed.value.message
    finally:
        await runner.cleanup()
    assert calls == min(unavailable + 1, prometheus.RETRIES + 1)


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """A TCP server that reads the request and never answers: (url, connected, closed by the client)."""
    connected, closed = asyncio.Event(), asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        while await reader.read(4096):
            pass  # the request, then nothing until the client gives up
        closed.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connected, closed
    finally:
        server.close()
        await server.wait_closed()


async def test_a_query_that_times_out_leaves_nothing_running(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ProbeTimeout, the connection closed by the time the query returns, and no worker thread."""
    monkeypatch.setattr(prometheus, "QUERY_TIMEOUT_S", 0.3)
    threads = threading.active_count()
    async with silent_server() as (url, connected, closed):
        reader = PrometheusMetrics(http, url, model="qwen", namespace="ml")
        with pytest.raises(errors.ProbeFailure) as failed:
            await reader.query("up")
        assert failed.value.reason == errors.PROBE_TIMEOUT
        assert connected.is_set()
        await asyncio.wait_for(closed.wait(), 10)  # bounded wait: the client hung up, the server saw it
    assert threading.active_count() == threads


async def test_a_cancelled_cycle_cancels_its_query() -> None:
    """The probe scheduler cancels a cycle (shutdown, deletion): the queries stop with it (a coroutine,
    no thread left running it); their connections are the pool's, closed with the client at the latest."""
    threads = threading.active_count()
    async with silent_server() as (url, connected, closed):
        async with httpx.AsyncClient(trust_env=False) as http:
            reader = PrometheusMetrics(http, url, model="qwen", namespace="ml")
            task = asyncio.create_task(reader.snapshot())
            await asyncio.wait_for(connected.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert threading.active_count() == threads
        await asyncio.wait_for(closed.wait(), 10)

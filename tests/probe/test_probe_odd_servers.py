"""Servers the simulator does not imitate, as real aiohttp servers on loopback: an OpenAI-compatible
server that does not enforce max_model_len, one whose /tokenize disagrees with its usage, one that drops
usage, one that answers /v1/models with HTML, one that answers a streamed request with plain JSON, and
/metrics servers that honour, ignore or misread the probe's name[] query."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import errors
from servedmodel.probe.client import PodMetrics, ProbeOutcome, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.metrics import parse_metrics

CHATML_STRS = ["<|im_start|>", "user", "Ċ", "x", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]


@dataclass
class Odd:
    """What the server gets wrong."""

    models_html: bool = False
    tokenize_count: int = 20
    usage: bool = True
    json_instead_of_stream: bool = False
    # /metrics/ and name[]: "honoured" (prometheus_client's app, as vLLM mounts it), "ignored" (everything,
    # whatever is asked), "nothing" (an answer without a sample, as an old multiprocess registry gives),
    # "missing" (no such route: 404)
    metrics_query: str = "honoured"
    metrics_queries: list[str] = field(default_factory=list)


def exposition() -> CollectorRegistry:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "r", labels, registry=reg).labels("qwen", "0").set(2)
    Gauge("vllm:num_requests_waiting", "w", labels, registry=reg).labels("qwen", "0").set(1)
    Counter("vllm:request_success", "s", labels, registry=reg).labels("qwen", "0").inc(7)
    Counter("vllm:iteration_tokens", "unread", labels, registry=reg).labels("qwen", "0").inc(9)
    return reg


def app(odd: Odd) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        if odd.models_html:
            return web.Response(text="<html>gateway</html>", content_type="text/html")
        return web.json_response(
            {"object": "list", "data": [{"id": "qwen", "object": "model", "max_model_len": 64}]}
        )

    async def tokenize(_: web.Request) -> web.Response:
        return web.json_response(
            {"count": odd.tokenize_count, "max_model_len": 64, "token_strs": CHATML_STRS}
        )

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):  # the oversized prompt: accepted, no limit enforced
            return web.json_response({"choices": [{"index": 0, "message": {"content": "ok"}}]})
        if odd.json_instead_of_stream:
            return web.json_response({"choices": []})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ["one", " two", " three", " four"]:
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        last = {
            "choices": [
                {"index": 0, "delta": {"content": " "}, "finish_reason": "stop", "stop_reason": "five"}
            ]
        }
        await resp.write(f"data: {json.dumps(last)}\n\n".encode())
        if odd.usage:
            usage = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    registry = exposition()

    async def metrics(request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        odd.metrics_queries.append(request.path_qs)
        if request.path == "/metrics/":
            if odd.metrics_query == "missing":
                return web.Response(status=404, text="Not Found")
            if odd.metrics_query == "nothing":
                return web.Response(text="# nothing here\n")
            if odd.metrics_query == "honoured":
                return web.Response(body=generate_latest(registry.restricted_registry(names)))
        return web.Response(body=generate_latest(registry))

    a = web.Application()
    a.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/metrics/", metrics),
            web.get("/health", health),
            web.get("/v1/models", models),
            web.post("/tokenize", tokenize),
            web.post("/v1/chat/completions", chat),
        ]
    )
    return a


@pytest.fixture
async def odd_server() -> AsyncIterator[tuple[str, Odd]]:
    odd = Odd()
    runner = web.AppRunner(app(odd))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", odd
    finally:
        await runner.cleanup()


async def probe(url: str, **spec: Any) -> ProbeOutcome:
    s = ProbeSpec.model_validate(spec)
    async with probe_client(s) as client:
        return await run_probe(client, resolve_external(url), s, model="qwen")


async def test_unenforced_limit_fails_limits(odd_server: tuple[str, Odd]) -> None:
    url, _ = odd_server
    out = await probe(url)
    assert out.failure is None
    assert (out.checks["limits"].result, out.checks["limits"].reason) == ("Fail", "LimitNotEnforced")
    assert out.checks["template"].result == "Pass"
    assert out.checks["stop"].result == "Pass"


async def test_tokenize_disagreeing_with_usage_fails_template(odd_server: tuple[str, Odd]) -> None:
    url, odd = odd_server
    odd.tokenize_count = 17
    out = await probe(url)
    assert (out.checks["template"].result, out.checks["template"].reason) == ("Fail", "PromptTokensMismatch")


async def test_missing_usage_fails_usage(odd_server: tuple[str, Odd]) -> None:
    url, odd = odd_server
    odd.usage = False
    out = await probe(url)
    assert out.failure is None
    assert (out.checks["usage"].result, out.checks["usage"].reason) == ("Fail", "UsageMissing")


@pytest.mark.parametrize(
    ("oddity", "reason"),
    [("models_html", errors.MALFORMED_RESPONSE), ("json_instead_of_stream", errors.MALFORMED_STREAM)],
    ids=["html-models-is-malformed-response", "json-instead-of-stream-is-malformed-stream"],
)
async def test_odd_answers_fail_the_probe(odd_server: tuple[str, Odd], oddity: str, reason: str) -> None:
    url, odd = odd_server
    assert getattr(odd, oddity) is False  # the server answers properly unless told
    setattr(odd, oddity, True)
    out = await probe(url)
    assert out.failure is not None
    assert out.failure.reason == reason


@pytest.mark.parametrize(
    ("query", "first", "then"),
    [("honoured", 1, 1), ("ignored", 1, 1), ("nothing", 2, 1), ("missing", 2, 1)],
)
async def test_metrics_are_read_whether_the_name_query_is_honoured_or_not(
    odd_server: tuple[str, Odd], query: str, first: int, then: int
) -> None:
    """The probe asks /metrics/ for its samples alone (name[]); a server that ignores the query sends
    everything and the same snapshot comes out of it; one that answers it with nothing, or has no such
    route, is scraped at /metrics at once and from then on."""
    url, odd = odd_server
    odd.metrics_query = query
    whole = parse_metrics(generate_latest(exposition()).decode(), "qwen")
    async with probe_client(ProbeSpec()) as client:
        for scrapes in (first, then):
            odd.metrics_queries.clear()
            snap = await PodMetrics(client, [url], "qwen").snapshot()
            assert snap == whole
            assert snap.gauges == {"running": 2.0, "waiting": 1.0}
            assert snap.counters == {"request_success": 7.0}
            assert len(odd.metrics_queries) == scrapes, odd.metrics_queries
            assert odd.metrics_queries[-1].startswith(
                "/metrics/?name" if query in ("honoured", "ignored") else "/metrics"
            )
    if query in ("nothing", "missing"):
        assert odd.metrics_queries == ["/metrics"]

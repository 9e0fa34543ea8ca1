"""The probe's requests under httpx's client (probe/http11.LeanClient, issue 21): the probe's own client
sends its http:// requests straight to the LeanTransport. What must not change: the bytes an engine
receives, the answers and errors the probe reads, and the two marks the chat's timing takes from the
transport; and a client with an event hook (or closed) still goes through httpx's client layer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from typing import Any

import httpx
import pytest
from test_probe_http11 import Raw, Reader, Writer, chunked

from servedmodel.api.probe import ProbeSpec
from servedmodel.config import OperatorConfig
from servedmodel.probe import bounds, errors
from servedmodel.probe.client import (
    PathMemo,
    PodMetrics,
    http_client,
    probe_client,
    probe_transport,
    run_probe,
    stream_chat,
)
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.errors import ProbeFailure
from servedmodel.prober.cycle import CycleRunner
from servedmodel.sim.process import SimulatorProcess
from servedmodel.wire import http11

SPEC = ProbeSpec()
SSE = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":{"prompt_tokens":3,'
    b'"completion_tokens":1,"total_tokens":4}}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n',
    b"data: [DONE]\n\n",
]


async def answer(raw: Raw, reader: Reader, writer: Writer) -> None:
    """Answer every request on the connection: an SSE stream (chunked) for a chat, JSON for the rest."""
    while True:
        head = await raw.request(reader)
        if b" /v1/chat/completions " in head.split(b"\r\n", 1)[0]:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            writer.write(chunked(*SSE))
        else:
            body = b'{"ok":true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Twice: a\r\nx-twice: b\r\n\r\n%s"
                % (len(body), body)
            )
        await writer.drain()


async def exchange_all(client: httpx.AsyncClient, url: str) -> list[Any]:
    """The probe's kinds of request through `client`: a GET, a POST with a JSON body and a key, the
    filtered /metrics URL object, and a streamed chat."""
    got: list[Any] = []
    r = await bounds.request(client, "GET", f"{url}/health", "GET /health", cap=1024, deadline_s=5)
    got.append((r.status_code, r.body, r.headers.get("x-twice"), r.headers.get("content-length")))
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo ☃"}], "n": 1.5}
    headers = {"Authorization": "Bearer k"}
    r = await bounds.request(
        client, "POST", f"{url}/tokenize", "POST", cap=1024, deadline_s=5, headers=headers, json_body=body
    )
    got.append((r.status_code, r.body))
    metrics_url = httpx.URL(f"{url}/metrics/?name[]=vllm%3Aa&name[]=vllm%3Ab")
    r = await bounds.request(
        client, "GET", metrics_url, "GET /metrics", cap=1024, deadline_s=5, read_limits=httpx.Timeout(5.0)
    )
    got.append((r.status_code, r.body))
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 2}
    ticks = itertools.count()
    t = await stream_chat(client, url, chat, "k", "probe-1", clock=lambda: next(ticks), max_tokens=2)
    got.append((t.content, t.sent_ns, t.headers_ns, t.first_token_ns, t.done))
    return got


async def test_an_engine_receives_the_same_bytes_and_the_probe_reads_the_same_answers() -> None:
    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await answer(raw, reader, writer)

    sent: list[httpx.Request] = []

    async def hook(request: httpx.Request) -> None:
        sent.append(request)

    async with Raw(script) as raw:
        async with http_client(SPEC, probe_transport()) as lean:
            assert isinstance(lean, http11.LeanClient)
            assert lean.lean is not None
            got_lean = await exchange_all(lean, raw.url)
        lean_heads = list(raw.heads)
        raw.heads.clear()
        async with http_client(SPEC, probe_transport()) as plain:
            plain.event_hooks["request"].append(hook)  # a hook: httpx's client layer runs it
            got_plain = await exchange_all(plain, raw.url)
    assert len(sent) == 4  # the hooked client went through httpx
    assert lean_heads == raw.heads  # byte for byte, headers and their order
    assert got_lean == got_plain
    assert got_lean[0] == (200, b'{"ok":true}', "a, b", "11")
    # the chat's marks come from the transport on either path: sent at the 2nd tick, headers at the 3rd
    assert got_lean[3] == ("Hi there", 1, 2, 4, True)


@pytest.mark.parametrize(
    ("method", "url", "headers", "body"),
    [
        ("GET", "http://10.0.0.1:8000/health", {"Accept-Encoding": "identity"}, None),
        (
            "GET",
            "http://10.0.0.1/v1/models",
            {"Accept-Encoding": "identity", "Authorization": "Bearer k"},
            None,
        ),
        ("GET", "http://[fd00::1]:8000/metrics/?name[]=vllm%3Ax", {"Accept-Encoding": "identity"}, None),
        (
            "POST",
            "http://engine.ns.svc:8000/v1/chat/completions",
            {"Accept": "text/event-stream", "X-Request-Id": "probe-1"},
            {"messages": [{"role": "user", "content": "é ☃"}], "stop": ["\n"]},
        ),
        ("POST", "http://h:1/tokenize", {"Connection": "close", "host": "other"}, {"a": [1, 2.5, None]}),
    ],
)
async def test_the_lean_request_is_the_one_httpx_encodes(
    method: str, url: str, headers: dict[str, str], body: Any
) -> None:
    async with http_client(SPEC, probe_transport()) as client:
        request = client.build_request(method, url, headers=headers, json=body)
        want = await http11._encode(request)
        payload = None if body is None else bounds.json_bytes(body)
        assert http11.encode_lean(method, httpx.URL(url), client.headers.raw, headers, payload) == want


async def test_errors_and_limits_are_the_same_on_the_lean_path() -> None:
    async def stall(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        await reader.read()  # until the client gives up and closes

    spec = ProbeSpec(first_byte_timeout=0.2)
    async with Raw(stall) as raw, http_client(spec, probe_transport()) as client:
        with pytest.raises(ProbeFailure) as caught:
            await bounds.request(client, "GET", f"{raw.url}/health", "GET /health", cap=1024, deadline_s=5)
        assert caught.value.reason == errors.FIRST_BYTE_TIMEOUT
        with pytest.raises(ProbeFailure) as caught:  # the whole answer's own deadline
            await bounds.request(client, "GET", f"{raw.url}/health", "GET /health", cap=1024, deadline_s=0.1)
        assert caught.value.reason == errors.DEADLINE_EXCEEDED
        heads = len(raw.heads)
        with pytest.raises(ProbeFailure, match="illegal header"):  # not sent
            await bounds.request(
                client, "GET", raw.url, "GET /", cap=1, deadline_s=5, headers={"Authorization": "k\r\nX: 1"}
            )
        assert len(raw.heads) == heads
        url = raw.url
    async with http_client(SPEC, probe_transport()) as client:
        with pytest.raises(ProbeFailure) as caught:
            await bounds.request(client, "GET", f"{url}/health", "GET /health", cap=1024, deadline_s=5)
        assert caught.value.reason == errors.CONNECTION_REFUSED
    with pytest.raises(RuntimeError, match="closed"):  # as httpx says of a closed client
        await bounds.request(client, "GET", f"{url}/health", "GET /health", cap=1024, deadline_s=5)


async def test_an_answer_past_its_cap_is_refused_on_the_lean_path() -> None:
    async def big(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        body = json.dumps({"data": "x" * 5000}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body[:100], body[100:])
        )
        await writer.drain()
        await asyncio.sleep(1)

    async with Raw(big) as raw, http_client(SPEC, probe_transport()) as client:
        with pytest.raises(ProbeFailure) as caught:
            await bounds.request(client, "GET", raw.url, "GET /v1/models", cap=1024, deadline_s=5)
    assert caught.value.reason == errors.RESPONSE_TOO_LARGE


async def test_probe_cycles_go_under_httpx_client(
    sim: SimulatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full path and a light cycle on the probe's own client: no request through AsyncClient.send."""
    sends = 0
    real = httpx.AsyncClient.send

    async def counted(self: httpx.AsyncClient, *args: Any, **kwargs: Any) -> httpx.Response:
        nonlocal sends
        sends += 1
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "send", counted)
    spec = ProbeSpec(max_tokens=8)
    target = resolve_external(sim.base_url)
    memo = PathMemo("sim")
    async with probe_client(spec) as client:
        for _ in range(2):
            out = await run_probe(
                client, target, spec, metrics=PodMetrics(client, [sim.base_url], None), memo=memo
            )
            assert out.failure is None, out.failure
            assert out.figures is not None
            assert out.figures.ttft_ms is not None
            assert out.window is not None
            assert out.isolated
    assert sends == 0


async def test_the_operators_cycle_clients_go_under_httpx_client_over_the_one_pool() -> None:
    """The prober's per-cycle clients (prober/cycle.CycleRunner) send straight to its one LeanTransport."""
    runner = CycleRunner(
        kube=None,  # type: ignore[arg-type]
        config=OperatorConfig(),
        metrics=None,  # type: ignore[arg-type]
        reader=None,  # type: ignore[arg-type]
        cache=None,
        enqueue=None,
        forget=lambda *_: None,
        probe_loop=None,  # type: ignore[arg-type]
        rng=random.Random(0),
    )
    first, second = runner._client(SPEC), runner._client(SPEC)
    assert isinstance(first, http11.LeanClient)
    assert isinstance(second, http11.LeanClient)
    assert isinstance(first.lean, http11.LeanTransport)
    assert first.lean is second.lean
    assert first.lean_for(httpx.URL("http://10.0.0.1:8000/health"))
    assert not first.lean_for(httpx.URL("https://engine.example/health"))
    await first.aclose()
    await second.aclose()
    for close in runner.closers():
        await close()

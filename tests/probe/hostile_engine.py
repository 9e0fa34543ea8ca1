"""A hostile engine on loopback: an OpenAI-compatible server (aiohttp) that answers properly except on one
route, where it does what one broken or malicious engine can do to a prober: send 100 MB as /v1/models,
200 MB of /metrics without a newline, a stream that never ends, 100,000 nested brackets, one byte at a
time, bytes that are not UTF-8, an SSE line without end, or echo the API key back.

Shared by tests/probe/test_probe_hostile.py and bench/probe_hostile.py (the RSS figures)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler

MB = 1_000_000
CHUNK = b"x" * (1 << 20)  # written again and again: the server itself holds one MiB, whatever it sends

MODES = (
    "huge-models",  # GET /v1/models: 100 MB
    "huge-metrics",  # GET /metrics: 200 MB without a newline
    "endless-stream",  # the chat stream never ends (token chunks as fast as the socket takes them)
    "deep-json",  # GET /v1/models: 100,000 nested brackets
    "trickle",  # GET /v1/models: one byte every `trickle_s`
    "not-utf8",  # the chat stream's content is not UTF-8
    "endless-line",  # the chat stream: one SSE line that never ends
    "echo-key",  # GET /v1/models: 401 whose body echoes the Authorization header
    "gzip-bomb",  # GET /v1/models: 64 MB of JSON whitespace, gzip-encoded (~300 KB on the wire)
    "cookies",  # every answer sets a 3 KB cookie; the Cookie headers it is sent are kept in `cookies_seen`
)
_BOMB: list[bytes] = []


def gzip_bomb() -> bytes:
    """64 MB of spaces, gzip-compressed once per process."""
    if not _BOMB:
        z = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        parts = [z.compress(CHUNK.replace(b"x", b" ")) for _ in range(64)]
        _BOMB.append(b"".join(parts) + z.flush())
    return _BOMB[0]


@dataclass
class Hostile:
    mode: str
    trickle_s: float = 5.0
    cookies_seen: list[str] = field(default_factory=list)  # "cookies": the Cookie header of each request


def _chunk(content: str, n: int) -> bytes:
    doc = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n},
    }
    return f"data: {json.dumps(doc)}\n\n".encode()


def app(h: Hostile) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def stream_bytes(request: web.Request, total: int, ctype: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": ctype})
        await resp.prepare(request)
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < total:
                await resp.write(CHUNK)
                sent += len(CHUNK)
        return resp

    async def models(request: web.Request) -> web.StreamResponse:
        if h.mode == "huge-models":
            return await stream_bytes(request, 100 * MB, "application/json")
        if h.mode == "gzip-bomb":
            return web.Response(
                body=gzip_bomb(), headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}
            )
        if h.mode == "deep-json":
            return web.Response(body=b"[" * 100_000 + b"]" * 100_000, content_type="application/json")
        if h.mode == "echo-key":
            auth = request.headers.get("Authorization", "")
            return web.json_response({"error": {"message": f"invalid key: {auth}"}}, status=401)
        body = json.dumps(
            {"object": "list", "data": [{"id": "qwen", "object": "model", "max_model_len": 64}]}
        )
        if h.mode == "trickle":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            with contextlib.suppress(ConnectionError):
                for b in body.encode():
                    await resp.write(bytes([b]))
                    await asyncio.sleep(h.trickle_s)
            return resp
        return web.Response(text=body, content_type="application/json")

    async def metrics(request: web.Request) -> web.StreamResponse:
        if h.mode == "huge-metrics":
            return await stream_bytes(request, 200 * MB, "text/plain; version=0.0.4")
        return web.Response(text='vllm:num_requests_running{model_name="qwen"} 0\n')

    async def tokenize(_: web.Request) -> web.Response:
        return web.json_response({"count": 9, "max_model_len": 64, "token_strs": None})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "message": {"content": "one"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
            if h.mode == "endless-stream":
                n = 0
                while True:
                    n += 1
                    await resp.write(_chunk(" token", n) * 64)
            if h.mode == "endless-line":
                await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"')
                while True:
                    await resp.write(CHUNK)
            if h.mode == "not-utf8":
                await resp.write(_chunk("ok", 1).replace(b"ok", b"\xff\xfe\xfd"))
            for i, piece in enumerate(["one", " two", " three"], 1):
                await resp.write(_chunk(piece, i))
            last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        return resp

    @web.middleware
    async def cookies(request: web.Request, handler: Handler) -> web.StreamResponse:
        h.cookies_seen.append(request.headers.get("Cookie", ""))
        resp = await handler(request)
        if not resp.prepared:
            resp.set_cookie(f"s{len(h.cookies_seen)}", "c" * 3000, path="/")
        return resp

    a = web.Application(middlewares=[cookies] if h.mode == "cookies" else [])
    a.add_routes(
        [
            web.get("/health", health),
            web.get("/v1/models", models),
            web.get("/metrics", metrics),
            web.post("/tokenize", tokenize),
            web.post("/v1/chat/completions", chat),
        ]
    )
    return a


@contextlib.asynccontextmanager
async def serve(h: Hostile) -> AsyncIterator[str]:
    """The hostile engine on a free loopback port, on the running loop: its base URL."""
    if h.mode == "gzip-bomb":
        gzip_bomb()  # built before the probe's clock runs
    runner = web.AppRunner(app(h), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """The process's resident-set growth over a block, peak included: the kernel's high-water mark
    (VmHWM) is reset at the start (/proc/self/clear_refs 5) and read at the end, less VmRSS at the start.
    Where the reset is not allowed, ru_maxrss's growth (a lower bound of nothing: then 0 unless a new
    process-wide peak was set)."""

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self._hwm = True
        except OSError:
            self._hwm = False
            self._max0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._rss0 = _status_kb("VmRSS")
        self.growth_mb = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hwm:
            self.growth_mb = (_status_kb("VmHWM") - self._rss0) / 1024
        else:
            self.growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self._max0) / 1024

"""Bounds on everything the probe reads from an engine or Prometheus, and the reply snippets it copies out.

One engine, or one tenant's endpoint, must not be able to hurt the operator, which serves every namespace
from one process (512 Mi limit): a reply is read through httpx's streaming API with a running total and
refused past its route's cap, every read has a total deadline (a trickle of one byte every few seconds
passes every per-read timeout), JSON is refused before the decoder recurses too deep or meets bytes that
are not UTF-8, and a snippet of a reply that goes to status, Events or the log is short and never holds
the API key or a bearer token. Each refusal is a ProbeFailure with a reason of its own (errors.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import zlib
from collections.abc import Mapping
from typing import Any, Final

import httpx

from servedmodel.wire.http11 import LeanClient, LeanHeaders, LeanResponse

from . import errors
from .errors import ProbeFailure, snippet

KIB: Final = 1024
MIB: Final = 1024 * KIB

# Per-route body caps. The largest honest answers, measured or read from vLLM 0.33: /v1/models lists a
# few models with their permission objects (a few KiB even with hundreds of LoRA adapters), /tokenize
# returns token ids and strings of the probe's short prompt (a few KiB), error bodies are one JSON object;
# 1 MiB is far above all of them. vLLM's /metrics is about 40 KiB per model and engine (histogram buckets
# included); 16 MiB leaves room for hundreds of LoRA adapters or data-parallel engines on one pod. A
# Prometheus instant vector of the probe's queries has a few dozen series: 4 MiB.
MODELS_MAX_BYTES: Final = 1 * MIB
ERROR_BODY_MAX_BYTES: Final = 1 * MIB
TOKENIZE_MAX_BYTES: Final = 1 * MIB
CHAT_MAX_BYTES: Final = 1 * MIB  # a non-streamed chat answer (the learned stop, the oversized prompt)
METRICS_MAX_BYTES: Final = 16 * MIB
PROMETHEUS_MAX_BYTES: Final = 4 * MIB
# One SSE line: vLLM's chunk with continuous usage stats is about 300 bytes; a chunk of a slow client
# catching up can carry many tokens, still far under 64 KiB.
SSE_LINE_MAX_BYTES: Final = 64 * KIB
# A stream of max_tokens tokens: its text is at most ~4 bytes a token (the longest tokens of Qwen's and
# Llama's vocabularies are a few dozen bytes; 64 is generous), its bytes on the wire at most ~2 KiB a
# token (a chunk per token with id, model name, usage; logprobs are not asked for), and its events at most
# one per token plus the role, finish, usage and [DONE] events. The slack covers what does not scale.
STREAM_TEXT_BYTES_PER_TOKEN: Final = 64
STREAM_WIRE_BYTES_PER_TOKEN: Final = 2 * KIB
STREAM_SLACK_BYTES: Final = 64 * KIB
STREAM_SLACK_EVENTS: Final = 64
# JSON nesting: vLLM's deepest answer (/v1/models' permission list) is 4 levels; json.loads recurses per
# level and 100,000 levels raise RecursionError, not a probe failure.
JSON_MAX_DEPTH: Final = 64
# The whole probe cycle of one model, over all its requests (chat, metrics before and after, the limits
# and learned-stop requests): a model whose timeout and firstByteTimeout are both 600 s cannot hold a
# probe slot for half an hour. The chat phase keeps spec.timeout; what follows it shares one more
# spec.timeout; and neither passes this (OperatorConfig has no field for it yet).
CYCLE_BUDGET_MAX_S: Final = 300.0
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def stream_caps(max_tokens: int) -> tuple[int, int, int]:
    """(text bytes, wire bytes, events) a stream of max_tokens tokens may have."""
    n = max(1, max_tokens)
    return (
        n * STREAM_TEXT_BYTES_PER_TOKEN + STREAM_SLACK_BYTES,
        n * STREAM_WIRE_BYTES_PER_TOKEN + STREAM_SLACK_BYTES,
        2 * n + STREAM_SLACK_EVENTS,
    )


def too_deep(body: bytes, limit: int = JSON_MAX_DEPTH) -> bool:
    """Does this JSON nest arrays/objects deeper than `limit`? Linear time, no recursion: strings go,
    everything but brackets goes, then `limit` rounds each remove the innermost pairs; a pair left after
    them was deeper. (An unbalanced body is left to the decoder to refuse.)"""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    rest = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        shorter = rest.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == rest:
            return False
        rest = shorter
    return b"[]" in rest or b"{}" in rest


def loads(body: bytes, step: str) -> Any:
    """JSON of an engine or Prometheus answer: UTF-8 (RFC 8259), at most JSON_MAX_DEPTH deep; every
    refusal a ProbeFailure with its own reason."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProbeFailure(
            errors.INVALID_ENCODING, f"{step}: the answer is not UTF-8 (byte {exc.start})"
        ) from None
    if too_deep(body):
        raise ProbeFailure(
            errors.RESPONSE_TOO_DEEP, f"{step}: JSON nested deeper than {JSON_MAX_DEPTH} levels"
        )
    try:
        return json.loads(text)
    except RecursionError:  # belt and braces: too_deep is the rule
        raise ProbeFailure(errors.RESPONSE_TOO_DEEP, f"{step}: JSON nested too deep") from None
    except ValueError:
        raise ProbeFailure(
            errors.MALFORMED_RESPONSE, f"{step}: body is not JSON: {snippet(text, limit=80)!r}"
        ) from None


def decode_text(body: bytes, step: str) -> str:
    """A text answer (Prometheus exposition: UTF-8) or InvalidEncoding."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProbeFailure(
            errors.INVALID_ENCODING, f"{step}: the answer is not UTF-8 (byte {exc.start})"
        ) from None


async def read_capped(response: httpx.Response | LeanResponse, cap: int, step: str) -> bytes:
    """The body of a streamed response, at most `cap` bytes; more is ResponseTooLarge and the connection is
    dropped, not drained. Read raw (the probe asks for identity); a compressed answer sent anyway is
    inflated here with its output bounded by `cap` too, never whole (httpx's own decoder inflates each
    read at once: a 64 KiB read of a gzip bomb can become 64 MB)."""
    if isinstance(response, httpx.Response) and response.is_stream_consumed:
        # An event hook of the caller's client read it already (httpx decoded it, whole): bounded after
        # the fact, as it is. The probe's own clients have no such hook.
        if len(response.content) > cap:
            raise ProbeFailure(errors.RESPONSE_TOO_LARGE, f"{step}: answer longer than {cap} bytes")
        return response.content
    buf = bytearray()
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ProbeFailure(errors.RESPONSE_TOO_LARGE, f"{step}: Content-Length {declared} > {cap} bytes")
    async for chunk in response.aiter_raw():
        buf += chunk
        if len(buf) > cap:
            raise ProbeFailure(errors.RESPONSE_TOO_LARGE, f"{step}: answer longer than {cap} bytes")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return bytes(buf)
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise ProbeFailure(errors.MALFORMED_RESPONSE, f"{step}: Content-Encoding {encoding!r} not supported")
    wbits = 16 + zlib.MAX_WBITS if "gzip" in encoding else zlib.MAX_WBITS
    try:
        inflater = zlib.decompressobj(wbits)
        out = inflater.decompress(bytes(buf), cap + 1)
    except zlib.error:
        raise ProbeFailure(
            errors.MALFORMED_RESPONSE, f"{step}: the {encoding} body does not inflate"
        ) from None
    if len(out) > cap or inflater.unconsumed_tail:
        raise ProbeFailure(errors.RESPONSE_TOO_LARGE, f"{step}: answer inflates past {cap} bytes")
    return out


class Reply:
    """A whole (bounded) answer: status, headers and body bytes."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status_code: int, headers: httpx.Headers | LeanHeaders, body: bytes) -> None:
        self.status_code, self.headers, self.body = status_code, headers, body


@functools.lru_cache(maxsize=4096)
def parsed_url(text: str) -> httpx.URL:
    """An engine's URL parsed once: httpx checks a str URL's every character on each request; the probe
    asks the same few paths of each engine every cycle."""
    return httpx.URL(text)


def lean_of(client: httpx.AsyncClient, url: str | httpx.URL) -> tuple[LeanClient, httpx.URL] | None:
    """The client and the parsed URL where a request to `url` can skip httpx's client layer
    (http11.LeanClient), else None."""
    if not isinstance(client, LeanClient) or client.lean is None:
        return None
    target = url if isinstance(url, httpx.URL) else parsed_url(url)
    return (client, target) if client.lean_for(target) else None


def json_bytes(body: Any) -> bytes:
    """A JSON request body as httpx encodes one (compact, UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


async def request(
    client: httpx.AsyncClient,
    method: str,
    url: str | httpx.URL,
    step: str,
    *,
    cap: int,
    deadline_s: float,
    headers: Mapping[str, str] | None = None,
    json_body: Any = None,
    params: Mapping[str, str] | None = None,
    read_limits: httpx.Timeout | None = None,
) -> Reply:
    """One non-streamed request whose whole answer (headers and body) must come within `deadline_s`
    (DeadlineExceeded) and hold at most `cap` bytes (ERROR_BODY_MAX_BYTES for a non-2xx answer);
    transport errors are classified as the probe's others."""
    sent = {"Accept-Encoding": "identity", **(headers or {})}
    lean = lean_of(client, url) if params is None else None
    kwargs: dict[str, Any] = {"headers": sent, "params": params}
    if json_body is not None:
        kwargs["json"] = json_body
    if read_limits is not None:
        kwargs["timeout"] = read_limits
    try:
        async with asyncio.timeout(deadline_s):
            if lean is not None:
                body = None if json_body is None else json_bytes(json_body)
                answer = await lean[0].lean_stream(method, lean[1], sent, body, read_limits)
                try:
                    return await _whole(answer, cap, step)
                finally:
                    await answer.aclose()
            async with client.stream(method, url, **kwargs) as r:
                return await _whole(r, cap, step)
    except TimeoutError:
        raise ProbeFailure(
            errors.DEADLINE_EXCEEDED, f"{step}: the whole answer did not come within {deadline_s:g} s"
        ) from None
    except httpx.TransportError as exc:
        raise errors.classify_transport_error(exc, step) from None


async def _whole(r: httpx.Response | LeanResponse, cap: int, step: str) -> Reply:
    limit = cap if 200 <= r.status_code < 300 else min(cap, ERROR_BODY_MAX_BYTES)
    body = await read_capped(r, limit, step)
    return Reply(r.status_code, r.headers, body)

"""Why a probe failed: one CamelCase reason per failure mode, and the mapping from httpx's exceptions.

A failed probe is data (Serving=False with its reason), never an exception that escapes the cycle.
"""

from __future__ import annotations

import errno
import json
import re
import socket
from collections.abc import Iterable
from typing import Final

import httpx

# Reasons written to status.probe.reason and the Serving condition.
CONNECTION_REFUSED = "ConnectionRefused"
DNS_FAILURE = "DNSFailure"
CONNECT_TIMEOUT = "ConnectTimeout"
FIRST_BYTE_TIMEOUT = "FirstByteTimeout"
STREAM_STALLED = "StreamStalled"
PROBE_TIMEOUT = "ProbeTimeout"
CONNECTION_FAILED = "ConnectionFailed"
UNEXPECTED_STATUS = "UnexpectedStatus"
UNAUTHORIZED = "Unauthorized"
MODEL_NOT_SERVED = "ModelNotServed"
MALFORMED_RESPONSE = "MalformedResponse"
MALFORMED_STREAM = "MalformedStream"
STREAM_CUT = "StreamCut"
ENGINE_UNHEALTHY = "EngineUnhealthy"
NO_READY_ENDPOINTS = "NoReadyEndpoints"
NO_CONTENT = "NoContent"
SECRET_UNAVAILABLE = "SecretUnavailable"
PROMPT_TOO_LONG = "PromptTooLong"
# The operator's own making, not the engine's: its connection pool had no connection free in time.
PROBE_POOL_EXHAUSTED = "ProbePoolExhausted"
# Bounds on what an engine may send (bounds.py): a hostile or broken engine fails its own probe.
RESPONSE_TOO_LARGE = "ResponseTooLarge"  # a body or an SSE line over its route's cap
STREAM_TOO_LONG = "StreamTooLong"  # a stream with more text, bytes or events than max_tokens allow
RESPONSE_TOO_DEEP = "ResponseTooDeep"  # JSON nested deeper than bounds.JSON_MAX_DEPTH
INVALID_ENCODING = "InvalidEncoding"  # bytes that are not UTF-8 where JSON or exposition text is due
DEADLINE_EXCEEDED = "DeadlineExceeded"  # a whole answer not in within its deadline (a trickle)
SERVING = "Serving"


# Snippets of engine replies in status, Events and logs: short, and never the API key or a bearer token.
SNIPPET_MAX_CHARS: Final = 300
REDACTED: Final = "[REDACTED]"
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` without the given secrets and without any `Bearer <token>`."""
    for s in secrets:
        if s:
            text = text.replace(s, REDACTED)
    return _BEARER.sub(lambda m: m.group(1) + REDACTED, text)


def snippet(text: str | bytes, secrets: Iterable[str | None] = (), limit: int = SNIPPET_MAX_CHARS) -> str:
    """A bounded, redacted piece of a reply for status, Events and logs (bytes decode with replacement).
    Redacted before it is cut, so no cut leaves a prefix of a secret behind."""
    head = text[: limit * 4]
    as_text = head.decode("utf-8", "replace") if isinstance(head, bytes) else head
    return redact(as_text, secrets)[:limit]


class ProbeFailure(Exception):
    """A probe step failed for a known reason; `message` is safe to write to status (no secrets)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def _walk(exc: BaseException) -> list[BaseException]:
    """The exception and its causes/contexts, outermost first (httpx wraps the OS error)."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def classify_transport_error(
    exc: httpx.TransportError, step: str, *, streaming: bool = False
) -> ProbeFailure:
    """Map an httpx transport error to a reason; `step` names the request (e.g. 'GET /v1/models')."""
    chain = _walk(exc)
    if isinstance(exc, httpx.ConnectTimeout):
        return ProbeFailure(CONNECT_TIMEOUT, f"{step}: connect timed out")
    if isinstance(exc, httpx.ReadTimeout):
        if streaming:
            return ProbeFailure(STREAM_STALLED, f"{step}: no chunk within the read limit (stream stalled)")
        return ProbeFailure(FIRST_BYTE_TIMEOUT, f"{step}: no response within the first-byte limit")
    if isinstance(exc, httpx.PoolTimeout):
        return ProbeFailure(
            PROBE_POOL_EXHAUSTED, f"{step}: no connection of the probe's own pool free in time"
        )
    if isinstance(exc, httpx.TimeoutException):
        return ProbeFailure(PROBE_TIMEOUT, f"{step}: {type(exc).__name__}")
    if isinstance(exc, httpx.ConnectError):
        for e in chain:
            if isinstance(e, socket.gaierror):
                return ProbeFailure(DNS_FAILURE, f"{step}: name resolution failed ({e.strerror or e})")
            if isinstance(e, ConnectionRefusedError) or (
                isinstance(e, OSError) and e.errno == errno.ECONNREFUSED
            ):
                return ProbeFailure(CONNECTION_REFUSED, f"{step}: connection refused")
        text = str(exc).lower()
        if "name or service not known" in text or "name resolution" in text or "nodename" in text:
            return ProbeFailure(DNS_FAILURE, f"{step}: name resolution failed")
        if "refused" in text:
            return ProbeFailure(CONNECTION_REFUSED, f"{step}: connection refused")
        return ProbeFailure(CONNECTION_FAILED, f"{step}: {exc or type(exc).__name__}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
        if streaming:
            return ProbeFailure(STREAM_CUT, f"{step}: stream cut before [DONE] ({type(exc).__name__})")
        return ProbeFailure(CONNECTION_FAILED, f"{step}: connection closed ({type(exc).__name__})")
    return ProbeFailure(CONNECTION_FAILED, f"{step}: {type(exc).__name__}: {exc}")


def error_message_of(body: bytes, limit: int = SNIPPET_MAX_CHARS) -> str:
    """vLLM's error.message from a JSON error body, or the start of the body; short enough for status,
    and with any bearer token redacted (the caller redacts the API key it knows)."""
    try:
        doc = (
            json.loads(body) if len(body) <= 64 * 1024 and body.count(b"[") + body.count(b"{") <= 64 else None
        )
        msg = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
        if isinstance(msg, str):
            return snippet(msg, limit=limit)
        if isinstance(doc, dict) and isinstance(doc.get("message"), str):
            return snippet(str(doc["message"]), limit=limit)
    except (ValueError, AttributeError, RecursionError):
        pass
    return snippet(body, limit=limit)


def _over_context(message: str) -> bool:
    """vLLM's "maximum context length" refusal (parameter=input_tokens, or input_text before tokenizing)."""
    markers = ("maximum context length", "(parameter=input_tokens", "(parameter=input_text")
    return any(m in message for m in markers)


def classify_status(status: int, body: bytes, step: str) -> ProbeFailure:
    """A non-2xx answer: 404 on the model is ModelNotServed, 401/403 Unauthorized, else UnexpectedStatus."""
    detail = error_message_of(body)
    if status == 400 and _over_context(detail):
        # vLLM's own refusal of the probe's prompt: spec.probe.messages do not fit max_model_len.
        return ProbeFailure(PROMPT_TOO_LONG, f"{step}: HTTP 400: {detail}")
    if status == 404:
        return ProbeFailure(MODEL_NOT_SERVED, f"{step}: HTTP 404: {detail}")
    if status in (401, 403):
        return ProbeFailure(UNAUTHORIZED, f"{step}: HTTP {status}: {detail}")
    return ProbeFailure(UNEXPECTED_STATUS, f"{step}: HTTP {status}: {detail}")

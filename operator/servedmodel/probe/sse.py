"""Pure: decode a streamed chat completion (SSE) and accumulate its timing.

The network side feeds raw byte chunks with the monotonic time (ns) each was read; everything here is
deterministic so it is unit-tested with recorded-shaped streams.

Definitions (vllm-0.33.md, "Latency vocabulary"):
- TTFT: request sent -> first chunk carrying non-empty content.
- ITL: each gap between consecutive content chunks (one sample per gap).
- TPOT (vLLM's): (last content chunk - first content chunk) / (completion_tokens - 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import MALFORMED_STREAM, ProbeFailure


@dataclass
class SSEDecoder:
    """Incremental `text/event-stream` decoder: bytes in, complete `data` payloads out.

    Handles CRLF/LF, comment lines (':' keep-alives), multi-line data fields and events split
    across reads.
    """

    _buf: bytes = b""
    _data: list[str] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            raw, self._buf = self._buf[:nl], self._buf[nl + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue  # comment / keep-alive
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
            # event:, id:, retry: carry nothing the probe needs
        return out

    def close(self) -> list[str]:
        """End of stream: a last event without its blank line still counts."""
        out: list[str] = []
        if self._buf.strip():
            out.extend(self.feed(b"\n"))
        if self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out


@dataclass
class StreamTiming:
    """What one streamed chat completion did, on the client's monotonic clock (ns)."""

    sent_ns: int
    request_id: str | None = None  # the X-Request-Id sent (vLLM names the completion chatcmpl-<it>)
    headers_ns: int | None = None
    content_ns: list[int] = field(default_factory=list)
    last_event_ns: int | None = None
    done_ns: int | None = None
    content: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, int] | None = None
    events: int = 0

    @property
    def done(self) -> bool:
        return self.done_ns is not None

    @property
    def first_token_ns(self) -> int | None:
        return self.content_ns[0] if self.content_ns else None

    @property
    def last_token_ns(self) -> int | None:
        return self.content_ns[-1] if self.content_ns else None

    def on_event(self, data: str, t_ns: int) -> None:
        """One SSE data payload received at t_ns. Raises ProbeFailure(MalformedStream) on bad shapes."""
        self.last_event_ns = t_ns
        self.events += 1
        if data.strip() == "[DONE]":
            self.done_ns = t_ns
            return
        if self.done:
            raise ProbeFailure(MALFORMED_STREAM, "data after [DONE]")
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events} is not JSON: {data[:80]!r}") from exc
        if not isinstance(doc, dict):
            raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events} is not a JSON object")
        if "error" in doc:
            err = doc["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise ProbeFailure(MALFORMED_STREAM, f"error event in stream: {str(msg)[:200]}")
        choices = doc.get("choices")
        if not isinstance(choices, list):
            raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events} has no choices list")
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self.usage = _usage_of(usage)
        for choice in choices:
            if not isinstance(choice, dict):
                raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events}: choice is not an object")
            delta = choice.get("delta")
            if delta is not None and not isinstance(delta, dict):
                raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events}: delta is not an object")
            text = (delta or {}).get("content")
            if isinstance(text, str) and text:
                self.content += text
                self.content_ns.append(t_ns)
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
                sr = choice.get("stop_reason")
                self.stop_reason = sr if isinstance(sr, str | int) else None


def _usage_of(usage: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        v = usage.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            out[key] = v
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class ClientFigures:
    """Client latencies of one stream, ms (see the module docstring for the definitions)."""

    headers_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms: list[float]
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    e2e_ms: float | None
    completion_tokens: int | None


def client_figures(t: StreamTiming) -> ClientFigures:
    ms = 1e-6
    headers = (t.headers_ns - t.sent_ns) * ms if t.headers_ns is not None else None
    first, last = t.first_token_ns, t.last_token_ns
    ttft = (first - t.sent_ns) * ms if first is not None else None
    gaps = [(b - a) * ms for a, b in zip(t.content_ns, t.content_ns[1:], strict=False)]
    n = t.usage.get("completion_tokens") if t.usage else None
    if n is None:
        n = len(t.content_ns) or None
    tpot = None
    if first is not None and last is not None and n is not None and n > 1:
        tpot = (last - first) * ms / (n - 1)
    end = t.done_ns if t.done_ns is not None else t.last_event_ns
    e2e = (end - t.sent_ns) * ms if end is not None else None
    return ClientFigures(
        headers_ms=headers,
        ttft_ms=ttft,
        tpot_ms=tpot,
        itl_ms=gaps,
        itl_p50_ms=percentile(gaps, 50),
        itl_p95_ms=percentile(gaps, 95),
        e2e_ms=e2e,
        completion_tokens=n,
    )

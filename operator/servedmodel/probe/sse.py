"""Pure: decode a streamed chat completion (SSE) and accumulate its timing.

The network side feeds raw byte chunks with the monotonic time (ns) each was read; everything here is
deterministic so it is unit-tested with recorded-shaped streams.

Definitions (vllm-0.33.md, "Latency vocabulary"):
- A token chunk: a streamed choice that carries generated tokens. vLLM sends one per engine step, also
  when its text is empty (a stop string's possible start is held back: `{"content": ""}`); only the role
  chunk that opens the stream carries none (it goes out with the first token's chunk).
- TTFT: request sent -> first token chunk (as `vllm bench serve`).
- TPOT (vLLM's): (last token chunk - first token chunk) / (completion_tokens - 1): tokens, not chunks.
  When the first chunk carried k tokens (continuous usage says so), the span covers n - k tokens.
- ITL: each gap between consecutive token chunks, per token: a chunk carrying k tokens (known from
  `continuous_usage_stats`) gives k samples of gap / k.
- bursts: token chunks arriving less than BURST_GAP_MS after the previous one belong to one burst; a
  live stream has one burst per chunk (an engine step is a millisecond or more), a stream held back and
  released at once has one for all of them (see `delivery`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .bounds import JSON_MAX_DEPTH, SSE_LINE_MAX_BYTES, too_deep
from .errors import (
    INVALID_ENCODING,
    MALFORMED_STREAM,
    RESPONSE_TOO_DEEP,
    RESPONSE_TOO_LARGE,
    ProbeFailure,
    snippet,
)

# Chunks closer than this came out of one buffer, not out of separate engine steps (the fastest decode
# steps take about a millisecond).
BURST_GAP_MS = 0.2


@dataclass
class SSEDecoder:
    """Incremental `text/event-stream` decoder: bytes in, complete `data` payloads out.

    Handles CRLF/LF, comment lines (':' keep-alives), multi-line data fields and events split
    across reads. Linear in the bytes fed: the buffer is a bytearray searched for a newline only from
    where the last search ended, and consumed lines are cut off once per feed. A line longer than
    `max_line` bytes (or an event whose data lines add up to more) is ResponseTooLarge; a line that is
    not UTF-8 is InvalidEncoding.
    """

    max_line: int = SSE_LINE_MAX_BYTES
    _buf: bytearray = field(default_factory=bytearray)
    _scanned: int = 0  # bytes of _buf known to hold no newline
    _data: list[str] = field(default_factory=list)
    _data_bytes: int = 0

    def feed(self, chunk: bytes) -> list[str]:
        buf = self._buf
        buf += chunk
        out: list[str] = []
        start = 0
        while True:
            nl = buf.find(b"\n", max(start, self._scanned))
            if nl < 0:
                break
            self._line(bytes(buf[start:nl]), out)
            start = nl + 1
            self._scanned = start
        if start:
            del buf[:start]
        self._scanned = len(buf)
        if len(buf) > self.max_line:
            raise ProbeFailure(RESPONSE_TOO_LARGE, f"an SSE line longer than {self.max_line} bytes")
        return out

    def _line(self, raw: bytes, out: list[str]) -> None:
        if len(raw) > self.max_line:
            raise ProbeFailure(RESPONSE_TOO_LARGE, f"an SSE line longer than {self.max_line} bytes")
        try:
            line = raw.rstrip(b"\r").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProbeFailure(INVALID_ENCODING, f"an SSE line is not UTF-8 (byte {exc.start})") from None
        if line == "":
            if self._data:
                out.append("\n".join(self._data))
                self._data, self._data_bytes = [], 0
            return
        if line.startswith(":"):
            return  # comment / keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_bytes += len(raw)
            if self._data_bytes > self.max_line:
                raise ProbeFailure(RESPONSE_TOO_LARGE, f"an SSE event longer than {self.max_line} bytes")
            self._data.append(value)
        # event:, id:, retry: carry nothing the probe needs

    def close(self) -> list[str]:
        """End of stream: a last event without its blank line still counts."""
        out: list[str] = []
        if bytes(self._buf).strip():
            out.extend(self.feed(b"\n"))
        if self._data:
            out.append("\n".join(self._data))
            self._data, self._data_bytes = [], 0
        return out


@dataclass
class StreamTiming:
    """What one streamed chat completion did, on the client's monotonic clock (ns)."""

    sent_ns: int
    request_id: str | None = None  # the X-Request-Id sent (vLLM names the completion chatcmpl-<it>)
    headers_ns: int | None = None
    content_ns: list[int] = field(default_factory=list)  # chunks with non-empty text
    token_ns: list[int] = field(default_factory=list)  # chunks carrying tokens (see the module doc)
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens per token chunk, if reported
    last_event_ns: int | None = None
    done_ns: int | None = None
    content: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, int] | None = None
    events: int = 0
    _cum_tokens: int = 0  # completion_tokens of the last continuous-usage chunk

    @property
    def done(self) -> bool:
        return self.done_ns is not None

    @property
    def first_token_ns(self) -> int | None:
        return self.token_ns[0] if self.token_ns else None

    @property
    def last_token_ns(self) -> int | None:
        return self.token_ns[-1] if self.token_ns else None

    @property
    def bursts(self) -> int:
        """Groups of token chunks that arrived back to back (under BURST_GAP_MS apart)."""
        if not self.token_ns:
            return 0
        gap = int(BURST_GAP_MS * 1e6)
        return 1 + sum(1 for a, b in zip(self.token_ns, self.token_ns[1:], strict=False) if b - a >= gap)

    def on_event(self, data: str, t_ns: int) -> None:
        """One SSE data payload received at t_ns. Raises ProbeFailure(MalformedStream) on bad shapes."""
        self.last_event_ns = t_ns
        self.events += 1
        if data.strip() == "[DONE]":
            self.done_ns = t_ns
            return
        if self.done:
            raise ProbeFailure(MALFORMED_STREAM, "data after [DONE]")
        if data.count("[") + data.count("{") > JSON_MAX_DEPTH and too_deep(data.encode()):
            raise ProbeFailure(
                RESPONSE_TOO_DEEP, f"chunk {self.events}: JSON nested deeper than {JSON_MAX_DEPTH}"
            )
        try:
            doc = json.loads(data)
        except RecursionError:
            raise ProbeFailure(RESPONSE_TOO_DEEP, f"chunk {self.events}: JSON nested too deep") from None
        except ValueError as exc:
            raise ProbeFailure(
                MALFORMED_STREAM, f"chunk {self.events} is not JSON: {snippet(data, limit=80)!r}"
            ) from exc
        if not isinstance(doc, dict):
            raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events} is not a JSON object")
        if "error" in doc:
            err = doc["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise ProbeFailure(MALFORMED_STREAM, f"error event in stream: {snippet(str(msg), limit=200)}")
        choices = doc.get("choices")
        if not isinstance(choices, list):
            raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events} has no choices list")
        usage = doc.get("usage")
        chunk_usage = _usage_of(usage) if isinstance(usage, dict) else None
        if chunk_usage is not None:
            self.usage = chunk_usage
        for choice in choices:
            if not isinstance(choice, dict):
                raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events}: choice is not an object")
            delta = choice.get("delta")
            if delta is not None and not isinstance(delta, dict):
                raise ProbeFailure(MALFORMED_STREAM, f"chunk {self.events}: delta is not an object")
            d = delta or {}
            text = d.get("content")
            if isinstance(text, str) and text:
                self.content += text
                self.content_ns.append(t_ns)
            cum = chunk_usage.get("completion_tokens") if chunk_usage else None
            if cum is not None:  # continuous usage stats: exactly how many tokens this chunk carries
                if cum > self._cum_tokens:
                    self.token_ns.append(t_ns)
                    self.chunk_tokens.append(cum - self._cum_tokens)
                    self._cum_tokens = cum
            elif _carries_tokens(d):
                self.token_ns.append(t_ns)
                self.chunk_tokens.append(None)
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
                sr = choice.get("stop_reason")
                self.stop_reason = sr if isinstance(sr, str | int) else None


def _carries_tokens(delta: dict[str, Any]) -> bool:
    """A choice with generated tokens, without usage to say so: any delta but the role chunk that opens
    the stream and an empty `{}` (a finish chunk of a server that sends no token with it)."""
    filled = {k for k, v in delta.items() if v not in (None, "", [])}
    if filled - {"role"}:
        return True  # text, reasoning or tool-call deltas
    return "role" not in delta and "content" in delta  # {"content": ""}: a token held back


def _usage_of(usage: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        v = usage.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            out[key] = v
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool):
        out["cached_tokens"] = cached  # vLLM with --enable-prompt-tokens-details
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
    token_chunks: int = 0
    bursts: int = 0
    decode_ms: float | None = None  # first -> last token chunk
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where served


def client_figures(t: StreamTiming) -> ClientFigures:
    ms = 1e-6
    headers = (t.headers_ns - t.sent_ns) * ms if t.headers_ns is not None else None
    first, last = t.first_token_ns, t.last_token_ns
    ttft = (first - t.sent_ns) * ms if first is not None else None
    gaps: list[float] = []
    for i in range(1, len(t.token_ns)):
        gap = (t.token_ns[i] - t.token_ns[i - 1]) * ms
        k = t.chunk_tokens[i] if i < len(t.chunk_tokens) else None
        k = k if k is not None and k > 0 else 1
        gaps.extend([gap / k] * k)  # per token: a chunk of k tokens spans k inter-token gaps
    n = t.usage.get("completion_tokens") if t.usage else None
    if n is None:
        n = len(t.token_ns) or None
    tpot = None
    decode = (last - first) * ms if first is not None and last is not None else None
    k_first = t.chunk_tokens[0] if t.chunk_tokens and t.chunk_tokens[0] else 1
    if decode is not None and n is not None and n - k_first > 0:
        tpot = decode / (n - k_first)  # the tokens that came after the first chunk
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
        token_chunks=len(t.token_ns),
        bursts=t.bursts,
        decode_ms=decode,
        cached_tokens=t.usage.get("cached_tokens") if t.usage else None,
    )


# A stream counts as delivered in lumps when the client saw decode take less than LUMP_SHARE of the time
# the server says it took; without server figures, when all its tokens came in one burst, or its chunks in
# at most one burst per LUMP_CHUNKS chunks (vLLM writes a chunk per engine step, each its own burst).
LUMP_MIN_TOKENS = 3
LUMP_CHUNKS = 4
LUMP_SHARE = 0.5
LUMP_MIN_SERVER_DECODE_MS = 2.0


@dataclass(frozen=True)
class Delivery:
    """Was the stream delivered as it was generated, or in lumps (a starved client, a buffering proxy,
    an overloaded API server)? A lumped stream's TTFT and TPOT are not what the engine did."""

    coalesced: bool
    tokens: int
    chunks: int
    bursts: int
    client_decode_ms: float | None
    server_decode_ms: float | None
    server_tpot_ms: float | None

    def describe(self) -> str:
        parts = [f"{self.tokens} tokens in {self.chunks} chunks, {self.bursts} bursts"]
        if self.client_decode_ms is not None:
            parts.append(f"first -> last token {self.client_decode_ms:.2f} ms on the client")
        if self.server_decode_ms is not None:
            srv = f"server decode {self.server_decode_ms:.2f} ms"
            if self.server_tpot_ms is not None:
                srv += f" (TPOT {self.server_tpot_ms:.2f} ms)"
            parts.append(srv)
        return ", ".join(parts)


def delivery(
    f: ClientFigures, server_decode_ms: float | None = None, server_tpot_ms: float | None = None
) -> Delivery:
    """Judge one stream's delivery. Server figures (isolated window means) sharpen it where known."""
    n = f.completion_tokens or 0
    lumped = False
    if n < LUMP_MIN_TOKENS:
        pass
    elif (
        server_decode_ms is not None
        and server_decode_ms >= LUMP_MIN_SERVER_DECODE_MS
        and f.decode_ms is not None
    ):
        # The server's own decode time decides: a client that saw the tokens spread as the engine made
        # them measured something real, even if a busy engine made them in quick succession.
        lumped = f.decode_ms < LUMP_SHARE * server_decode_ms
    elif f.bursts > 0:
        lumped = f.bursts == 1 or f.bursts * LUMP_CHUNKS <= f.token_chunks
    return Delivery(lumped, n, f.token_chunks, f.bursts, f.decode_ms, server_decode_ms, server_tpot_ms)


def lump_explained(d: Delivery, held_up_ms: float) -> bool:
    """Could the reader's own hold-ups (held_up_ms in all, between the request and the last token) have
    made this lump? With the server's decode time: yes when the client's decode plus the hold-ups reach
    the share a live stream shows (tokens that came while the reader was held up were read at once, so
    the hold-up is what the client's decode lost). Without it, any hold-up may have."""
    if not d.coalesced or held_up_ms <= 0:
        return False
    if (
        d.server_decode_ms is not None
        and d.server_decode_ms >= LUMP_MIN_SERVER_DECODE_MS
        and d.client_decode_ms is not None
    ):
        return d.client_decode_ms + held_up_ms >= LUMP_SHARE * d.server_decode_ms
    return True

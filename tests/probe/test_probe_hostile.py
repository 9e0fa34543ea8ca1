"""No engine can hurt the operator: each hostile mode of tests/probe/hostile_engine.py, probed through the
real probe code (run_probe with /metrics), ends as a ProbeFailure with a reason of its own, soon, with
the process's resident set (peak included) growing by less than 50 MB. bench/probe_hostile.py prints the
figures."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hostile_engine import Hostile, PeakRSS, serve

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import errors
from servedmodel.probe.client import PodMetrics, ProbeOutcome, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external

API_KEY = "sk-tenant-0123456789abcdef"
RSS_LIMIT_MB = 50.0
# Short limits: the old prober waited them out (or read everything); the bounded one ends sooner.
SPEC: dict[str, Any] = {
    "timeout": 8,
    "firstByteTimeout": 1,
    "checkLimits": False,
    "stop": [],
    "maxTokens": 16,
}


async def probe_hostile(h: Hostile) -> tuple[ProbeOutcome, float, float]:
    """(outcome, seconds, peak RSS growth in MB) of one probe of a hostile engine."""
    spec = ProbeSpec.model_validate(SPEC)
    async with serve(h) as url:
        target = resolve_external(url)
        async with probe_client(spec) as client:
            with PeakRSS() as rss:
                t0 = time.monotonic()
                out = await run_probe(
                    client,
                    target,
                    spec,
                    model="qwen",
                    api_key=API_KEY,
                    metrics=PodMetrics(client, target.metrics_urls, "qwen"),
                )
                took = time.monotonic() - t0
    return out, took, rss.growth_mb


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("huge-models", errors.RESPONSE_TOO_LARGE),
        ("endless-stream", errors.STREAM_TOO_LONG),
        ("deep-json", errors.RESPONSE_TOO_DEEP),
        ("trickle", errors.DEADLINE_EXCEEDED),
        ("not-utf8", errors.INVALID_ENCODING),
        ("endless-line", errors.RESPONSE_TOO_LARGE),
        ("gzip-bomb", errors.RESPONSE_TOO_LARGE),
    ],
)
async def test_hostile_engine_fails_its_own_probe_in_bounded_memory(mode: str, reason: str) -> None:
    # one byte every 0.5 s passes the 1 s per-read limit; the whole answer's 2 s deadline ends it
    out, took, growth = await probe_hostile(Hostile(mode, trickle_s=0.5))
    assert out.failure is not None, mode
    assert out.failure.reason == reason, out.failure
    assert took < 6, took  # before the cycle's own 8 s timeout: the bound, not the timeout, ended it
    assert growth < RSS_LIMIT_MB, f"{mode}: RSS grew {growth:.1f} MB"
    assert len(out.failure.message) <= 500


async def test_huge_metrics_without_a_newline_costs_the_server_figures_only() -> None:
    out, took, growth = await probe_hostile(Hostile("huge-metrics"))
    assert out.failure is None, out.failure  # the chat itself succeeded
    assert out.metrics_failure is not None
    assert out.metrics_failure.reason == errors.RESPONSE_TOO_LARGE
    assert growth < RSS_LIMIT_MB, f"RSS grew {growth:.1f} MB"
    assert took < 6


async def test_an_echoed_api_key_never_leaves_the_probe() -> None:
    out, _, _ = await probe_hostile(Hostile("echo-key"))
    assert out.failure is not None
    assert out.failure.reason == errors.UNAUTHORIZED
    assert API_KEY not in out.failure.message
    assert "Bearer [REDACTED]" in out.failure.message


async def test_an_engines_cookies_are_never_sent_back() -> None:
    h = Hostile("cookies")
    out, _, _ = await probe_hostile(h)
    assert out.failure is None, out.failure
    assert len(h.cookies_seen) >= 4  # /v1/models, /tokenize, /metrics before and after, the chat...
    assert h.cookies_seen == [""] * len(h.cookies_seen)  # ...none carrying what an earlier answer set


def test_snippets_are_bounded_and_redacted() -> None:
    text = "x" * 290 + f" Authorization: Bearer {API_KEY} and again {API_KEY}"
    s = errors.snippet(text, (API_KEY,))
    assert len(s) <= errors.SNIPPET_MAX_CHARS
    assert API_KEY not in s
    assert API_KEY[:8] not in s  # redacted before the cut: no prefix of the key survives it
    assert errors.redact("token Bearer abc.def-ghi, next", ()) == "token Bearer [REDACTED], next"

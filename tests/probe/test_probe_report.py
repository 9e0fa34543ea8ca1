"""Outcome -> status.probe and conditions: rolling window, counter rates, SLO, transitions (pure)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from servedmodel.api.probe import ProbeCheck, ProbeSpec, ProbeStatus
from servedmodel.api.status import ServedModelStatus
from servedmodel.probe.client import ProbeOutcome
from servedmodel.probe.errors import CONNECTION_REFUSED, ProbeFailure
from servedmodel.probe.metrics import Histo, MetricsSnapshot, delta
from servedmodel.probe.report import build_status, handoff_ms, probe_conditions, slo_verdict
from servedmodel.probe.sse import StreamTiming, client_figures, delivery

T0 = datetime(2026, 11, 29, 19, 0, 0, tzinfo=UTC)


def snapshot(done: float, prompt: float, gen: float, queue_s: float, running: int = 1) -> MetricsSnapshot:
    return MetricsSnapshot(
        counters={"request_success": done, "prompt_tokens": prompt, "generation_tokens": gen},
        histograms={"queue": Histo(queue_s, done), "e2e": Histo(done * 0.1, done)},
        gauges={"running": running, "waiting": 2, "kv_cache_usage": 0.125},
    )


def outcome(ttft_ms: float, gap_ms: float, at: datetime, *, extra_done: int = 0) -> ProbeOutcome:
    t = StreamTiming(sent_ns=0, headers_ns=1_000_000)
    now = int(ttft_ms * 1e6)
    for i in range(4):
        t.on_event(f'{{"choices":[{{"index":0,"delta":{{"content":"w{i} "}}}}]}}', now)
        now += int(gap_ms * 1e6)
    t.on_event('{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"five"}]}', now)
    t.on_event('{"choices":[],"usage":{"prompt_tokens":31,"completion_tokens":4,"total_tokens":35}}', now)
    t.on_event("[DONE]", now)
    before = snapshot(10, 1000, 200, 1.0)
    after = snapshot(11 + extra_done, 1031 + 50 * extra_done, 204 + 9 * extra_done, 1.002)
    out = ProbeOutcome(endpoint="http://127.0.0.1:1", started=at, ended=at, model="qwen", max_model_len=4096)
    out.timings = [t]
    out.figures = client_figures(t)
    out.before, out.after = before, after
    out.window = delta(before, after)
    out.isolated = extra_done == 0
    out.checks = {"template": ProbeCheck(result="Pass", reason="PromptTokensMatch")}
    return out


def failed(at: datetime) -> ProbeOutcome:
    out = ProbeOutcome(endpoint="http://127.0.0.1:1", started=at, ended=at)
    out.failure = ProbeFailure(CONNECTION_REFUSED, "GET /health: connection refused")
    return out


def test_success_fills_every_section() -> None:
    spec = ProbeSpec()
    st = build_status(outcome(20.0, 5.0, T0), spec, None)
    assert (st.result, st.reason) == ("Success", "Serving")
    assert st.client is not None
    assert st.client.ttft_ms == 20.0
    assert st.client.tpot_ms == 5.0
    assert st.server is not None
    assert st.server.isolated is True
    assert st.server.requests == 1
    assert st.server.queue_ms == pytest.approx(2.0)
    assert st.scheduler is not None
    assert (st.scheduler.running, st.scheduler.waiting) == (1, 2)
    assert st.usage is not None
    assert st.usage.total_tokens == 35
    assert st.finish_reason == "stop"
    assert st.window is not None
    assert st.window.samples == 1
    # The whole status validates as part of the CR's status (what the CRD schema is generated from).
    ServedModelStatus.model_validate({"probe": st.model_dump(by_alias=True, exclude_none=True)})


def test_shared_window_is_flagged() -> None:
    st = build_status(outcome(20.0, 5.0, T0, extra_done=2), ProbeSpec(), None)
    assert st.server is not None
    assert st.server.isolated is False
    assert st.server.requests == 3
    assert "window averages" in (st.message or "")


def test_window_rolls_and_survives_failures() -> None:
    spec = ProbeSpec(window=3)
    prev: ProbeStatus | None = None
    for i, ttft in enumerate([10.0, 20.0, 30.0, 40.0]):
        prev = build_status(outcome(ttft, 5.0, T0 + timedelta(seconds=60 * i)), spec, prev)
    assert prev is not None
    assert prev.window is not None
    assert prev.window.recent_ttft_ms == [20.0, 30.0, 40.0]
    assert prev.window.ttft_p50_ms == 30.0
    assert prev.window.ttft_p95_ms == pytest.approx(39.0)
    st = build_status(failed(T0 + timedelta(minutes=5)), spec, prev)
    assert (st.result, st.reason, st.consecutive_failures) == ("Failure", CONNECTION_REFUSED, 1)
    assert st.client is None
    assert st.server is None
    assert st.window == prev.window
    assert build_status(failed(T0 + timedelta(minutes=6)), spec, st).consecutive_failures == 2


def test_counter_rates_since_previous_probe() -> None:
    spec = ProbeSpec()
    first = build_status(outcome(10.0, 5.0, T0), spec, None)
    assert first.counters is not None
    assert first.counters.prompt_tokens_per_second is None
    second_out = outcome(10.0, 5.0, T0 + timedelta(seconds=10))
    second_out.after = snapshot(12, 1031 + 100, 204 + 50, 1.0)
    second = build_status(second_out, spec, first)
    assert second.counters is not None
    assert second.counters.prompt_tokens_per_second == pytest.approx(10.0)
    assert second.counters.generation_tokens_per_second == pytest.approx(5.0)


def test_slo_verdicts() -> None:
    assert slo_verdict(ProbeSpec(), None) is None
    spec = ProbeSpec.model_validate({"slo": {"ttftMs": 25, "tpotMs": 10}})
    st = build_status(outcome(20.0, 5.0, T0), spec, None)
    assert slo_verdict(spec, st.window) == ("True", "SLOMet", "every objective met at p95 over 1 probes")
    st = build_status(outcome(40.0, 5.0, T0), spec, st)
    verdict = slo_verdict(spec, st.window)
    assert verdict is not None
    assert verdict[:2] == ("False", "SLOMissed")
    assert "TTFT p95" in verdict[2]


def test_conditions_and_transition_times() -> None:
    spec = ProbeSpec.model_validate({"slo": {"e2eMs": 1000}})
    st = build_status(outcome(20.0, 5.0, T0), spec, None)
    conds = probe_conditions(st, spec, [], 3, T0)
    assert [(c.type, c.status, c.reason) for c in conds] == [
        ("Serving", "True", "ChatCompletionSucceeded"),
        ("TemplateOK", "True", "PromptTokensMatch"),
        ("LatencySLOMet", "True", "SLOMet"),
    ]
    assert all(c.observed_generation == 3 for c in conds)
    existing = [c.model_dump(by_alias=True, exclude_none=True) for c in conds]
    later = T0 + timedelta(minutes=1)
    st2 = build_status(failed(later), spec, st)
    conds2 = {c.type: c for c in probe_conditions(st2, spec, existing, 3, later)}
    assert conds2["Serving"].status == "False"
    assert conds2["Serving"].reason == CONNECTION_REFUSED
    assert conds2["Serving"].last_transition_time == "2026-11-29T19:01:00Z"
    # TemplateOK keeps its verdict (and time) while probes fail
    assert conds2["TemplateOK"].status == "True"
    assert conds2["TemplateOK"].last_transition_time == "2026-11-29T19:00:00Z"


def test_coalesced_stream_writes_no_ttft_tpot_itl() -> None:
    """A stream delivered in one lump: TPOT ~ 0 and TTFT ~ e2e would be lies; e2e and the door stay."""
    out = outcome(20.0, 0.01, T0)
    out.delivery = delivery(out.figures)  # type: ignore[arg-type]
    assert out.delivery.coalesced
    previous = build_status(outcome(20.0, 5.0, T0), ProbeSpec(), None)
    st = build_status(out, ProbeSpec(), previous)
    assert st.client is not None
    assert (st.client.ttft_ms, st.client.tpot_ms, st.client.itl_p50_ms, st.client.itl_p95_ms) == (None,) * 4
    assert st.client.e2e_ms is not None
    assert st.client.headers_ms == 1.0
    assert st.window is not None
    assert st.window.recent_ttft_ms == [20.0]  # the previous probe's only
    assert st.window.recent_tpot_ms == [5.0]
    assert len(st.window.recent_e2e_ms) == 2
    assert "lumps" in (st.message or "")


@pytest.mark.parametrize(
    ("first_token", "decode", "kept", "words"),
    [
        (False, True, {"ttft"}, "while the tokens came: TPOT/ITL not measured"),
        (True, True, set(), "before the first token was read: TTFT/TPOT not measured"),
        (True, False, set(), "before the first token was read: TTFT/TPOT not measured"),
        (False, False, {"ttft", "tpot", "itl"}, None),  # a stall after the last token takes nothing
    ],
)
def test_a_probe_loop_stall_takes_only_the_figures_it_overlapped(
    first_token: bool, decode: bool, kept: set[str], words: str | None
) -> None:
    """Read while the probe's own loop was stalled: a stall before the first token was read takes TTFT
    and TPOT (which runs from it), one while the tokens came only TPOT and ITL; the message names the
    garbage collector when a collection was inside the stall."""
    out = outcome(20.0, 5.0, T0)
    out.probe_stall_ms, out.probe_stall_first_token, out.probe_stall_decode = 193.0, first_token, decode
    out.probe_stall_gc = (190.2, 2)
    st = build_status(out, ProbeSpec(), None)
    assert st.client is not None
    figures = {"ttft": st.client.ttft_ms, "tpot": st.client.tpot_ms, "itl": st.client.itl_p50_ms}
    assert {k for k, v in figures.items() if v is not None} == kept
    assert st.client.e2e_ms is not None
    assert st.window is not None
    assert st.window.recent_ttft_ms == ([20.0] if "ttft" in kept else [])
    if words is None:
        assert "stalled" not in (st.message or "")
    else:
        assert words in (st.message or ""), st.message
        assert "held up 193.0 ms at once; Python's garbage collector, generation 2, 190.2 ms of it" in (
            st.message or ""
        )


def test_handoff_is_ttft_minus_queue_and_prefill() -> None:
    out = outcome(20.0, 5.0, T0)
    assert out.window is not None
    out.window = dataclasses.replace(
        out.window, phases_ms={"ttft": 14.0, "queue": 0.5, "prefill": 10.5, "decode": 18.0}
    )
    st = build_status(out, ProbeSpec(), None)
    assert st.server is not None
    assert st.server.handoff_ms == 3.0
    assert "handoff 3.0" in (st.message or "")
    assert handoff_ms({"ttft": 1.0, "queue": 0.6, "prefill": 0.6}) == 0.0  # rounding never goes negative
    assert handoff_ms({"ttft": 1.0}) is None


def test_cached_prompt_tokens_in_usage() -> None:
    out = outcome(20.0, 5.0, T0)
    out.cached_prompt_tokens = 16
    st = build_status(out, ProbeSpec(), None)
    assert st.usage is not None
    assert st.usage.cached_prompt_tokens == 16

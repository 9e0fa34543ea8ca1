"""Helpers of the probe's loopback tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from loopback import Prometheus
from servedmodel.sim.process import SimulatorProcess


def set_faults(sim: SimulatorProcess, **faults: Any) -> None:
    r = httpx.post(f"{sim.base_url}/admin/faults", json=faults, timeout=5)
    r.raise_for_status()


def reset_faults(sim: SimulatorProcess) -> None:
    # {"reset": true} leaves a swapped chat template in place; putting the default back is explicit
    set_faults(sim, reset=True)
    set_faults(sim, chat_template=None)


@contextlib.contextmanager
def engine_steps(sim: SimulatorProcess, step_ms: float) -> Iterator[None]:
    """The simulator's engine steps at `step_ms` inside the block, as it was after. A lump test's decode
    slow enough (16 tokens of 25 ms: ~375 ms) that no hold-up of a busy machine's test loop accounts for
    the lump (probe/sse.lump_explained)."""
    before = httpx.get(f"{sim.base_url}/admin/config", timeout=5).json()["step_base_ms"]
    httpx.post(f"{sim.base_url}/admin/config", json={"step_base_ms": step_ms}, timeout=5).raise_for_status()
    try:
        yield
    finally:
        httpx.post(f"{sim.base_url}/admin/config", json={"step_base_ms": before}, timeout=5)


class PrometheusServer(Prometheus):
    """Debian's prometheus on a free loopback port scraping the given targets, with these labels, every
    second."""

    def __init__(self, targets: list[str], labels: dict[str, str]) -> None:
        job = {"job_name": "engine", "static_configs": [{"targets": targets, "labels": labels}]}
        super().__init__([job], prefix="probe-prom-")

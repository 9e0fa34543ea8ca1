"""Fixtures of the simulator's tests: simulators as child processes on loopback, stopped by pid."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sim_support import BASE_ARGS, set_faults

from servedmodel.sim.process import SimulatorProcess


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorProcess]:
    with SimulatorProcess([*BASE_ARGS, "--sim-step-base-ms", "2"], ready_timeout=60) as s:
        yield s


@pytest.fixture
def faults(sim: SimulatorProcess) -> Iterator[SimulatorProcess]:
    """The module's simulator, faults reset before and after."""
    set_faults(sim, reset=True)
    yield sim
    set_faults(sim, reset=True)

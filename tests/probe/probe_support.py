"""Helpers of the probe's loopback tests (imported by conftest.py and the tests)."""

from __future__ import annotations

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


class PrometheusServer(Prometheus):
    """Debian's prometheus on a free loopback port scraping the given targets, with these labels, every
    second."""

    def __init__(self, targets: list[str], labels: dict[str, str]) -> None:
        job = {"job_name": "engine", "static_configs": [{"targets": targets, "labels": labels}]}
        super().__init__([job], prefix="probe-prom-")

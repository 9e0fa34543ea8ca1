"""Helpers of the probe's loopback tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from servedmodel.sim.process import SimulatorProcess, free_port

SIM_ARGS = [
    "Qwen/Qwen2.5-7B-Instruct",
    "--served-model-name",
    "qwen",
    "--max-model-len",
    "2048",
    "--sim-step-base-ms",
    "2",
]


def set_faults(sim: SimulatorProcess, **faults: Any) -> None:
    r = httpx.post(f"{sim.base_url}/admin/faults", json=faults, timeout=5)
    r.raise_for_status()


def reset_faults(sim: SimulatorProcess) -> None:
    # {"reset": true} leaves a swapped chat template in place; putting the default back is explicit
    set_faults(sim, reset=True)
    set_faults(sim, chat_template=None)


class PrometheusServer:
    """Debian's prometheus on a free loopback port scraping the given targets every second."""

    def __init__(self, targets: list[str], labels: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="probe-prom-"))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        label_lines = "".join(f"          {k}: {v}\n" for k, v in labels.items())
        (self.dir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
            "scrape_configs:\n  - job_name: engine\n    static_configs:\n"
            f"      - targets: [{', '.join(targets)}]\n        labels:\n{label_lines}"
        )
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready: {self.log_text()[-2000:]}")

    def log_text(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

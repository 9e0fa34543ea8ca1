"""Tools the tests and benches run on 127.0.0.1, each a process of its own in a temporary folder, stopped by
its pid: `LoopbackProcess` (the folder, the log, the stop) and `Prometheus` (Debian's prometheus on a free
port, scraping what it is given every second); and SIM_ARGS, the simulator most of those tests run.

    sys.path.insert(0, "hack")  # tests/conftest.py does this for every test
    from loopback import Prometheus, prometheus_missing
    prom = Prometheus([{"job_name": "engine", "static_configs": [{"targets": ["127.0.0.1:8000"]}]}])
    try:
        prom.wait_ready()
        prom.query("vllm:num_requests_running")
    finally:
        prom.stop()
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

from servedmodel.sim.ports import free_port

# A simulated Qwen2.5-7B served as "qwen" (max_model_len 2048) stepping every 2 ms: the engine the probe
# and simulator tests talk to (`SimulatorProcess(SIM_ARGS)`).
SIM_ARGS = [
    "Qwen/Qwen2.5-7B-Instruct",
    "--served-model-name",
    "qwen",
    "--max-model-len",
    "2048",
    "--sim-step-base-ms",
    "2",
]
PROMETHEUS_MISSING = "Debian's prometheus binary is not installed (apt-get install prometheus)"


def prometheus_missing() -> str | None:
    """Why Prometheus cannot run here (a skip reason), or None when it can."""
    return PROMETHEUS_MISSING if shutil.which("prometheus") is None else None


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL: only this process, by its pid."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout)


class LoopbackProcess:
    """A process with its own temporary folder (`dir`) and log file there; `stop` ends it by its pid and
    removes the folder."""

    def __init__(self, prefix: str, log_name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.log_path = self.dir / log_name
        self.log = self.log_path.open("wb")
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            args, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Prometheus(LoopbackProcess):
    """Debian's prometheus on a free loopback port, scraping `scrape_configs` (Prometheus' own
    scrape_configs entries) every second."""

    def __init__(self, scrape_configs: list[dict[str, Any]], prefix: str = "prometheus-") -> None:
        super().__init__(prefix, "prometheus.log")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": scrape_configs,
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.spawn(
            [
                "prometheus",
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ]
        )

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_text()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base_url}/-/ready", timeout=1, trust_env=False).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready: {self.log_text()[-2000:]}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.base_url}/api/v1/query", params={"query": promql}, timeout=5, trust_env=False)
        r.raise_for_status()
        return list(r.json()["data"]["result"])

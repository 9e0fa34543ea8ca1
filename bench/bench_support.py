"""What the operator benchmarks share: the operator as a subprocess on the local control plane, its
/metrics, a process's RSS and CPU from /proc, percentiles.

    with controlplane.running() as cp, SimulatorProcess(...) as sim:
        with OperatorProcess(cp, NAMESPACE, endpoint_override=sim.base_url) as op:
            before = scrape(op.metrics_port)
            ...
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack"))
import controlplane  # noqa: E402  (hack/ is tooling, not a package)

CRD = ROOT / "crds/inference.servedmodel.io_servedmodels.yaml"
Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, prefix: str = "servedmodel_") -> Metrics:
    """The operator's /metrics samples whose name starts with `prefix`. A patient read: a busy operator
    answers late (its metrics thread waits for the GIL)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith(prefix)
    }


def total(m: Metrics, name: str, **labels: str) -> float:
    """Sum of every sample called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Proc:
    """RSS and CPU seconds of one process from /proc (MiB, though named _mb). Its peak RSS is the kernel's
    high-water mark (VmHWM), read every second with `sample` and whenever asked: a 1 s sample of VmRSS
    missed a 10,000-ServedModel run's peak by 41 MiB (999 sampled, 1,040 by VmHWM)."""

    def __init__(self, pid: int, *, sample: bool = True) -> None:
        self.pid = pid
        self._max_rss_mb = 0.0
        self._stop = threading.Event()
        if sample:
            threading.Thread(target=self._sample, daemon=True).start()

    def _status_mib(self, field: str) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
        return 0.0

    def rss_mb(self) -> float:
        return self._status_mib("VmRSS")

    @property
    def max_rss_mb(self) -> float:
        """The peak RSS so far (VmHWM; the last one read once the process has exited)."""
        self._max_rss_mb = max(self._max_rss_mb, self._status_mib("VmHWM"))
        return self._max_rss_mb

    def cpu_s(self) -> float:
        """utime + stime."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            _ = self.max_rss_mb  # kept for after the process exits

    def stop(self) -> None:
        self._stop.set()


def prepare(cp: controlplane.ControlPlane, namespace: str) -> None:
    """The ServedModel CRD, established, and the benchmark's namespace."""
    cp.kubectl("apply", "--server-side", "-f", str(CRD))
    cp.wait_established("servedmodels.inference.servedmodel.io")
    cp.kubectl("create", "namespace", namespace)


class OperatorProcess:
    """`servedmodel run -n NAMESPACE` as a subprocess against `cp`, its probes sent to
    `endpoint_override` (SERVEDMODEL_ENDPOINT_OVERRIDE); healthy on enter, stopped by its pid on exit
    (SIGTERM, then SIGKILL after 15 s). `log`: a file for its output (else it is discarded);
    `memory_profile`: run it under tracemalloc, `snapshot_memory()` writes that file."""

    def __init__(
        self,
        cp: controlplane.ControlPlane,
        namespace: str,
        *,
        endpoint_override: str,
        log: Path | None = None,
        quiet: bool = False,
        healthy_timeout: float = 60.0,
        memory_profile: Path | None = None,
    ) -> None:
        self.cp, self.namespace, self.endpoint_override = cp, namespace, endpoint_override
        self.log, self.quiet, self.healthy_timeout = log, quiet, healthy_timeout
        self.memory_profile = memory_profile
        self.health_port, self.metrics_port = controlplane.free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> OperatorProcess:
        env = {
            **os.environ,
            **self.cp.env,
            "SERVEDMODEL_HEALTH_PORT": str(self.health_port),
            "SERVEDMODEL_METRICS_PORT": str(self.metrics_port),
            "SERVEDMODEL_ENDPOINT_OVERRIDE": self.endpoint_override,
            # /metrics without TokenReview/SubjectAccessReview: their API requests would be counted in
            # the figures the benches read from it (servedmodel_kube_api_requests).
            "SERVEDMODEL_METRICS_AUTH": "false",
        }
        command = [sys.executable, "-m", "servedmodel.cli", "run", "-n", self.namespace]
        if self.memory_profile is not None:  # tracemalloc; SIGUSR1 writes the file (bench/tracemalloc_run.py)
            env["TRACEMALLOC_OUT"] = str(self.memory_profile)
            command[1:3] = [str(Path(__file__).with_name("tracemalloc_run.py")), "servedmodel.cli"]
        command += ["--bind-address", "127.0.0.1", *(["-q"] if self.quiet else [])]
        out: Any = subprocess.DEVNULL
        if self.log is not None:
            out = self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.healthy_timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the operator did not become healthy") from None
                time.sleep(0.2)

    def snapshot_memory(self, timeout: float = 120.0) -> str:
        """With memory_profile: where the operator's memory is now (tracemalloc, by file and line)."""
        assert self.proc is not None
        assert self.memory_profile is not None
        self.memory_profile.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while not self.memory_profile.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)  # written at once, but let it finish
        return self.memory_profile.read_text() if self.memory_profile.exists() else "(no snapshot)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def print_rows(rows: list[tuple[str, str]], *, markdown: bool = False, title: str = "") -> None:
    """A two-column table: aligned text, or markdown (`title` heads the value column)."""
    if markdown:
        print(f"| {title} | |\n|---|---|")
        for key, value in rows:
            print(f"| {key} | {value} |")
        return
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")

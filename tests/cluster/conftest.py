"""The operator as a real process against the session's control plane.

`operator`: `servedmodel run` watching the test's namespace, started per test. `start_operator`: the
factory behind it (other namespaces, SERVEDMODEL_ENDPOINT_OVERRIDE, extra env). Each operator gets
free loopback ports for its liveness and metrics endpoints, logs to a file that is attached to a failed
test's report, and is stopped by its pid (SIGTERM, then SIGKILL) at teardown, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cluster_support
import pytest

import controlplane

ROOT = Path(__file__).resolve().parents[2]
# A bound on a stuck start, not a target: at load 29 on 2 cores one operator wrote no log line in 90 s.
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0
LOOPBACK_TARGETS = "*.svc,*.svc.cluster.local,127.0.0.1"
NO_ENGINE = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused at once
OPERATORS = pytest.StashKey[list["OperatorProcess"]]()


@dataclass
class OperatorProcess:
    """A running `servedmodel run`; its endpoints answer on 127.0.0.1."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    health_port: int
    metrics_port: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, tail: int | None = None) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-tail:] if tail else lines)

    def healthy(self) -> bool:
        """kopf's liveness endpoint answers 200."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def metrics(self) -> str:
        """The operator's /metrics text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5.0) as r:
            return str(r.read().decode())

    def stop(self) -> None:
        """SIGTERM (kopf stops gracefully), then SIGKILL; only this process, by its pid."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for i, op in enumerate(item.stash.get(OPERATORS, [])):
            report.sections.append((f"operator {i} log ({op.log_path})", op.log(tail=200)))


@pytest.fixture
def start_operator(
    control_plane: controlplane.ControlPlane, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., OperatorProcess]]:
    """Factory: start(namespaces=[...], endpoint_override=None, env=None) -> OperatorProcess (healthy).

    endpoint_override: SERVEDMODEL_ENDPOINT_OVERRIDE (a simulator's URL, or 'ns/name=URL,...');
    default NO_ENGINE, a closed loopback port.
    """
    started: list[OperatorProcess] = []
    request.node.stash[OPERATORS] = started

    def start(
        namespaces: list[str] | None = None,
        endpoint_override: str | None = None,
        env: dict[str, str] | None = None,
    ) -> OperatorProcess:
        health_port, metrics_port = controlplane.free_ports(2)
        log_path = tmp_path / f"operator-{len(started)}.log"
        environment = {
            **os.environ,
            "KUBECONFIG": str(control_plane.kubeconfig),
            "SERVEDMODEL_HEALTH_PORT": str(health_port),
            "SERVEDMODEL_METRICS_PORT": str(metrics_port),
            # The tests' engines listen on loopback: the allow-list must name it (servedmodel.access);
            # tests that scrape /metrics read it without a token (tests/cluster/test_security.py checks
            # the authenticated /metrics with the operator's default).
            "SERVEDMODEL_ALLOWED_TARGETS": LOOPBACK_TARGETS,
            "SERVEDMODEL_METRICS_AUTH": "false",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        # kwok's pods and the cluster's Service names exist nowhere (and resolving `*.svc` would ask
        # the host's non-loopback DNS server): unless a test points the probe at a real local engine,
        # it goes to a closed loopback port.
        environment["SERVEDMODEL_ENDPOINT_OVERRIDE"] = endpoint_override or NO_ENGINE
        args = [sys.executable, "-m", "servedmodel.cli", "run", "--bind-address", "127.0.0.1"]
        for ns in namespaces or []:
            args += ["--namespace", ns]
        if not namespaces:
            args.append("--all-namespaces")
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                args,
                env=environment,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        op = OperatorProcess(proc, log_path, health_port, metrics_port)
        started.append(op)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not op.healthy():
            if not op.alive():
                pytest.fail(
                    f"operator exited with {proc.returncode} before it was healthy:\n{op.log(tail=60)}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"operator not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{op.log(tail=60)}")
            time.sleep(0.2)
        return op

    try:
        yield start
    finally:
        for op in started:
            op.stop()


@pytest.fixture
def probing(
    control_plane: controlplane.ControlPlane, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> cluster_support.ProbingOperator:
    """The test's control plane and namespace, and `probing.start(name, url)`: the operator (healthy) on
    that namespace, probing ServedModel `name` at `url` through SERVEDMODEL_ENDPOINT_OVERRIDE."""

    def start(name: str, url: str) -> OperatorProcess:
        return start_operator(namespaces=[namespace], endpoint_override=f"{namespace}/{name}={url}")

    return cluster_support.ProbingOperator(control_plane, namespace, start)


@pytest.fixture
def operator(
    start_operator: Callable[..., OperatorProcess],
    namespace: str,
    control_plane: controlplane.ControlPlane,
) -> OperatorProcess:
    """`servedmodel run --namespace <the test's namespace>`, healthy.

    No finalizer holds ServedModels (the control loop runs no per-object kopf timers or daemons), so
    teardown needs nothing from the operator: the namespace fixture's delete takes everything with it.
    """
    return start_operator(namespaces=[namespace])

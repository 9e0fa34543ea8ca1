"""The e2e tier's cluster: hack/realnode.py's real node (containerd, runc, the CNI bridge, a kubelet and
kube-proxy) on a control plane of its own whose kube-apiserver listens on the node's bridge gateway
(realnode.start_cluster), so that pods reach it (in-cluster config through the `kubernetes` Service). For
tests marked `e2e`: here `bare_control_plane` and `control_plane` are that cluster's, not the worker's.
Built by `make test`'s node-or-skip (`make node`); when it is not built the tests skip naming `make node`,
or fail under SERVEDMODEL_REQUIRE_CLUSTER=1 (CI), as they do when the node does not start.

Under pytest-xdist every `e2e` test is in one group (tests/conftest.py), so one worker runs them one after
another on one cluster; it starts with the first of them and stops after the last (not at the end of the
worker's session), so the rest of that worker's tests do not share the two cores with it.
realnode.start_cluster() also holds a machine-wide lock: another run's node waits."""

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
from pathlib import Path

import pytest
import yaml

import controlplane
import realnode
from required import need

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
# The worker's cluster, started by the first `e2e` test that asks for it, and the failures before it.
_NODE: list[realnode.RealNode] = []
_FAILED_BEFORE: list[int] = []
_CRDS_IN: set[int] = set()


# An e2e test's own limit (pyproject's timeout is 300 s): the first one starts the cluster, waiting for the
# machine's lock while another run's node holds it (realnode.LOCK_WAIT_S), and one may import an image.
E2E_TIMEOUT_S = realnode.LOCK_WAIT_S + 600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


def real_node_missing() -> str | None:
    missing = realnode.missing_node_binaries()
    if not missing:
        return None
    return f"real node not built ({', '.join(missing)}); run `make node` (hack/build-node.sh)"


@pytest.fixture
def real_node(request: pytest.FixtureRequest) -> realnode.RealNode:
    need(real_node_missing())
    if not _NODE:
        _FAILED_BEFORE[:] = [request.session.testsfailed]
        _NODE.append(realnode.start_cluster())
    return _NODE[0]


@pytest.fixture
def bare_control_plane(real_node: realnode.RealNode) -> controlplane.ControlPlane:
    """The e2e cluster's control plane (kube-apiserver on realnode.GATEWAY)."""
    return real_node.cp


@pytest.fixture
def control_plane(bare_control_plane: controlplane.ControlPlane) -> controlplane.ControlPlane:
    """The same with every crds/*.yaml installed and Established (once per cluster)."""
    cp = bare_control_plane
    if id(cp) not in _CRDS_IN:
        crds = sorted(p for p in CRD_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
        cp.kubectl("apply", "--server-side", "--force-conflicts", *[a for p in crds for a in ("-f", str(p))])
        for path in crds:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    cp.wait_established(doc["metadata"]["name"])
        _CRDS_IN.add(id(cp))
    return cp


@pytest.fixture
def operator_log(
    control_plane: controlplane.ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[Callable[[], str]]:
    """`servedmodel run` for the test's namespace, allowed to reach the real node's pod CIDR, with no
    SERVEDMODEL_ENDPOINT_OVERRIDE: the probe goes to each engine pod's own IP. Stopped by its pid."""
    health, metrics = controlplane.free_ports(2)
    log_path = tmp_path / "operator.log"
    env = {k: v for k, v in os.environ.items() if k != "SERVEDMODEL_ENDPOINT_OVERRIDE"}
    env |= {
        "KUBECONFIG": str(control_plane.kubeconfig),
        "SERVEDMODEL_HEALTH_PORT": str(health),
        "SERVEDMODEL_METRICS_PORT": str(metrics),
        "SERVEDMODEL_ALLOWED_TARGETS": realnode.POD_CIDR,
        "SERVEDMODEL_METRICS_AUTH": "false",
        "PYTHONUNBUFFERED": "1",
    }
    args = [sys.executable, "-m", "servedmodel.cli", "run", "--bind-address", "127.0.0.1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*args, "--namespace", namespace],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def read_log() -> str:
        return log_path.read_text(errors="replace")[-20000:] if log_path.exists() else "(no log)"

    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"operator exited with {proc.returncode}:\n{read_log()}"
            assert time.monotonic() < deadline, f"operator not healthy after 90 s:\n{read_log()}"
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            time.sleep(0.2)
        yield read_log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def _stop_node(session: pytest.Session) -> None:
    while _NODE:
        node = _NODE.pop()
        node.keep_logs = bool(_FAILED_BEFORE) and session.testsfailed > _FAILED_BEFORE[0]
        _CRDS_IN.discard(id(node.cp))
        node.stop()
        if node.keep_logs:
            print(f"\ne2e cluster logs kept in {node.cp.log_dir}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's fixtures first (its namespace is deleted while the API server still listens)
    if nextitem is None or nextitem.get_closest_marker("e2e") is None:
        _stop_node(item.session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_node(session)  # an interrupted run

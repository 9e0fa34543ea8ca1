"""The real node (hack/realnode.py: containerd, runc, the CNI bridge and a kubelet) beside the session's
control plane, for tests marked `e2e`. Built by `make test`'s node-or-skip (`make node`); when it is not
built the tests skip naming `make node`, or fail under SERVEDMODEL_REQUIRE_CLUSTER=1 (CI), as they do
when the node does not start.

Under pytest-xdist every `e2e` test is in one group (tests/conftest.py), so one worker runs them one after
another on one node; the node starts with the first of them and stops after the last (not at the end of
the worker's session), so the rest of that worker's tests do not share the two cores with an idle
kubelet and containerd. realnode.start() also holds a machine-wide lock: another run's node waits."""

from __future__ import annotations

import pytest

import controlplane
import realnode
from required import need

# The worker's node, started by the first `e2e` test that asks for it.
_NODE: list[realnode.RealNode] = []


def real_node_missing() -> str | None:
    missing = realnode.missing_node_binaries()
    if not missing:
        return None
    return f"real node not built ({', '.join(missing)}); run `make node` (hack/build-node.sh)"


@pytest.fixture
def real_node(bare_control_plane: controlplane.ControlPlane) -> realnode.RealNode:
    need(real_node_missing())
    if _NODE and _NODE[0].cp is not bare_control_plane:
        _stop_node()
    if not _NODE:
        _NODE.append(realnode.start(bare_control_plane))
    return _NODE[0]


def _stop_node() -> None:
    while _NODE:
        _NODE.pop().stop()


@pytest.hookimpl(tryfirst=True)  # before the runner tears down the session's control plane
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or nextitem.get_closest_marker("e2e") is None:
        _stop_node()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_node()  # an interrupted run

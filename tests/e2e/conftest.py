"""The real node (hack/realnode.py: containerd, runc, the CNI bridge and a kubelet) beside the session's
control plane, for tests marked `e2e`. Skipped when its binaries are not built (`make node`).

Not part of the default run yet (`make test` does not build the node): the `e2e` tests are deselected
unless SERVEDMODEL_E2E=1 (`make e2e` sets it). They pass here, runs in a row (docs/control-plane.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import controlplane
import realnode
from required import need


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SERVEDMODEL_E2E") == "1":
        return
    deselected = [i for i in items if i.get_closest_marker("e2e")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if not i.get_closest_marker("e2e")]


def real_node_missing() -> str | None:
    missing = realnode.missing_node_binaries()
    if not missing:
        return None
    return f"real node not built ({', '.join(missing)}); run `make node` (hack/build-node.sh)"


@pytest.fixture(scope="session")
def real_node(bare_control_plane: controlplane.ControlPlane) -> Iterator[realnode.RealNode]:
    need(real_node_missing())
    node = realnode.start(bare_control_plane)
    try:
        yield node
    finally:
        node.stop()

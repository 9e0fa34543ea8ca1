"""Fixtures of the shipping tests: OLM's validator, built from the Go module proxy (hack/olm_tools.py).

The built-image tests (test_built_images.py, `make images`) are not in CI's `make test` yet: under
SERVEDMODEL_REQUIRE_CLUSTER=1, where no test may skip, they are deselected while this checkout's images
are not built, unless SERVEDMODEL_REQUIRE_IMAGES=1 asks for them (then a missing image fails them)."""

from __future__ import annotations

from pathlib import Path

import pytest

import images  # hack/ is on sys.path (tests/conftest.py)
import olm_tools
from required import REQUIRE_CLUSTER, absent, required

BUILT_IMAGE_TESTS = "test_built_images.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if required("SERVEDMODEL_REQUIRE_IMAGES") or not required(REQUIRE_CLUSTER):
        return
    if all(images.built(name) is not None for name in images.IMAGES):
        return
    deselected = [i for i in items if i.path.name == BUILT_IMAGE_TESTS]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if i.path.name != BUILT_IMAGE_TESTS]


@pytest.fixture(scope="session")
def operator_verify() -> Path:
    try:
        return olm_tools.operator_verify()
    except olm_tools.ToolUnavailable as exc:
        absent(f"OLM's bundle validator unavailable: {exc}")

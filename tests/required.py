"""`need(missing)` and `absent(missing)`: how a test reacts to a build or binary that is not here.

Locally a missing build (the control plane, prometheus-adapter, OLM's tools, Debian's prometheus, vLLM's
CPU environment) only skips the tests that need it, naming what is missing and how to build it. In CI
(.ci/run sets SERVEDMODEL_REQUIRE_CLUSTER=1 and SERVEDMODEL_REQUIRE_VLLM=1) it fails them instead, so the
suite cannot go green having run none of them. tests/conftest.py also turns every other skip into a
failure under SERVEDMODEL_REQUIRE_CLUSTER=1 (the backstop for a skip that does not come through here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE_CLUSTER = "SERVEDMODEL_REQUIRE_CLUSTER"  # the control plane and every tool beside it
REQUIRE_VLLM = "SERVEDMODEL_REQUIRE_VLLM"  # vLLM's CPU environment

TESTS = Path(__file__).resolve().parent


def lay_out_suite(tests: Path) -> None:
    """tests/conftest.py, every module beside it and hack/ (which it imports from), laid out under `tests`
    and beside it for a pytest run of its own (tests/test_required.py, tests/test_xdist_groups.py,
    tests/vllm/test_vllm_env.py). The conftest is copied, so that pytest roots it in `tests`; the other
    top-level modules are linked, every one of them, so a new one cannot be forgotten here."""
    tests.mkdir(parents=True, exist_ok=True)
    (tests.parent / "hack").symlink_to(TESTS.parent / "hack")
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    for module in TESTS.glob("*.py"):
        if module.name != "conftest.py" and not module.name.startswith("test_"):
            (tests / module.name).symlink_to(module)


def required(env: str = REQUIRE_CLUSTER) -> bool:
    return os.environ.get(env) == "1"


def need(missing: str | None, *, env: str = REQUIRE_CLUSTER) -> None:
    """Nothing when `missing` is None; else `absent(missing)`."""
    if missing is not None:
        absent(missing, env=env)


def absent(missing: str, *, env: str = REQUIRE_CLUSTER) -> NoReturn:
    """Skip naming what is missing, or fail naming it when `env` is 1."""
    if required(env):
        pytest.fail(f"{env}=1 (every tier is required) but {missing}", pytrace=False)
    pytest.skip(missing)

"""SERVEDMODEL_REQUIRE_CLUSTER=1 (set by .ci/run): a missing build fails the tests that need it, and no
test may skip. Run as a pytest of its own, with the suite's conftest and an empty cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from required import lay_out_suite

PROBES = """
import pytest

@pytest.mark.cluster
def test_needs_the_control_plane(namespace):
    pass

def test_skips_for_a_reason_of_its_own():
    pytest.skip("no reason to run")
"""


def run_pytest(tmp_path: Path, required: str) -> subprocess.CompletedProcess[str]:
    tests = tmp_path / "tests"
    lay_out_suite(tests)
    (tests / "test_probes.py").write_text(textwrap.dedent(PROBES))
    env = {
        **os.environ,
        "SERVEDMODEL_CACHE": str(tmp_path / "cache"),  # nothing built there
        "SERVEDMODEL_REQUIRE_CLUSTER": required,
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", str(tests)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_locally_a_missing_control_plane_skips_naming_it(tmp_path: Path) -> None:
    res = run_pytest(tmp_path, "0")
    assert "2 skipped" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 0, res.stdout
    assert "control plane not built" in res.stdout
    assert "make control-plane" in res.stdout


def test_required_a_missing_control_plane_fails_and_no_test_skips(tmp_path: Path) -> None:
    res = run_pytest(tmp_path, "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "skipped" not in res.stdout
    # The cluster test fails in its setup, naming the build and the variable; the other one's own skip
    # is turned into a failure by the backstop.
    assert "1 failed" in res.stdout, res.stdout
    assert "1 error" in res.stdout, res.stdout
    assert "SERVEDMODEL_REQUIRE_CLUSTER=1 (every tier is required) but control plane not built" in res.stdout
    assert "no test may skip (every tier is required), but: no reason to run" in res.stdout

"""`make test` runs the suite in pytest-xdist workers with --dist loadgroup, and tests/conftest.py puts
every `vllm`-marked test in one group, so that vLLM's CPU engines never start side by side. pytest 9.2
silently broke that grouping (pytest-dev/pytest-xdist#1386: the group suffix xdist writes into the node
id no longer takes), which pyproject.toml's pin keeps out; this test is what notices the next time. The
`e2e` tests share the one real node a machine can run (tests/e2e/conftest.py): one group too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from required import lay_out_suite

TESTS = """
import time

import pytest


@pytest.mark.MARKER
@pytest.mark.parametrize("i", range(4))
def test_engine(i):
    time.sleep(0.3)  # long enough that an idle worker would take the next one


@pytest.mark.parametrize("i", range(4))
def test_plain(i):
    time.sleep(0.3)
"""


@pytest.mark.parametrize("marker", ["vllm", "e2e"])
def test_every_vllm_or_e2e_test_runs_in_one_worker(tmp_path: Path, marker: str) -> None:
    tests = tmp_path / "tests"
    lay_out_suite(tests)
    (tests / "test_grouped.py").write_text(textwrap.dedent(TESTS).replace("MARKER", marker))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "-n",
            "3",
            "--dist",
            "loadgroup",
            "tests",
        ],
        cwd=tmp_path,
        env={**os.environ, "SERVEDMODEL_REQUIRE_CLUSTER": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ran = re.findall(r"\[(gw\d+)\] .*PASSED tests/test_grouped\.py::(test_\w+)\[", res.stdout)
    assert len(ran) == 8, res.stdout
    workers = sorted({worker for worker, test in ran if test == "test_engine"})
    assert len(workers) == 1, f"the {marker}-marked tests ran in {workers}:\n{res.stdout}"

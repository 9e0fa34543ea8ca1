"""Fixtures of the shipping tests: OLM's validator, built from the Go module proxy (hack/olm_tools.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import olm_tools
from required import absent


@pytest.fixture(scope="session")
def operator_verify() -> Path:
    try:
        return olm_tools.operator_verify()
    except olm_tools.ToolUnavailable as exc:
        absent(f"OLM's bundle validator unavailable: {exc}")

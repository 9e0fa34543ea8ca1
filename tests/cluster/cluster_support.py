"""Helpers shared by the cluster tests (test files are not a package; pytest puts this folder on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(
    what: str,
    probe: Callable[[], Any],
    timeout: float = 120.0,
    *,
    interval: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Poll `probe` until it returns something truthy and return it; fail naming `what` and the last value.

    `detail` adds context to the failure (e.g. the operator's log). A bounded wait, never a timing assertion.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail else ""
            pytest.fail(f"gave up after {timeout:.0f}s waiting for {what}; last seen: {last!r}{extra}")
        time.sleep(interval)

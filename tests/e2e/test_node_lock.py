"""One real node per machine: realnode's lock (the bridge, the pod CIDR, the kubepods cgroups are the
machine's). Another process holding it makes start() wait, then fail naming the holder; no node runs here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import controlplane
import realnode

HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"pid %d the other run\\n" % os.getpid(), 0)
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    """
)


def test_a_second_node_waits_for_the_first_and_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "real-node.lock"
    monkeypatch.setattr(realnode, "LOCK", lock)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), "30"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(controlplane.ControlPlaneError, match=f"pid {holder.pid} the other run"):
            realnode._take_lock(1.0, "this run")
        assert time.monotonic() - t0 >= 1.0  # it waited
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # Released when its holder died: taken at once, and names its new holder.
    fd = realnode._take_lock(0.0, "this run")
    try:
        assert lock.read_text() == f"pid {os.getpid()} this run\n"
    finally:
        os.close(fd)

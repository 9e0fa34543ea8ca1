"""A startup that fails (its health port taken by another process, as a CI run saw when an outgoing
connection's source port landed on it) stops what it had started, so kopf's next try (60 s later) binds
its ports again and starts: the operator's own startup and cleanup handlers, on the real control plane."""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.request

import kopf
import pytest

import controlplane
from servedmodel.config import OperatorConfig
from servedmodel.handlers.startup import cleanup, startup
from servedmodel.k8s import load_identity


def bindable(port: int) -> bool:
    """Whether a listener could bind `port` now, as the operator's next try does: with SO_REUSEADDR (as
    asyncio's and aiohttp's servers set it), so a /healthz connection left in TIME_WAIT on the port (the
    server closed first) does not count, and a socket still listening on it does (Linux refuses that)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def healthz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return int(r.status)


async def test_a_failed_startup_releases_its_ports_and_the_next_try_starts(
    control_plane: controlplane.ControlPlane,
) -> None:
    health_port, metrics_port = controlplane.free_ports(2)
    config = OperatorConfig(
        health_port=health_port, metrics_port=metrics_port, leader_election=False, metrics_auth=False
    )
    memo = kopf.Memo(config=config, bind_address="127.0.0.1")
    memo.identity = load_identity(str(control_plane.kubeconfig))
    log = logging.getLogger("test_startup_retry")
    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    thief.bind(("127.0.0.1", health_port))
    thief.listen()
    try:
        with pytest.raises(OSError, match="address already in use"):
            await startup(settings=kopf.OperatorSettings(), memo=memo, logger=log)
        assert bindable(metrics_port), "the failed try kept its metrics port"
        assert getattr(memo, "metrics_server", None) is None
        running = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("informer-")]
        assert not running, f"the failed try left its informers running: {running}"
    finally:
        thief.close()
    await startup(settings=kopf.OperatorSettings(), memo=memo, logger=log)
    try:
        for _ in range(600):
            try:
                if await asyncio.to_thread(healthz, health_port) == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the second try never answered /healthz")
        assert not bindable(metrics_port)
    finally:
        await cleanup(memo=memo)
    assert bindable(metrics_port)
    assert bindable(health_port)

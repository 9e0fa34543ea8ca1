"""Loopback ports for engines started by tests, benches and hack/ (standard library only, so that
hack/vllm_server.py can use it without the simulator's dependencies)."""

from __future__ import annotations

import http.client
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def health_status(port: int, timeout: float) -> int | None:
    """The status of GET /health on 127.0.0.1:port; None if nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def port_open(port: int, timeout: float) -> bool:
    """Whether 127.0.0.1:port accepts a connection."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False

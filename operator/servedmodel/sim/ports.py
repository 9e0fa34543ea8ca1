"""Loopback ports for engines started by tests, benches and hack/ (standard library only, so that
hack/vllm_server.py can use it without the simulator's dependencies)."""

from __future__ import annotations

import http.client
import random
import socket

# Listening ports are taken below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999
# by default). A port bind(0) hands out lies in that range, which is also where every outgoing connection
# gets its source port: on a busy machine a client connecting anywhere can take it before the server it
# was picked for binds it (a CI run's operator lost its health port so, and never started).
LISTEN_PORTS_BELOW_EPHEMERAL = 16384
_RNG = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that nothing listens on now, none in the ephemeral range."""
    high = _ephemeral_low()
    low = max(1024, high - LISTEN_PORTS_BELOW_EPHEMERAL)
    ports: list[int] = []
    for _ in range(100 * n):
        port = _RNG.randrange(low, high)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise OSError(f"no {n} free ports between {low} and {high} on 127.0.0.1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (free_ports)."""
    return free_ports(1)[0]


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

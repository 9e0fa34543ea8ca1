"""A TCP transport that tells its protocol when the kernel received each read: SO_TIMESTAMPNS.

Why: the probe times a stream by when its chunks arrive. Read on an event loop, "when" is when the loop
got to the read: after the thread was scheduled, after the GIL came back from the main thread (which parses
watch events and writes status), after the loop's other callbacks. At 1,000 ServedModels that added a p95
of 5-6 ms to the client's TTFT over the engine's own (1.6 ms for a lone model: issue 21). The kernel
stamps each received packet as it queues it on the socket; asked with SO_TIMESTAMPNS, recvmsg hands the
stamp of the newest packet it read as a control message. That moment does not move with the operator's
load. A read that took several packets (the reader was later than the gap between them) carries the
newest one's stamp: never earlier than the bytes it holds arrived, only as late as the reader was.

asyncio's and uvloop's transports read with recv() and drop control messages, so this is a transport of
its own, driven by loop.add_reader / add_writer (both loops have them): `StampedTransport` drives any
asyncio.Protocol as the loop's own transport would (data_received, eof_received, connection_lost,
pause_writing / resume_writing, pause_reading / resume_reading, a buffered write) and, before each
data_received, sets the protocol's `arrived_ns`: the kernel's receive time on `time.monotonic_ns`'s clock
(None where the kernel gave no stamp). Linux only; elsewhere `open_stamped` is loop.create_connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

# <asm-generic/socket.h>: SO_TIMESTAMPNS (the "old" one: a struct timespec of two longs) and its control
# message type, the same number. Python 3.11's socket module names neither.
SO_TIMESTAMPNS: Final = 35
SCM_TIMESTAMPNS: Final = SO_TIMESTAMPNS
_TIMESPEC: Final = struct.Struct("@ll")
STAMPS: Final = sys.platform == "linux"

READ_SIZE: Final = 64 * 1024  # what one recvmsg takes (a bytes object this size is allocated per read)
ANCILLARY_SIZE: Final = socket.CMSG_SPACE(_TIMESPEC.size) if STAMPS else 0
WRITE_HIGH_WATER: Final = 64 * 1024


P = TypeVar("P", bound=asyncio.Protocol)


def arrival_ns(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The kernel's receive time of a recvmsg's newest packet, on time.monotonic_ns's clock (None: no
    stamp). The stamp is on the real-time clock; the two clocks' offset is read now, as the read is."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            mono, real = time.monotonic_ns(), time.time_ns()
            return min(mono, mono - (real - (int(sec) * 1_000_000_000 + int(nsec))))
    return None


class StampedTransport(asyncio.Transport):
    """One connected, non-blocking TCP socket driven through the loop's reader and writer callbacks."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: asyncio.Protocol
    ) -> None:
        super().__init__({"socket": sock})  # BaseTransport.get_extra_info reads this
        self._loop, self._sock, self._protocol = loop, sock, protocol
        self._fd = sock.fileno()
        self._closing = False
        self._reading = True
        self._writing_paused = False
        self._out = bytearray()
        protocol.connection_made(self)
        loop.add_reader(self._fd, self._read_ready)

    # -- reading
    def _read_ready(self) -> None:
        try:
            data, ancillary, _, _ = self._sock.recvmsg(READ_SIZE, ANCILLARY_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(exc)
            return
        if not data:
            self._loop.remove_reader(self._fd)
            self._reading = False
            if not self._protocol.eof_received():
                self.close()
            return
        self._protocol.arrived_ns = arrival_ns(ancillary)  # type: ignore[attr-defined]
        self._protocol.data_received(data)

    def pause_reading(self) -> None:
        if self._reading and not self._closing:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._loop.add_reader(self._fd, self._read_ready)
            self._reading = True

    # -- writing
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._abort(exc)
                return
            data = memoryview(data)[sent:]
            if not data:
                return
            self._loop.add_writer(self._fd, self._write_ready)
        self._out += data
        if len(self._out) > WRITE_HIGH_WATER and not self._writing_paused:
            self._writing_paused = True
            self._protocol.pause_writing()

    def _write_ready(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(exc)
            return
        del self._out[:sent]
        if self._out:
            return
        self._loop.remove_writer(self._fd)
        if self._writing_paused:
            self._writing_paused = False
            self._protocol.resume_writing()
        if self._closing:
            self._loop.call_soon(self._lost, None)

    # -- ending
    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; the connection ends once what was written is sent."""
        if self._closing:
            return
        self._closing = True
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if not self._out:
            self._loop.call_soon(self._lost, None)

    def abort(self) -> None:
        self._abort(None)

    def _abort(self, exc: Exception | None) -> None:
        if self._sock.fileno() < 0:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        self._reading = False
        if self._out:
            self._loop.remove_writer(self._fd)
            self._out.clear()
        self._loop.call_soon(self._lost, exc)  # once, however often scheduled: it closes the socket

    def _lost(self, exc: Exception | None) -> None:
        if self._sock.fileno() < 0:
            return
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._sock.close()


async def open_stamped(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], P], host: str, port: int
) -> tuple[asyncio.Transport, P]:
    """Connect to host:port (every address it resolves to, in turn) with receive stamps on; the
    transport and the protocol, as loop.create_connection returns them."""
    if not STAMPS:
        transport, protocol = await loop.create_connection(factory, host, port)
        return transport, protocol
    try:
        ip = ipaddress.ip_address(host)
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        addresses: list[tuple[socket.AddressFamily, Any]] = [(family, (host, port))]
    except ValueError:  # a name: resolved as create_connection would (an address of each family)
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [(info[0], info[4]) for info in infos]
    errors: list[OSError] = []
    for family, address in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        except BaseException:
            sock.close()
            raise
        protocol = factory()
        return StampedTransport(loop, sock, protocol), protocol
    if len(errors) == 1:
        raise errors[0]
    raise OSError(f"Multiple exceptions: {', '.join(str(e) for e in errors)}")

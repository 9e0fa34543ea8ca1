"""A streamed chat is timed by when the kernel received its bytes (probe/rxstamp.py), not by when the
probe's loop got to them: a loop held up while the first token arrives does not become TTFT.

The engine here is a plain socket server in its own thread (a server on the probe's loop would be held
up with it), answering one chat with an SSE stream at known moments."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe.client import probe_client, stream_chat
from servedmodel.probe.loop import new_probe_loop
from servedmodel.wire import rxstamp

FIRST_TOKEN_S = 0.05  # the engine's first token, after the request
SECOND_TOKEN_S = 0.60
HOLD_UP_S = 0.50  # the probe's loop blocked from 10 ms after the request for this long
HELD_S = 0.2  # the loop still blocked after the sender's last bytes went in

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
FIRST = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
LAST = (
    b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\ndata: [DONE]\n\n'
)


@pytest.fixture
def engine() -> Iterator[str]:
    """One chat answered: the head and the role at once, the first token 50 ms after the request, the
    rest 600 ms after it, then the connection closed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(10)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            got = time.monotonic()
            conn.sendall(HEAD + ROLE)
            time.sleep(max(0.0, got + FIRST_TOKEN_S - time.monotonic()))
            conn.sendall(FIRST)
            time.sleep(max(0.0, got + SECOND_TOKEN_S - time.monotonic()))
            conn.sendall(LAST)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    thread.join(15)
    listener.close()


def first_token_ms(base: str) -> float:
    """The probe's own chat stream on a probe loop held up from 10 ms after sending for HOLD_UP_S: its
    first token's time after the request went out."""

    async def main() -> float:
        async with probe_client(ProbeSpec()) as client:
            loop = asyncio.get_running_loop()
            loop.call_later(0.01, time.sleep, HOLD_UP_S)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            timing = await stream_chat(client, base, body, api_key=None, max_tokens=2)
        return (timing.content_ns[0] - timing.sent_ns) / 1e6

    loop = new_probe_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.skipif(not rxstamp.STAMPS, reason="SO_TIMESTAMPNS is Linux's")
def test_a_first_token_that_arrived_while_the_loop_was_held_up_is_timed_at_its_arrival(engine: str) -> None:
    """The token arrived 50 ms after the request, while the loop was blocked (10 - 510 ms); read at the
    loop's return it would be ~510 ms. Timed by the kernel, it is 50 ms and whatever loopback added."""
    ttft_ms = first_token_ms(engine)
    assert FIRST_TOKEN_S * 1000 <= ttft_ms < (FIRST_TOKEN_S + HOLD_UP_S / 2) * 1000, ttft_ms


def test_a_stamp_is_never_later_than_the_read_and_belongs_to_the_newest_bytes() -> None:
    """Two sends 50 ms apart read in one recvmsg after the loop was held up: one read, stamped with the
    second send's arrival (the newest bytes), before the moment the loop read it."""

    class Recorder(asyncio.Protocol):
        arrived_ns: int | None = None

        def __init__(self) -> None:
            self.reads: list[tuple[int, int | None, bytes]] = []

        def data_received(self, data: bytes) -> None:
            self.reads.append((time.monotonic_ns(), self.arrived_ns, data))

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    second: list[int] = []  # time.monotonic_ns() just before and just after the second send
    sent = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            time.sleep(0.05)
            conn.sendall(b"one")
            time.sleep(0.05)
            second.append(time.monotonic_ns())
            conn.sendall(b"two")
            second.append(time.monotonic_ns())
            sent.set()
            time.sleep(0.3)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> list[tuple[int, int | None, bytes]]:
        loop = asyncio.get_running_loop()
        transport, recorder = await rxstamp.open_stamped(loop, Recorder, *listener.getsockname())
        # The loop blocked until both sends are in (however late a loaded machine runs the sender's
        # thread), then HELD_S more: the one read comes at least that long after the newest bytes.
        assert sent.wait(10), "the sender never sent"  # blocking the loop is the point
        time.sleep(HELD_S)  # noqa: ASYNC251
        await asyncio.sleep(0.05)
        transport.close()
        return recorder.reads

    loop = new_probe_loop()
    try:
        reads = loop.run_until_complete(main())
    finally:
        loop.close()
        thread.join(5)
        listener.close()
    assert [data for _, _, data in reads] == [b"onetwo"]
    read_at, arrived, _ = reads[0]
    if not rxstamp.STAMPS:
        assert arrived is None
        return
    assert arrived is not None
    # The second send's arrival (loopback delivers inside sendall; 5 ms for the wall → monotonic
    # conversion, whose two clock reads can be preempted apart), not the first's (50 ms before) and
    # not the read's (HELD_S after).
    assert second[0] - 5_000_000 <= arrived <= second[1] + 5_000_000, (arrived - second[0]) / 1e6
    assert read_at - arrived >= HELD_S * 1e9, (read_at - arrived) / 1e6


def test_abort_after_a_close_that_waits_for_its_writes_still_closes_the_socket() -> None:
    """close() with bytes still to send waits for them; an abort() then drops them and ends the connection
    (connection_lost once, the socket closed), as the loop's own transports do."""

    class Lost(asyncio.Protocol):
        arrived_ns: int | None = None
        lost = 0

        def connection_lost(self, exc: Exception | None) -> None:
            self.lost += 1

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        transport, protocol = await rxstamp.open_stamped(loop, Lost, *listener.getsockname())
        peer, _ = listener.accept()  # never reads: the kernel's buffers fill and the rest waits
        with peer:
            transport.write(b"x" * (16 * 1024 * 1024))
            sock = transport.get_extra_info("socket")
            transport.close()
            transport.abort()
            for _ in range(3):
                await asyncio.sleep(0)
            return sock.fileno(), protocol.lost

    loop = new_probe_loop()
    try:
        fileno, lost = loop.run_until_complete(main())
    finally:
        loop.close()
        listener.close()
    assert fileno == -1
    assert lost == 1

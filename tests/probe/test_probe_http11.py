"""The probe's own HTTP/1.1 transport (probe/http11.py) against real servers on loopback: raw asyncio
servers that send what uvicorn/h11 may send (Content-Length and chunked bodies, split at odd places, LF-only
line ends, chunk extensions and trailers, interim 1xx answers, Connection: close, a body that runs to the
connection's end, a peer that closes an idle keep-alive connection) and what a broken engine sends (a cut
body, a bad chunk size, a stall); and the simulator, over which a probe cycle keeps one connection alive.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from servedmodel.api.probe import ProbeSpec
from servedmodel.probe import errors
from servedmodel.probe.client import PathMemo, PodMetrics, probe_client, probe_transport, run_probe
from servedmodel.probe.endpoints import resolve_external
from servedmodel.sim.process import SimulatorProcess
from servedmodel.wire import http11
from servedmodel.wire.http11 import LeanTransport

Reader, Writer = asyncio.StreamReader, asyncio.StreamWriter
Script = Callable[[Reader, Writer, int], Awaitable[None]]  # (reader, writer, connection number)

TIMEOUT = httpx.Timeout(2.0)


class Raw:
    """A raw asyncio server on loopback that runs `script` on each connection it accepts; it counts them
    and keeps the requests' heads it read."""

    def __init__(self, script: Script) -> None:
        self.script, self.connections = script, 0
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Raw:
        async def accept(reader: Reader, writer: Writer) -> None:
            self.connections += 1
            try:
                await self.script(reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def request(self, reader: Reader) -> bytes:
        """One request's head and its Content-Length body (what the client sent)."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return head + await reader.readexactly(length)


async def send_in_pieces(writer: Writer, data: bytes, sizes: list[int], pause_s: float = 0.01) -> None:
    """`data` in writes of the given sizes (the rest at once), each drained and apart, so that the client's
    reads end where the writes do."""
    pos = 0
    for n in sizes:
        writer.write(data[pos : pos + n])
        await writer.drain()
        await asyncio.sleep(pause_s)
        pos += n
    writer.write(data[pos:])
    await writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=probe_transport(), timeout=TIMEOUT, trust_env=False) as c:
        yield c


def chunked(*pieces: bytes, ext: bytes = b"", eol: bytes = b"\r\n", trailer: bytes = b"") -> bytes:
    out = b"".join(b"%x%s%s%s%s" % (len(p), ext, eol, p, eol) for p in pieces)
    return out + b"0" + eol + trailer + eol


async def test_a_content_length_body_split_at_odd_places_and_the_connection_kept(
    client: httpx.AsyncClient,
) -> None:
    body = b"0123456789" * 30

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        for _ in range(3):
            await raw.request(reader)
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-A: b\r\n\r\n%s" % (len(body), body)
            await send_in_pieces(writer, answer, [1, 9, 7, 30, 1, 2, 100])

    async with Raw(script) as raw:
        for _ in range(3):
            r = await client.get(f"{raw.url}/x?y=1")
            assert (r.status_code, r.content, r.headers["x-a"]) == (200, body, "b")
        assert raw.connections == 1  # kept alive across the three requests
        assert raw.heads[0].startswith(b"GET /x?y=1 HTTP/1.1\r\n")
        assert b"\r\nhost: 127.0.0.1:" in raw.heads[0].lower()


async def test_a_chunked_body_split_at_odd_places_with_extensions_trailers_and_lf_line_ends(
    client: httpx.AsyncClient,
) -> None:
    forms = [
        chunked(b"data: one\n\n", b"data: [DONE]\n\n"),
        chunked(b"ab", b"c" * 40, ext=b";name=value", trailer=b"X-Trailer: t\r\n"),
        chunked(b"hello", b" world", eol=b"\n"),
    ]
    wanted = [b"data: one\n\ndata: [DONE]\n\n", b"ab" + b"c" * 40, b"hello world"]

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        for form in forms:
            await raw.request(reader)
            head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            # splits inside a size line, between a chunk's data and its CRLF, inside the CRLF
            await send_in_pieces(writer, head + form, [len(head) + 1, 2, 4, 1, 1, 3])

    async with Raw(script) as raw:
        for want in wanted:
            r = await client.get(raw.url)
            assert r.content == want
        assert raw.connections == 1


async def test_each_read_of_a_stream_is_handed_on_when_it_comes(client: httpx.AsyncClient) -> None:
    """The chat stream times every read (probe/sse.py): a chunk must not wait for the next one."""
    gap_s = 0.15

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"first")[:-5])
        await writer.drain()
        await asyncio.sleep(gap_s)
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    async with Raw(script) as raw, client.stream("GET", raw.url) as r:
        loop = asyncio.get_running_loop()
        seen = [(chunk, loop.time()) async for chunk in r.aiter_raw()]
    assert [c for c, _ in seen] == [b"first", b"second"]
    assert seen[1][1] - seen[0][1] > gap_s * 0.8


@pytest.mark.parametrize("framing", ["chunked", "close"])
async def test_bytes_that_came_while_the_caller_held_a_read_are_not_left_waiting(
    client: httpx.AsyncClient, framing: str
) -> None:
    """A caller slow with one read (a watch's consumer held up, a probe thread waiting for the GIL): the
    rest of the body, come meanwhile, is handed on at the caller's next step, not when yet more bytes
    come (none do: the connection stays open, so waiting for them was a read timeout or a watch stuck
    one event behind)."""
    held = asyncio.Event()

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"first")[:-5])
        else:
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nfirst")
        await writer.drain()
        await held.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n" if framing == "chunked" else b"second")
        await writer.drain()
        if framing == "close":
            await asyncio.sleep(3.0)  # the body ends only when the connection does: after the read limit
            writer.write(b"!")

    limits = httpx.Timeout(1.0)
    async with Raw(script) as raw, client.stream("GET", raw.url, timeout=limits) as r:
        seen: list[bytes] = []
        async for chunk in r.aiter_raw():
            seen.append(chunk)
            if len(seen) == 1:
                held.set()
                await asyncio.sleep(0.2)  # the rest arrives now, while this read is held
            if b"second" in b"".join(seen):
                break
    assert b"".join(seen) == b"firstsecond"


async def test_connection_close_and_a_body_to_the_end_are_read_whole_and_not_reused(
    client: httpx.AsyncClient,
) -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
        b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n1.0",
    ]

    async def script(reader: Reader, writer: Writer, n: int) -> None:
        await raw.request(reader)
        await send_in_pieces(writer, answers[n - 1], [5, 20])

    async with Raw(script) as raw:
        assert [(await client.get(raw.url)).content for _ in answers] == [b"ok", b"until the end", b"1.0"]
        assert raw.connections == 3


async def test_interim_answers_are_skipped_and_bodiless_answers_keep_the_connection(
    client: httpx.AsyncClient,
) -> None:
    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx")
        await raw.request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")  # HEAD: the length, no body
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\ny")
        await writer.drain()

    async with Raw(script) as raw:
        assert (await client.get(raw.url)).content == b"x"
        assert (await client.get(raw.url)).status_code == 204
        assert (await client.head(raw.url)).headers["content-length"] == "5"
        assert (await client.get(raw.url)).content == b"y"
        assert raw.connections == 1


async def test_a_request_body_goes_with_its_length_or_chunked(client: httpx.AsyncClient) -> None:
    got: list[bytes] = []

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        got.append(await raw.request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        got.append(head + await reader.readuntil(b"0\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async def parts() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b"cd"

    async with Raw(script) as raw:
        await client.post(raw.url, json={"a": 1})
        await client.post(raw.url, content=parts())
    assert got[0].startswith(b"POST / HTTP/1.1\r\n")
    assert got[0].endswith(b'\r\n\r\n{"a":1}')
    assert b"\r\ntransfer-encoding: chunked\r\n" in got[1].lower()
    assert got[1].endswith(b"\r\n\r\n4\r\nabcd\r\n0\r\n\r\n")


async def test_a_large_body_is_read_in_steps(client: httpx.AsyncClient) -> None:
    """Past READ_HIGH_WATER unread the socket is paused, then read again as the reader takes it."""
    body = bytes(range(256)) * (3 * http11.READ_HIGH_WATER // 256 + 7)

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async with Raw(script) as raw, client.stream("GET", raw.url) as r:
        got = bytearray()
        async for chunk in r.aiter_raw():
            got += chunk
            await asyncio.sleep(0.001)  # a slow reader: the unread bytes pile up
    assert got == body


async def test_an_idle_connection_the_peer_closed_is_not_used_again(client: httpx.AsyncClient) -> None:
    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then closed, as uvicorn closes an idle keep-alive connection

    async with Raw(script) as raw:
        assert (await client.get(raw.url)).content == b"ok"
        await asyncio.sleep(0.05)
        assert (await client.get(raw.url)).content == b"ok"
        assert raw.connections == 2


async def test_a_reused_connection_closed_before_any_answer_is_retried_once_on_a_new_one(
    client: httpx.AsyncClient,
) -> None:
    """The peer closes a keep-alive connection just as the probe sends on it (it read nothing of it):
    the request goes again, once, on a new connection; a new connection that says nothing is an error."""

    async def script(reader: Reader, writer: Writer, n: int) -> None:
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if n == 1:
            await raw.request(reader)  # the second request, read and dropped: the connection closes

    async with Raw(script) as raw:
        assert (await client.get(raw.url)).content == b"ok"
        assert (await client.get(raw.url)).content == b"ok"
        assert raw.connections == 2

    async def silent(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)

    async with Raw(silent) as raw:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.get(raw.url)
        assert raw.connections == 1


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "expected 10"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "last chunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhelloo\r\n", "line end"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\n folded\r\n\r\n", "folding"),
        (b"SMTP ready\r\n\r\n", "status line"),
    ],
)
async def test_a_broken_answer_is_a_protocol_error(
    client: httpx.AsyncClient, answer: bytes, match: str
) -> None:
    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        writer.write(answer)
        await writer.drain()

    async with Raw(script) as raw:
        with pytest.raises(httpx.RemoteProtocolError, match=match):
            await client.get(raw.url)


async def test_timeouts_are_the_requests_own() -> None:
    async def script(reader: Reader, writer: Writer, n: int) -> None:
        await raw.request(reader)
        if n == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhal")
            await writer.drain()
        await asyncio.sleep(5)

    loop = asyncio.get_running_loop()
    async with Raw(script) as raw, httpx.AsyncClient(transport=probe_transport(), trust_env=False) as c:
        t0 = loop.time()
        with pytest.raises(httpx.ReadTimeout):  # no first byte
            await c.get(raw.url, timeout=httpx.Timeout(5.0, read=0.2))
        with pytest.raises(httpx.ReadTimeout):  # the body stalls
            await c.get(raw.url, timeout=httpx.Timeout(5.0, read=0.2))
        assert loop.time() - t0 < 2.0


async def test_a_refused_connection_is_connect_error_with_the_os_error(client: httpx.AsyncClient) -> None:
    async with Raw(lambda *_: asyncio.sleep(0)) as raw:
        url = raw.url
    with pytest.raises(httpx.ConnectError) as caught:
        await client.get(url)
    assert errors.classify_transport_error(caught.value, "GET /").reason == errors.CONNECTION_REFUSED
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ECONNREFUSED


async def test_a_header_with_a_line_break_is_not_sent(client: httpx.AsyncClient) -> None:
    async with Raw(lambda *_: asyncio.sleep(0)) as raw:
        with pytest.raises(httpx.LocalProtocolError):
            await client.get(raw.url, headers={"Authorization": "Bearer k\r\nX-Injected: 1"})
        assert raw.heads == []


async def test_https_goes_to_the_fallback() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text="fallback")

    transport = LeanTransport(httpx.MockTransport(handler))
    async with httpx.AsyncClient(transport=transport) as c:
        assert (await c.get("https://engine.example/v1/models")).text == "fallback"
    assert seen == ["https://engine.example/v1/models"]


async def test_the_chat_stream_reads_its_two_marks_from_the_transport(client: httpx.AsyncClient) -> None:
    events: list[str] = []

    async def trace(event: str, info: dict[str, Any]) -> None:
        events.append(event)

    async def script(reader: Reader, writer: Writer, _: int) -> None:
        await raw.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async with Raw(script) as raw:
        await client.get(raw.url, extensions={"trace": trace})
    assert events == ["http11.send_request_headers.started", "http11.receive_response_headers.complete"]


async def test_probe_cycles_against_the_simulator_keep_one_connection(
    sim: SimulatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[http11._Wire] = []
    real = http11._Wire.__init__

    def counted(self: http11._Wire, loop: asyncio.AbstractEventLoop) -> None:
        real(self, loop)
        made.append(self)

    monkeypatch.setattr(http11._Wire, "__init__", counted)
    spec = ProbeSpec(max_tokens=8)
    target = resolve_external(sim.base_url)
    sent = 0

    async def count(_: httpx.Request) -> None:
        nonlocal sent
        sent += 1

    memo = PathMemo("sim")
    async with probe_client(spec) as http:
        http.event_hooks["request"].append(count)
        for _ in range(3):  # a full path, then light cycles
            metrics = PodMetrics(http, [sim.base_url], None)
            out = await run_probe(http, target, spec, metrics=metrics, memo=memo)
            assert out.failure is None, out.failure
            assert out.figures is not None
            assert out.figures.ttft_ms is not None
            assert len(out.timing.token_ns if out.timing else []) > 1
    assert sent >= 12
    assert len(made) == 1

"""The operator's own HTTP/1.1 client: the probe's for plain http:// engines, under httpx's client API, and
the Kubernetes client's for the API server over TLS.

Why: a light probe cycle (two /metrics scrapes and one streamed chat) spent about 10 ms of the operator's
CPU in httpx's default transport stack, httpcore over anyio over h11, per request and per streamed chunk
(issue 21). This transport does the same wire work directly: one asyncio Protocol per TCP connection,
kept alive per engine address and reused across the cycle's requests and the next cycle's; the response
head parsed once; the body framed by Content-Length, the chunked transfer coding or the connection's end;
and every read handed on as it came with the kernel's receive time (rxstamp.py), so a streamed chat's
chunks are timed when they arrived, not when a busy loop got to them.
Callers keep httpx's API: AsyncClient, Response, the trace extension's two marks the chat stream reads,
and httpx's exceptions (ConnectError with the OS error as its cause, ConnectTimeout, ReadTimeout,
WriteTimeout, RemoteProtocolError, LocalProtocolError), which errors.classify_transport_error maps.

A transport speaks one scheme: http:// (engine pods are addressed by IP and port, without TLS), or, given
a TLS context, https:// (the API server: k8s/client.py writes and watches through it, as the probe's light
cycle does, since httpx's stack was most of a status write's CPU at 1,000 ServedModels). Anything else
(for the probe: external https:// endpoints, Prometheus) goes to `fallback`, httpx's own transport.
Receive stamps are taken on plain TCP only (TLS decrypts in user space, after the socket's read). No
connection cap: callers bound their requests (the probe's slots; the Kubernetes client's in-flight cap).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, cast

import httpx

from . import rxstamp

# A response's status line and headers (httpcore allows h11 100 KiB too).
HEAD_MAX_BYTES: Final = 100 * 1024
CHUNK_LINE_MAX_BYTES: Final = 4096  # a chunk-size line with its extensions, or one trailer line
# Unread bytes past which the socket is not read until the reader catches up (a 16 MiB /metrics is
# taken in steps, not held whole twice).
READ_HIGH_WATER: Final = 256 * 1024
# An idle connection is reused within this long, then closed: under the 5 s after which vLLM's server
# (uvicorn) closes an idle keep-alive connection itself, so the probe rarely sends on one being closed.
KEEPALIVE_EXPIRY_S: Final = 4.0
IDLE_PER_HOST: Final = 16

# What the client raises: httpx's transport errors (ConnectError, ReadTimeout, RemoteProtocolError, ...),
# as the probe's callers under httpx's API expect; callers outside httpx catch this.
WireError: Final = httpx.TransportError

_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_NO_BODY_STATUS: Final = frozenset({204, 304})

Trace = Callable[[str, dict[str, Any]], Awaitable[None]]


class _Wire(asyncio.Protocol):
    """One TCP connection as the loop delivers it: the bytes not yet read, whether the peer has closed,
    and the one reader waiting for more."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.received = 0  # bytes received since the last request was sent
        # The kernel's receive time of the newest bytes in buf (rxstamp.py; time.monotonic_ns), None
        # without a stamp.
        self.arrived_ns: int | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._read_paused = False
        self._write_paused = False
        self._drained: asyncio.Future[bool] | None = None

    # -- the loop's callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.received += len(data)
        if len(self.buf) > READ_HIGH_WATER and not self._read_paused and self.transport is not None:
            self.transport.pause_reading()
            self._read_paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # the transport closes itself; nothing more is sent on a half-closed connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        self._drain_done()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._drain_done()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def _drain_done(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    # -- the reader's side
    def consumed(self) -> None:
        """The reader took bytes out of buf: read the socket again once little is left."""
        if self._read_paused and len(self.buf) < READ_HIGH_WATER // 4 and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()

    async def more(self, limit_s: float | None) -> None:
        """Until more bytes arrive or the peer closes; httpx.ReadTimeout after `limit_s` seconds."""
        if self.eof:
            return
        self.consumed()
        self._waiter = self.loop.create_future()
        try:
            arrived = await self._within(self._waiter, limit_s)
        finally:
            self._waiter = None
        if not arrived:
            raise httpx.ReadTimeout(f"no bytes within {limit_s:g} s")

    async def drain(self, limit_s: float | None) -> None:
        """Until the transport's write buffer is low again; httpx.WriteTimeout after `limit_s` seconds."""
        if not self._write_paused or self.eof:
            return
        self._drained = self.loop.create_future()
        try:
            drained = await self._within(self._drained, limit_s)
        finally:
            self._drained = None
        if not drained:
            raise httpx.WriteTimeout(f"the request was not sent within {limit_s:g} s")

    async def _within(self, waiter: asyncio.Future[bool], limit_s: float | None) -> bool:
        """`waiter`'s result (True: it came), or False once `limit_s` seconds passed first."""
        timer = None if limit_s is None else self.loop.call_later(limit_s, _expire, waiter)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Conn:
    """A connection of the pool: its wire, where it goes and since when it is idle."""

    __slots__ = ("idle_since", "key", "wire")

    def __init__(self, key: _Key, wire: _Wire) -> None:
        self.key, self.wire, self.idle_since = key, wire, 0.0

    @property
    def usable(self) -> bool:
        """Open, the peer has not closed it, and nothing arrived that no request asked for."""
        t = self.wire.transport
        return t is not None and not t.is_closing() and not self.wire.eof and not self.wire.buf

    def close(self) -> None:
        if self.wire.transport is not None:
            self.wire.transport.close()


_Key = tuple[asyncio.AbstractEventLoop, str, int]


class _Stale(Exception):
    """A reused connection the peer had closed before it answered anything: the request goes again."""


class _Head:
    """A parsed response head."""

    __slots__ = ("headers", "keep_alive", "length", "mode", "reason", "status")

    def __init__(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.reason, self.headers = status, reason, headers
        self.mode = "length"  # length | chunked | close
        self.length = 0
        self.keep_alive = True


def _parse_head(raw: bytes, method: bytes) -> _Head:
    """Status line and headers (lines end in CRLF or LF), and how the body is framed (RFC 9112 6.3)."""
    lines = raw.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {status_line[:80]!r}")
    version = parts[0]
    status = int(parts[1])
    headers: list[tuple[bytes, bytes]] = []
    lengths: set[bytes] = set()
    codings: list[bytes] = []
    connection: list[bytes] = []
    for line in lines[1:]:
        line = line.rstrip(b"\r")
        if not line:
            continue
        if line[0] in b" \t":
            raise httpx.RemoteProtocolError("obsolete line folding in the response headers")
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}")
        value = value.strip(b" \t")
        headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            lengths.update(v.strip() for v in value.split(b","))
        elif lower == b"transfer-encoding":
            codings.extend(v.strip().lower() for v in value.split(b","))
        elif lower == b"connection":
            connection.extend(v.strip().lower() for v in value.split(b","))
    head = _Head(status, parts[2] if len(parts) > 2 else b"", headers)
    head.keep_alive = version == b"HTTP/1.1" and b"close" not in connection
    if method == b"HEAD" or status < 200 or status in _NO_BODY_STATUS:
        return head
    if codings:
        if codings[-1] == b"chunked":
            head.mode = "chunked"
        else:  # a coding other than chunked last: the body runs to the connection's end
            head.mode, head.keep_alive = "close", False
    elif lengths:
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            raise httpx.RemoteProtocolError(f"invalid Content-Length {b', '.join(sorted(lengths))!r}")
        head.length = int(next(iter(lengths)))
    else:
        head.mode, head.keep_alive = "close", False
    return head


class _Chunks:
    """The chunked transfer coding, decoded from whatever the reads brought (lines end in CRLF or LF)."""

    __slots__ = ("crlf", "done", "left", "trailers")

    def __init__(self) -> None:
        self.left = 0  # data bytes left in the current chunk
        self.crlf = False  # the line end after a chunk's data is due
        self.trailers = False  # past the last chunk: trailer lines until an empty one
        self.done = False

    def take(self, buf: bytearray) -> bytes:
        """The data in `buf` (removed from it); what is incomplete stays for the next read."""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n and not self.done:
            if self.left:
                end = min(n, pos + self.left)
                out.append(bytes(buf[pos:end]))
                self.left -= end - pos
                pos = end
                self.crlf = self.left == 0
            elif self.crlf:
                if buf[pos] == 0x0A:
                    pos += 1
                elif buf[pos] == 0x0D:
                    if pos + 1 == n:
                        break
                    if buf[pos + 1] != 0x0A:
                        raise httpx.RemoteProtocolError("no line end after a chunk's data")
                    pos += 2
                else:
                    raise httpx.RemoteProtocolError("no line end after a chunk's data")
                self.crlf = False
            else:
                eol = buf.find(b"\n", pos)
                if eol < 0:
                    if n - pos > CHUNK_LINE_MAX_BYTES:
                        raise httpx.RemoteProtocolError("chunk-size line too long")
                    break
                line = bytes(buf[pos:eol]).rstrip(b"\r")
                pos = eol + 1
                if self.trailers:
                    self.done = not line
                    continue
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or not _HEX.issuperset(size):
                    raise httpx.RemoteProtocolError(f"malformed chunk size {line[:40]!r}")
                self.left = int(size, 16)
                self.trailers = self.left == 0
        del buf[:pos]
        return out[0] if len(out) == 1 else b"".join(out)


class _Body(httpx.AsyncByteStream):
    """A response body as its reads arrive; the connection goes back to the pool once the body is whole
    (and both sides allow), and is closed when the body is left unfinished."""

    def __init__(self, pool: LeanTransport, conn: _Conn, head: _Head, read_timeout: float | None) -> None:
        self._pool, self._conn, self._head, self._timeout = pool, conn, head, read_timeout
        self._finished = False
        # When the kernel received the bytes last yielded (the newest of them), None without a stamp.
        self.arrived_ns: int | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        wire, head, timeout = self._conn.wire, self._head, self._timeout
        if head.mode == "length":
            left = head.length
            while left:
                if not wire.buf:
                    if wire.eof:
                        raise httpx.RemoteProtocolError(
                            f"peer closed connection without sending complete message body: "
                            f"received {head.length - left} bytes, expected {head.length}"
                        )
                    await wire.more(timeout)
                    continue
                if len(wire.buf) <= left:
                    data = bytes(wire.buf)
                    wire.buf.clear()
                else:
                    data = bytes(wire.buf[:left])
                    del wire.buf[:left]
                left -= len(data)
                wire.consumed()
                self.arrived_ns = wire.arrived_ns
                yield data
        elif head.mode == "chunked":
            chunks = _Chunks()
            while True:
                data = chunks.take(wire.buf) if wire.buf else b""
                wire.consumed()
                if data:
                    self.arrived_ns = wire.arrived_ns
                    yield data
                    continue  # what came in while the caller had `data` is read before waiting for more
                if chunks.done:
                    break
                if wire.eof:
                    raise httpx.RemoteProtocolError("peer closed connection without sending the last chunk")
                await wire.more(timeout)
        else:
            while True:
                if wire.buf:
                    data = bytes(wire.buf)
                    wire.buf.clear()
                    wire.consumed()
                    self.arrived_ns = wire.arrived_ns
                    yield data
                    continue  # as above
                if wire.eof:
                    break
                await wire.more(timeout)
        self._finished = True
        self._pool._release(self._conn, head.keep_alive)

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._conn.close()


class LeanTransport(httpx.AsyncBaseTransport):
    """httpx transport: http:// (or with `tls`, https://) over the operator's own HTTP/1.1 client,
    keep-alive per address and event loop; everything else through `fallback`. Timeouts are the
    request's (httpx's timeout extension): connect, read (per wait for more bytes, the response head's
    first included) and write."""

    def __init__(
        self,
        fallback: httpx.AsyncBaseTransport | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        idle_per_host: int = IDLE_PER_HOST,
    ) -> None:
        self._fallback = fallback
        self._tls = tls
        self.scheme = "http" if tls is None else "https"
        self._expiry, self._idle_per_host = keepalive_expiry_s, idle_per_host
        self._idle: dict[_Key, list[_Conn]] = {}
        self._swept = time.monotonic()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != self.scheme:
            if self._fallback is None:
                raise httpx.UnsupportedProtocol(f"{url.scheme}:// on a {self.scheme}:// transport")
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout") or {}
        trace: Trace | None = request.extensions.get("trace")
        head, body = await self.exchange(
            url.host,
            url.port or (80 if self._tls is None else 443),
            await _encode(request),
            request.method.encode("ascii"),
            timeouts,
            trace,
            {"request": request},
            close=request.headers.get("connection", "").lower() == "close",
        )
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=body,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    async def exchange(
        self,
        host: str,
        port: int,
        wire_request: bytes,
        method: bytes,
        timeouts: dict[str, float | None],
        trace: Trace | None = None,
        trace_info: dict[str, Any] | None = None,
        *,
        close: bool = False,
    ) -> tuple[_Head, _Body]:
        """One request as encoded, on a kept-alive connection to host:port (a reused one the peer had
        closed unanswered: once more on a fresh one); its response head and its body as it comes."""
        loop = asyncio.get_running_loop()
        key = (loop, host, port)
        read_timeout = timeouts.get("read")
        info = trace_info if trace_info is not None else {}
        for attempt in range(2):
            conn, reused = await self._acquire(key, timeouts.get("connect"), fresh=attempt > 0)
            try:
                if trace is not None:
                    await trace("http11.send_request_headers.started", info)
                await _send(conn, wire_request, timeouts.get("write"), reused)
                head = await _read_head(conn, method, read_timeout, reused)
            except _Stale:
                conn.close()
                continue
            except BaseException:
                conn.close()
                raise
            if trace is not None:
                await trace("http11.receive_response_headers.complete", {"return_value": head.status})
            if close:
                head.keep_alive = False
            return head, _Body(self, conn, head, read_timeout)
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    async def send(
        self, host: str, port: int, wire_request: bytes, method: bytes, timeouts: dict[str, float | None]
    ) -> LeanResponse:
        """`exchange`, its answer as a LeanResponse (the caller reads or closes it)."""
        head, body = await self.exchange(host, port, wire_request, method, timeouts)
        return LeanResponse(head, body)

    async def _acquire(
        self, key: _Key, connect_timeout: float | None, *, fresh: bool = False
    ) -> tuple[_Conn, bool]:
        """An idle connection to `key` that is still open (and not past its expiry), else (or `fresh`) a
        new one."""
        idle = None if fresh else self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < self._expiry:
                return conn, True
            conn.close()
        loop, host, port = key
        try:
            async with asyncio.timeout(connect_timeout):
                if self._tls is None:
                    _, wire = await rxstamp.open_stamped(loop, lambda: _Wire(loop), host, port)
                else:  # asyncio's TLS under the same protocol (ssl.SSLError is an OSError: ConnectError)
                    _, wire = await loop.create_connection(lambda: _Wire(loop), host, port, ssl=self._tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return _Conn(key, wire), False

    def _release(self, conn: _Conn, keep_alive: bool) -> None:
        """A connection whose exchange ended: kept idle for the next request to its address, or closed."""
        now = time.monotonic()
        if now - self._swept > self._expiry:
            self._sweep(now)
        idle = self._idle.setdefault(conn.key, [])
        if not keep_alive or not conn.usable or len(idle) >= self._idle_per_host:
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)

    def _sweep(self, now: float) -> None:
        """Close the expired or peer-closed idle connections of this loop (addresses no longer probed)."""
        self._swept = now
        loop = asyncio.get_running_loop()
        for key in [k for k in self._idle if k[0] is loop]:
            keep = []
            for conn in self._idle[key]:
                if conn.usable and now - conn.idle_since < self._expiry:
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def aclose(self) -> None:
        """Close the idle connections (those of another, still running loop there), then the fallback."""
        loop = asyncio.get_running_loop()
        idle, self._idle = self._idle, {}
        for (owner, _, _), conns in idle.items():
            for conn in conns:
                if owner is loop:
                    conn.close()
                elif not owner.is_closed():
                    owner.call_soon_threadsafe(conn.close)
        if self._fallback is not None:
            await self._fallback.aclose()


def encode_head(method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """A request's line and `headers` as sent, ending with the empty line (the parts to join); a header
    that would end the head early (CR, LF or NUL) is httpx.LocalProtocolError."""
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if b"\r" in value or b"\n" in value or b"\0" in value or b"\r" in name or b"\n" in name:
            raise httpx.LocalProtocolError(f"illegal header {name!r}")
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return parts


async def _encode(request: httpx.Request) -> bytes:
    """The request line, headers and body as sent (the body chunked when the request says so)."""
    raw = request.headers.raw
    parts = encode_head(request.method, request.url.raw_path, raw)
    chunked = any(n.lower() == b"transfer-encoding" and b"chunked" in v.lower() for n, v in raw)
    try:
        body = request.content
    except httpx.RequestNotRead:
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
    if chunked:
        if body:
            parts += (b"%x\r\n" % len(body), body, b"\r\n")
        parts.append(b"0\r\n\r\n")
    else:
        parts.append(body)
    return b"".join(parts)


async def _send(conn: _Conn, data: bytes, write_timeout: float | None, reused: bool) -> None:
    wire = conn.wire
    if reused and not conn.usable:
        raise _Stale
    assert wire.transport is not None
    wire.received = 0
    wire.transport.write(data)
    await wire.drain(write_timeout)


async def _read_head(conn: _Conn, method: bytes, read_timeout: float | None, reused: bool) -> _Head:
    """The response head (1xx interim answers skipped); _Stale when a reused connection was closed
    before any byte of an answer came."""
    wire = conn.wire
    searched = 0
    while True:
        buf = wire.buf
        end = buf.find(b"\n\r\n", searched)
        lf = buf.find(b"\n\n", searched)
        if end < 0 or 0 <= lf < end:
            end, skip = lf, 2
        else:
            skip = 3
        if end >= 0:
            raw = bytes(buf[:end])
            del buf[: end + skip]
            wire.consumed()
            head = _parse_head(raw, method)
            if 100 <= head.status < 200:
                if head.status == 101:
                    raise httpx.RemoteProtocolError("the server switched protocols")
                searched = 0
                continue
            return head
        if len(buf) > HEAD_MAX_BYTES:
            raise httpx.RemoteProtocolError(f"response head longer than {HEAD_MAX_BYTES} bytes")
        if wire.eof:
            if reused and wire.received == 0:
                raise _Stale
            if isinstance(wire.error, OSError):
                raise httpx.ReadError(str(wire.error)) from wire.error
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        searched = max(0, len(buf) - 2)
        await wire.more(read_timeout)


# ---- under httpx's client: the probe's own requests straight to this transport ------------------------
#
# Why: in a light cycle (two /metrics scrapes and the streamed chat) httpx's client layer, the Request
# and URL models, header merging, the cookie hooks and the Response with its stream wrappers, was the
# largest part of the operator's CPU left (issue 21). A LeanClient sends the probe's own requests to its
# LeanTransport directly, with the very bytes httpx would have sent (tests/probe/test_probe_http11.py
# holds them equal), and hands back a LeanResponse with the few things the probe reads of an answer.


class LeanHeaders:
    """A response's headers as read, for the lookups the probe makes (case-insensitive, several values
    joined with ", " and decoded as httpx.Headers does), without building httpx.Headers."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, key: str, default: Any = None) -> Any:
        name = key.lower().encode("ascii")
        values = [v for n, v in self.raw if n.lower() == name]
        if not values:
            return default
        return ", ".join(_header_text(v) for v in values)


def _header_text(value: bytes) -> str:
    """httpx.Headers' decoding: ASCII, else UTF-8, else ISO-8859-1."""
    for encoding in ("ascii", "utf-8"):
        try:
            return value.decode(encoding)
        except UnicodeDecodeError:
            pass
    return value.decode("iso-8859-1")


class LeanResponse:
    """An answer of the lean path: status, headers, and the body read raw as it comes."""

    __slots__ = ("_body", "_reason", "headers", "status_code")

    def __init__(self, head: _Head, body: _Body) -> None:
        self.status_code, self.headers, self._body = head.status, LeanHeaders(head.headers), body
        self._reason = head.reason

    @property
    def reason_phrase(self) -> str:
        return self._reason.decode("latin-1")

    async def aread(self) -> bytes:
        """The whole body (the connection goes back to the pool once it is read)."""
        return b"".join([part async for part in self._body])

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._body.__aiter__()

    @property
    def arrived_ns(self) -> int | None:
        """When the kernel received the bytes aiter_raw last gave (time.monotonic_ns; None: no stamp)."""
        return self._body.arrived_ns

    async def aclose(self) -> None:
        await self._body.aclose()


class LeanClient(httpx.AsyncClient):
    """An AsyncClient whose plain http:// requests may skip its client layer for `lean`, the
    LeanTransport under it (`lean_for`); anything it cannot send as httpx would goes through httpx."""

    def __init__(self, *, lean: LeanTransport | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lean = lean

    def lean_for(self, url: httpx.URL) -> bool:
        """Whether `url` may go to `lean` directly: not when it is not http://, the client is closed
        (httpx says so), or hooks or auth that httpx's client layer must run are set."""
        if self.lean is None or url.scheme != "http" or self.is_closed or self.auth is not None:
            return False
        hooks = self.event_hooks
        return not (hooks["request"] or hooks["response"])

    async def lean_stream(
        self,
        method: str,
        url: httpx.URL,
        headers: Mapping[str, str],
        body: bytes | None,
        limits: httpx.Timeout | None = None,
        trace: Trace | None = None,
    ) -> LeanResponse:
        """`method` `url` with the client's headers and `headers` (and a JSON `body`), as
        client.send(client.build_request(...), stream=True) would send it; the caller closes the answer."""
        assert self.lean is not None
        wire = encode_lean(method, url, self.headers.raw, headers, body)
        timeouts = (limits or self.timeout).as_dict()
        close = any(k.lower() == "connection" and v.lower() == "close" for k, v in headers.items())
        head, stream = await self.lean.exchange(
            url.host, url.port or 80, wire, method.encode("ascii"), timeouts, trace, close=close
        )
        return LeanResponse(head, stream)


def encode_lean(
    method: str,
    url: httpx.URL,
    defaults: list[tuple[bytes, bytes]],
    headers: Mapping[str, str],
    body: bytes | None,
) -> bytes:
    """The request as httpx's client sends it: Host, the client's headers with `headers` merged in (a
    name given again is moved to the end, as Headers.update does), Content-Length and Content-Type of a
    JSON body; then the body."""
    given = [(k.encode("ascii"), v.encode("ascii")) for k, v in headers.items()]
    names = {k.lower() for k, _ in given}
    merged = [(k, v) for k, v in defaults if k.lower() not in names] + given
    present = {k.lower() for k, _ in merged}
    if b"host" not in present:
        merged.insert(0, (b"Host", url.netloc))
    if body is not None:
        for name, value in ((b"Content-Length", b"%d" % len(body)), (b"Content-Type", b"application/json")):
            if name.lower() not in present:
                merged.append((name, value))
    parts = encode_head(method, url.raw_path, merged)
    if body is not None:
        parts.append(body)
    return b"".join(parts)

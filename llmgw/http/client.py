"""A lean HTTP/1.1 client pool on trio, parsing responses with httptools (llhttp).

Used by the router to proxy requests to engines on a private network.

Theory of operation
===================

Connections. One ``_Conn`` per TCP connection: a non-blocking stdlib socket
(TCP_NODELAY) and one ``httptools.HttpResponseParser`` kept for the life of
the connection. As in the server (``_connection.py``), sockets are driven
with ``trio.lowlevel.wait_readable`` / ``wait_writable``: an operation that
can complete at once is one system call, and a task blocks only when the
kernel says it must. Every blocking wait has a deadline from
``ClientLimits`` and maps to ``UpstreamTimeout`` with its phase. Connecting
sits in a cancel scope; socket waits (send, head, and body: one wait per
streamed chunk) go through ``SocketDeadlines`` (``_deadlines.py``), one
timer task per pool that closes the connection under a wait past due, every
quarter of the shortest of those timeouts (at most 1 s). So a wait times out
between its deadline and that much later.

One exchange. ``request`` frames the request head (Host added if absent,
Content-Length for the body; CR/LF in any part is refused), sends head and
a small body in one ``send``, then waits for the response head within
``first_byte_timeout_s``. It returns as soon as the head is parsed; the body
stays on the socket. The first body byte is held to the same deadline, if
later than the idle one: engines send a stream's head as soon as a slot takes
the request, then read the prompt, so a long prefill falls after the head.
``ResponseBody`` (``UpstreamResponse.body_iter``)
yields body bytes as the parser hands them over, de-chunked, one read per
step: nothing is buffered beyond what one ``recv`` brought. A body ends at
its Content-Length, its last chunk, or (no framing: HTTP/1.0 style) at EOF.
1xx interim responses are skipped; a HEAD response ends at its head.

Keep-alive. A connection returns to the pool for its (host, port) at the
moment the parser completes its response, provided the response allowed it
(llhttp's ``should_keep_alive``: version, ``Connection: close``, framing),
the request did not say ``Connection: close`` and no byte followed the
response. Anything else closes it: a body not read to its end, a timeout, an
error, a cancellation at any await. So a pooled connection is always at a
message boundary. Idle connections are kept LIFO (the warmest first), at
most ``max_idle_per_host`` per host; those idle longer than
``idle_keepalive_s`` are dropped when their host's pool is next touched (no
background task).

Stale connections. An engine may close a kept-alive connection just as we
reuse it. When a request sent on a *reused* connection meets EOF or a reset
before any byte of its response, the engine never answered it, and the
request is sent again, once, on a fresh connection. A fresh connection that
fails that way raises ``UpstreamReset(before_response=True)`` for the caller
to decide, and so does one that cannot be made at all after such a close: the
upstream died with the request on it, which a caller must not take for a
refused connection (the request may be what killed it).

Cancellation. A cancelled exchange or body read closes its connection at
once, so the engine sees the client go and stops generating.
``UpstreamPool.stream`` guarantees that on exit, whatever the exit.
"""

from __future__ import annotations

import collections
import socket
import weakref
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Literal

import attrs
import httptools
import trio

from llmgw.addr import join_hostport

from ._deadlines import SocketDeadlines
from .types import Headers

Phase = Literal["connect", "send", "head", "body"]

_RECV_SIZE = 65536
_LARGE_BODY = 65536  # above this, head and body are sent separately rather than copied together
_BODY_METHODS = frozenset(("POST", "PUT", "PATCH"))  # send content-length: 0 for an empty body
# Lengths of the request header names the pool looks at: host, connection,
# content-length, transfer-encoding. Only names of these lengths are lowered.
_SPECIAL_LENGTHS = frozenset((4, 10, 14, 17))
# Response header names decoded and lowered once, then shared.
_NAMES: dict[bytes, str] = {}
_NAMES_MAX = 512


@attrs.frozen
class ClientLimits:
    """Bounds on every wait of an exchange, and on what the pool keeps."""

    connect_timeout_s: float = 2.0
    """Name resolution plus TCP connect -> ``ConnectTimeout`` (phase "connect")."""
    first_byte_timeout_s: float = 60.0
    """From the request sent to its complete response head -> phase "head"."""
    idle_timeout_s: float = 30.0
    """Longest wait for the next bytes of a response body -> phase "body"."""
    write_timeout_s: float = 10.0
    """Longest wait for the upstream to take more request bytes -> phase "send"."""
    max_idle_per_host: int = 64
    """Kept-alive connections per (host, port); beyond it the oldest is closed."""
    idle_keepalive_s: float = 30.0
    """Pooled connections idle longer than this are closed instead of reused."""
    max_header_bytes: int = 64 * 1024
    """Response head (status line and headers) -> ``UpstreamProtocolError`` beyond it."""


class UpstreamError(Exception):
    """An exchange with an upstream failed; ``phase`` says where.

    "connect": nothing was sent. "send": writing the request. "head": waiting
    for or reading the response head. "body": reading the response body."""

    def __init__(self, message: str, phase: Phase) -> None:
        super().__init__(message)
        self.phase: Phase = phase


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing was sent, always safe to retry elsewhere."""

    def __init__(self, message: str, phase: Phase = "connect") -> None:
        super().__init__(message, phase)


class UpstreamTimeout(UpstreamError):
    """A wait bounded by ``ClientLimits`` ran out; ``phase`` says which."""


class ConnectTimeout(ConnectFailed, UpstreamTimeout):
    """Connecting timed out: both a ``ConnectFailed`` and an ``UpstreamTimeout``."""


class UpstreamReset(UpstreamError):
    """The upstream closed or reset the connection.

    ``before_response``: no byte of the response had arrived, so the client
    can still be answered by retrying elsewhere (the upstream may have seen
    the request, though, unless ``phase`` is "send" on a fresh connection)."""

    def __init__(self, message: str, phase: Phase, before_response: bool) -> None:
        super().__init__(message, phase)
        self.before_response = before_response


class UpstreamProtocolError(UpstreamError):
    """The upstream's response is not valid HTTP/1.x, or exceeds a limit."""


class _Fail(Exception):
    """Raised inside a parser callback to stop parsing with a protocol error."""


def _header_name(raw: bytes) -> str:
    name = _NAMES.get(raw)
    if name is None:
        name = raw.decode("latin-1").lower()
        if len(_NAMES) < _NAMES_MAX:
            _NAMES[raw] = name
    return name


class _Conn:
    """One upstream connection: socket, parser, and the state of the response being read."""

    __slots__ = (
        "__weakref__",
        "body_seen",
        "broken",
        "chunks",
        "closed",
        "deadline",
        "done",
        "expired",
        "first_deadline",
        "framed",
        "head_done",
        "head_only",
        "headers",
        "idle_since",
        "interim",
        "keep_alive",
        "key",
        "name",
        "parser",
        "received",
        "renew",
        "reused",
        "sock",
        "status",
    )

    def __init__(self, sock: socket.socket, key: tuple[str, int]) -> None:
        self.sock = sock
        self.key = key
        self.name = f"{key[0]}:{key[1]}"
        self.parser: Any = httptools.HttpResponseParser(self)
        self.reused = False  # a response was read on it before: a stale close is possible
        self.closed = False
        self.broken = False  # bytes followed a response: never reuse
        self.renew = False  # the parser must be replaced before the next response
        self.idle_since = 0.0
        self.deadline = 0.0  # of the socket wait pending now (SocketDeadlines)
        self.expired = False  # that wait timed out, and the connection was closed
        self.start(False)

    def start(self, head_only: bool) -> None:
        """Reset the per-response state for the next exchange."""
        if self.renew:
            self.parser = httptools.HttpResponseParser(self)
            self.renew = False
        self.head_only = head_only
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.received = 0  # bytes of this response (and interim ones) read so far
        self.first_deadline = 0.0  # the first-byte deadline, which the first body byte keeps
        self.body_seen = False
        self.head_done = False
        self.done = False
        self.interim = False  # inside a 1xx response
        self.framed = False  # content-length or chunked: EOF before the end is a cut
        self.keep_alive = False

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:
            # A second response nobody asked for: stop parsing (`feed` marks the
            # connection broken), so nothing of it reaches this response.
            raise _Fail("bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = _header_name(name)
        text = value.decode("latin-1")
        self.headers.append((key, text))
        if key == "content-length" or (key == "transfer-encoding" and "chunked" in text.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        if status < 200:
            if status == 101:
                raise _Fail("unexpected 101 Switching Protocols")
            self.interim = True  # llhttp ends a 1xx at its head; the real one follows
            return
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        self.head_done = True
        if self.head_only:
            # A HEAD response has no body whatever its headers say; llhttp cannot
            # be told so, hence a fresh parser for the next response.
            self.done = True
            self.renew = True

    def on_body(self, data: bytes) -> None:
        if self.head_only:
            self.broken = True
            return
        self.body_seen = True
        self.chunks.append(data)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.headers = []
            self.framed = False
            return
        self.done = True

    def feed(self, data: bytes, phase: Phase, max_header_bytes: int) -> None:
        """Parse `data`; protocol errors and an oversized head raise."""
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self.done:
                raise UpstreamProtocolError(
                    f"{self.name}: unexpected protocol upgrade", phase
                ) from None
            self.broken = True
        except httptools.HttpParserError as exc:
            if self.done:
                self.broken = True  # garbage after a complete response
                return
            cause = exc.__context__
            if isinstance(cause, _Fail):
                message = str(cause)
            elif isinstance(cause, Exception):
                message = f"response parsing failed: {cause!r}"
            else:
                message = f"malformed response: {exc}"
            raise UpstreamProtocolError(f"{self.name}: {message}", phase) from None
        if not self.head_done and self.received > max_header_bytes:
            raise UpstreamProtocolError(f"{self.name}: response head too large", phase)


class ResponseBody:
    """The body of an `UpstreamResponse`: an async iterator of raw bytes, as they arrive.

    Chunked bodies come de-chunked; bytes that arrived together come as one
    piece. Iteration ends at the end of the message. A read that fails
    (timeout, reset, protocol error, cancellation) closes the connection and
    ends the body."""

    __slots__ = ("_chunks", "_conn", "_pool")

    def __init__(self, pool: UpstreamPool, conn: _Conn | None, chunks: list[bytes]) -> None:
        self._pool = pool
        self._conn = conn  # None once the message is complete (or abandoned)
        self._chunks = chunks  # bytes parsed and not yet handed out

    @property
    def complete(self) -> bool:
        """Every byte of the body has been received (some may not be handed out yet)."""
        return self._conn is None

    def __aiter__(self) -> ResponseBody:
        return self

    async def __anext__(self) -> bytes:
        chunks = self._chunks
        while not chunks:
            if self._conn is None:
                raise StopAsyncIteration
            await self._pump()
        if len(chunks) == 1:
            return chunks.pop()
        data = b"".join(chunks)
        chunks.clear()
        return data

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        while self._conn is not None:
            await self._pump()
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks.pop()
        data = b"".join(chunks)
        chunks.clear()
        return data

    def close(self) -> None:
        """Abandon the body: close the connection unless the body was fully received."""
        conn = self._conn
        self._chunks.clear()
        if conn is not None:
            self._conn = None
            self._pool._close(conn)

    async def aclose(self) -> None:
        self.close()

    async def _pump(self) -> None:
        """One read from the socket into the parser."""
        conn = self._conn
        assert conn is not None
        pool = self._pool
        try:
            sock = conn.sock
            while True:
                try:
                    data = sock.recv(_RECV_SIZE)
                    break
                except BlockingIOError:
                    pass
                except OSError:
                    data = b""
                    break
                deadline = trio.current_time() + pool.limits.idle_timeout_s
                if conn.body_seen or deadline >= conn.first_deadline:
                    await pool._wait(conn, True, deadline, "body", "response body stalled")
                else:  # a stream's head comes before the prefill: see ``_read_head``
                    await pool._wait(
                        conn, True, conn.first_deadline, "body", "no first body byte in time"
                    )
            if data:
                conn.feed(data, "body", pool.limits.max_header_bytes)
            elif conn.framed:
                raise UpstreamReset(f"{conn.name}: connection closed mid-body", "body", False)
            else:
                conn.done = True  # a close-delimited body ends at EOF
                conn.keep_alive = False
        except BaseException:
            self._conn = None
            pool._close(conn)
            raise
        if conn.done:
            self._conn = None
            pool._release(conn)


@attrs.frozen
class UpstreamResponse:
    """A response whose head has arrived; its body is read through `body_iter`."""

    status: int
    headers: Headers
    body_iter: ResponseBody

    async def read(self) -> bytes:
        """The (rest of the) body, whole; the connection is then back in the pool."""
        return await self.body_iter.read()

    async def aclose(self) -> None:
        """Abandon the response: closes the connection unless the body was fully read."""
        self.body_iter.close()


class _Stream:
    """`UpstreamPool.stream`: the response, closed (or released) on exit."""

    __slots__ = ("_args", "_pool", "_response")

    def __init__(self, pool: UpstreamPool, args: tuple[Any, ...]) -> None:
        self._pool = pool
        self._args = args
        self._response: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        self._response = await self._pool.request(*self._args)
        return self._response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        response = self._response
        if response is not None:
            self._response = None
            response.body_iter.close()


def _request_head(
    method: str,
    host: str,
    port: int,
    target: str,
    headers: Iterable[tuple[str, str]],
    body_len: int,
) -> tuple[bytes, bool]:
    """-> (request head, whether the caller asked for Connection: close)."""
    lines = [f"{method} {target} HTTP/1.1\r\n"]
    has_host = False
    close = False
    for name, value in headers:
        if len(name) in _SPECIAL_LENGTHS:
            key = name.lower()
            if key == "host":
                has_host = True
            elif key == "content-length" or key == "transfer-encoding":
                continue  # the pool frames the body
            elif key == "connection":
                close = "close" in value.lower()
        lines.append(f"{name}: {value}\r\n")
    if not has_host:
        lines.append(f"host: {join_hostport(host, port)}\r\n")
    if body_len or method in _BODY_METHODS:
        lines.append(f"content-length: {body_len}\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    # Every element of `lines` holds exactly one CRLF; more would smuggle in a line.
    if (
        text.count("\n") != len(lines)
        or text.count("\r") != len(lines)
        or " " in target
        or " " in method
    ):
        raise ValueError("CR, LF or space in the request line or a header")
    return text.encode("latin-1"), close


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to upstreams; see the module docstring.

    Not thread-safe; one trio run. ``connections_opened`` counts every
    connection ever made, ``idle_count(host, port)`` the pooled ones."""

    def __init__(self, limits: ClientLimits = ClientLimits()) -> None:
        self.limits = limits
        self.connections_opened = 0
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = {}
        # Weak: a response dropped unread and unclosed must not pin its socket forever
        # (the garbage collector closes it, with a ResourceWarning).
        self._open: weakref.WeakSet[_Conn] = weakref.WeakSet()
        self._closed = False
        shortest = min(limits.idle_timeout_s, limits.first_byte_timeout_s, limits.write_timeout_s)
        self._deadlines: SocketDeadlines[_Conn] = SocketDeadlines(
            min(1.0, shortest / 4), self._close
        )

    # ------------------------------------------------------------------ stats
    def idle_count(self, host: str, port: int) -> int:
        """Connections to (host, port) waiting in the pool."""
        idle = self._idle.get((host, port))
        return len(idle) if idle is not None else 0

    @property
    def open_connections(self) -> int:
        """Connections open now, pooled or in use."""
        return len(self._open)

    # ------------------------------------------------------------------ API
    async def request(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> UpstreamResponse:
        """Send a request and wait for its response head; the body is left unread.

        Read the body (``read()`` or ``body_iter``) or ``aclose()`` the
        response; ``stream`` does the latter for you. Raises `UpstreamError`
        subclasses, and `ValueError` for a request that cannot be framed."""
        head, close = _request_head(method, host, port, target, headers, len(body))
        head_only = method == "HEAD"
        key = (host, port)
        idle = self._idle.get(key)
        stale: UpstreamReset | None = None
        if idle:
            conn = self._take(idle)
            if conn is not None:
                try:
                    return await self._exchange(conn, head, body, head_only, close)
                except UpstreamReset as exc:
                    if not exc.before_response or self._closed:
                        raise
                    # A stale keep-alive connection: the upstream never saw the
                    # request. Once more on a fresh connection.
                    stale = exc
        if self._closed:
            raise ConnectFailed(f"{host}:{port}: the pool is closed")
        try:
            conn = await self._connect(host, port, key)
        except ConnectFailed:
            if stale is None:
                raise
            # closed under the request, then no connection: the upstream died with the
            # request on it (it may have been what killed it), which is not "refused"
            raise stale from None
        return await self._exchange(conn, head, body, head_only, close)

    def stream(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """``async with pool.stream(...) as response``: `request`, and on exit
        (cancellation included) the connection is released if the body was
        read to its end and closed at once otherwise."""
        return _Stream(self, (method, host, port, target, headers, body))

    async def aclose(self) -> None:
        """Close every connection, pooled or in use; later requests fail to connect.

        A task waiting on a connection in use gets `UpstreamReset`."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._open):
            self._close(conn)
        self._deadlines.close()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------- internals
    async def _wait(
        self, conn: _Conn, readable: bool, deadline: float, phase: Phase, late: str
    ) -> None:
        """Wait until `conn` can be read (or written), by ``deadline``.

        Raises:
            UpstreamTimeout: the deadline passed first (``late`` says what was
                late); the connection is closed.
            UpstreamReset: the pool was closed under us.
        """
        await self._deadlines.wait(conn, readable, deadline)
        if conn.expired:
            raise UpstreamTimeout(f"{conn.name}: {late}", phase)
        if conn.closed:
            raise UpstreamReset(f"{conn.name}: the pool was closed", phase, False)

    def _take(self, idle: collections.deque[_Conn]) -> _Conn | None:
        """The most recently pooled connection still within idle_keepalive_s."""
        horizon = trio.current_time() - self.limits.idle_keepalive_s
        conn = idle.pop()
        if conn.idle_since >= horizon:
            return conn
        # Expired, and everything pooled before it too.
        self._close(conn)
        while idle:
            self._close(idle.popleft())
        return None

    def _release(self, conn: _Conn) -> None:
        """A response completed: pool its connection, or close it."""
        if not conn.keep_alive or conn.broken or self._closed:
            self._close(conn)
            return
        limits = self.limits
        if limits.max_idle_per_host <= 0:
            self._close(conn)
            return
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = collections.deque()
        now = trio.current_time()
        horizon = now - limits.idle_keepalive_s
        while idle and (idle[0].idle_since < horizon or len(idle) >= limits.max_idle_per_host):
            self._close(idle.popleft())
        conn.idle_since = now
        conn.reused = True
        idle.append(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._open.discard(conn)
        sock = conn.sock
        trio.lowlevel.notify_closing(sock)
        sock.close()
        conn.parser = None  # break the parser <-> callbacks cycle
        conn.chunks = []

    async def _connect(self, host: str, port: int, key: tuple[str, int]) -> _Conn:
        try:
            with trio.fail_after(self.limits.connect_timeout_s):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise ConnectTimeout(f"{host}:{port}: connect timed out", "connect") from None
        except OSError as exc:
            raise ConnectFailed(f"{host}:{port}: connect failed: {exc}") from exc
        sock = socket.socket(fileno=stream.socket.detach())
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        conn = _Conn(sock, key)
        self.connections_opened += 1
        self._open.add(conn)
        if self._closed:  # closed while connecting
            self._close(conn)
            raise ConnectFailed(f"{host}:{port}: the pool is closed")
        return conn

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes, head_only: bool, close: bool
    ) -> UpstreamResponse:
        """Send the request on `conn` and read the response head."""
        conn.start(head_only)
        try:
            if len(body) <= _LARGE_BODY:
                await self._send(conn, head + body if body else head)
            else:
                await self._send(conn, head)
                await self._send(conn, body)
            await self._read_head(conn)
        except BaseException:
            self._close(conn)
            raise
        if close:
            conn.keep_alive = False
        done = conn.done
        reader = ResponseBody(self, None if done else conn, conn.chunks)
        if done:
            self._release(conn)
        return UpstreamResponse(conn.status, Headers(conn.headers), reader)

    async def _send(self, conn: _Conn, data: bytes) -> None:
        """Write all of `data`; one system call when the socket buffer has room."""
        sock = conn.sock
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise UpstreamReset(f"{conn.name}: send failed: {exc}", "send", True) from exc
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        timeout = self.limits.write_timeout_s
        while view:
            deadline = trio.current_time() + timeout
            await self._wait(conn, False, deadline, "send", "sending the request timed out")
            try:
                sent = sock.send(view)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise UpstreamReset(f"{conn.name}: send failed: {exc}", "send", True) from exc
            view = view[sent:]

    async def _read_head(self, conn: _Conn) -> None:
        """Read until the response head is parsed (interim 1xx responses skipped)."""
        sock = conn.sock
        limits = self.limits
        deadline = conn.first_deadline = trio.current_time() + limits.first_byte_timeout_s
        while not conn.head_done:
            # The answer cannot be there yet: wait before the first read.
            await self._wait(conn, True, deadline, "head", "no response head in time")
            try:
                data = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                before = conn.received == 0
                what = "without a response" if before else "mid-head"
                raise UpstreamReset(f"{conn.name}: connection closed {what}", "head", before)
            conn.feed(data, "head", limits.max_header_bytes)

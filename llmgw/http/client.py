"""A lean HTTP/1.1 client pool on trio, parsing responses with httptools (llhttp).

Used by the router to proxy requests to engines on a private network.

Theory of operation
===================

Connections. One ``UpstreamConn`` per TCP connection: a non-blocking stdlib
socket (TCP_NODELAY) and one ``httptools.HttpResponseParser`` kept for the
life of the connection (``_upstream_conn.py``: the request head's framing and
the response's parsing; ``upstream_errors.py``: what can fail, by phase). As
in the server (``_connection.py``), sockets are driven with
``trio.lowlevel.wait_readable`` / ``wait_writable``: an operation that can
complete at once is one system call, and a task blocks only when the kernel
says it must. Every blocking wait has a deadline from
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
from typing import Any

import attrs
import trio

from ._deadlines import SocketDeadlines
from ._upstream_conn import UpstreamConn, request_head
from .types import Headers
from .upstream_errors import (
    ConnectFailed,
    ConnectTimeout,
    Phase,
    UpstreamReset,
    UpstreamTimeout,
)

_RECV_SIZE = 65536
_LARGE_BODY = 65536  # above this, head and body are sent separately rather than copied together


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


class ResponseBody:
    """The body of an `UpstreamResponse`: an async iterator of raw bytes, as they arrive.

    Chunked bodies come de-chunked; bytes that arrived together come as one
    piece. Iteration ends at the end of the message. A read that fails
    (timeout, reset, protocol error, cancellation) closes the connection and
    ends the body."""

    __slots__ = ("_chunks", "_conn", "_pool")

    def __init__(self, pool: UpstreamPool, conn: UpstreamConn | None, chunks: list[bytes]) -> None:
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


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to upstreams; see the module docstring.

    Not thread-safe; one trio run. ``connections_opened`` counts every
    connection ever made, ``idle_count(host, port)`` the pooled ones."""

    def __init__(self, limits: ClientLimits = ClientLimits()) -> None:
        self.limits = limits
        self.connections_opened = 0
        self._idle: dict[tuple[str, int], collections.deque[UpstreamConn]] = {}
        # Weak: a response dropped unread and unclosed must not pin its socket forever
        # (the garbage collector closes it, with a ResourceWarning).
        self._open: weakref.WeakSet[UpstreamConn] = weakref.WeakSet()
        self._closed = False
        shortest = min(limits.idle_timeout_s, limits.first_byte_timeout_s, limits.write_timeout_s)
        self._deadlines: SocketDeadlines[UpstreamConn] = SocketDeadlines(
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
        head, close = request_head(method, host, port, target, headers, len(body))
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
        self, conn: UpstreamConn, readable: bool, deadline: float, phase: Phase, late: str
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

    def _take(self, idle: collections.deque[UpstreamConn]) -> UpstreamConn | None:
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

    def _release(self, conn: UpstreamConn) -> None:
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

    def _close(self, conn: UpstreamConn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._open.discard(conn)
        sock = conn.sock
        trio.lowlevel.notify_closing(sock)
        sock.close()
        conn.parser = None  # break the parser <-> callbacks cycle
        conn.chunks = []

    async def _connect(self, host: str, port: int, key: tuple[str, int]) -> UpstreamConn:
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
        conn = UpstreamConn(sock, key)
        self.connections_opened += 1
        self._open.add(conn)
        if self._closed:  # closed while connecting
            self._close(conn)
            raise ConnectFailed(f"{host}:{port}: the pool is closed")
        return conn

    async def _exchange(
        self, conn: UpstreamConn, head: bytes, body: bytes, head_only: bool, close: bool
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

    async def _send(self, conn: UpstreamConn, data: bytes) -> None:
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

    async def _read_head(self, conn: UpstreamConn) -> None:
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

"""One client connection: parse requests, run the handler, write responses.

See the theory of operation at the top of ``server.py``. Everything here runs
on a non-blocking stdlib socket driven with ``trio.lowlevel.wait_readable`` /
``wait_writable``: a read or write that can complete at once costs one system
call and no trip through trio's scheduler.
"""

from __future__ import annotations

import collections
import logging
import socket
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httptools
import trio

from . import _wire
from .types import Headers, Request, Response

if TYPE_CHECKING:
    from .server import HttpServer

logger = logging.getLogger("llmgw.http")

_RECV_SIZE = 65536
_LARGE_BODY = 65536  # above this, head and body are sent separately rather than copied together
_LINGER_S = 2.0  # after a server-side close, how long to drain what the client still sends
_LINGER_BYTES = 1024 * 1024
_EARLY_BYTES = 256 * 1024  # pipelined bytes read while a handler runs, before watching pauses

# Request headers the parser callbacks look at as they arrive.
_SPECIAL = frozenset(("content-length", "transfer-encoding", "expect", "host"))
# Response headers the server owns (framing and connection management).
_FRAMING = frozenset(("content-length", "transfer-encoding", "connection"))

_METHODS = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")}


class _Reject(Exception):
    """Raised inside a parser callback to stop parsing with an error response."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


class _Timeout(Exception):
    """A read deadline passed (or drain ended an idle wait)."""


class _PeerGone(Exception):
    """The client reset or closed the connection under a write, or a write timed out."""


class _BadResponse(Exception):
    """The handler's response cannot be framed as given."""


class _Message:
    """Parser-side state of one request while it is being read."""

    __slots__ = (
        "body",
        "body_len",
        "chunked",
        "content_length",
        "done",
        "expect_continue",
        "has_host",
        "head_bytes",
        "head_done",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "url",
        "version",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.body_len = 0
        self.head_bytes = 0
        self.head_done = False
        self.done = False
        self.content_length: int | None = None
        self.chunked = False
        self.expect_continue = False
        self.has_host = False
        self.keep_alive = False
        self.method = ""
        self.path = ""
        self.query = ""
        self.version = ""


def _split_target(url: bytes) -> tuple[str, str]:
    """Request target -> (percent-decoded path, raw query)."""
    if url[:1] == b"/":
        target = url.decode("latin-1")
        if "#" in target:
            target = target.partition("#")[0]
        path, _, query = target.partition("?")
    elif url == b"*":
        return "*", ""
    else:  # absolute form
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            raise _Reject(400, "malformed request target") from None
        path = (parsed.path or b"/").decode("latin-1")
        query = (parsed.query or b"").decode("latin-1")
    if "%" in path:
        path = unquote(path, errors="replace")
    return path, query


class Connection:
    """State of one accepted connection; `run` is its main loop."""

    def __init__(
        self, server: HttpServer, sock: socket.socket, client: tuple[str, int]
    ) -> None:
        self.server = server
        self.limits = server.limits
        self.sock = sock
        self.client = client
        self.parser = httptools.HttpRequestParser(self)
        self.msgs: collections.deque[_Message] = collections.deque()
        self.cur: _Message | None = None
        # Set when parsing stopped for good: (status, message) answered after every
        # already complete request; status 0 means close without a response.
        self.failure: tuple[int, str] | None = None
        self.progress = False  # some parser callback ran during the current feed
        self.stall = 0  # bytes fed without any callback (one header or framing piece)
        self.waited = False  # the main task blocked since the last response
        self.idle_scope: trio.CancelScope | None = None
        # Disconnect watching (see server.py).
        self.nursery: trio.Nursery | None = None
        self.handler_scope: trio.CancelScope | None = None
        self.watch_scope: trio.CancelScope | None = None
        self.watcher: trio.lowlevel.Task | None = None
        self.watcher_spawned = False
        self.watcher_parked = False
        self.peer_gone = False
        self.early: list[bytes] = []
        self.early_len = 0

    # ----------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        self.progress = True
        msg = _Message()
        self.cur = msg
        self.msgs.append(msg)

    def on_url(self, url: bytes) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.url += url
        msg.head_bytes += len(url)
        if msg.head_bytes > self.limits.max_header_bytes:
            raise _Reject(431, "request header too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.head_bytes += len(name) + len(value) + 4
        if msg.head_bytes > self.limits.max_header_bytes:
            raise _Reject(431, "request header too large")
        if msg.head_done:
            return  # a chunked trailer: bounded above, otherwise ignored
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        msg.headers.append((key, text))
        if key in _SPECIAL:
            if key == "content-length":
                msg.content_length = int(text)  # llhttp has validated it
            elif key == "transfer-encoding":
                if text.strip().lower() != "chunked" or msg.chunked:
                    raise _Reject(501, f"transfer-encoding {text!r} is not supported")
                msg.chunked = True
            elif key == "expect":
                if text.strip().lower() != "100-continue":
                    raise _Reject(417, f"expectation {text!r} is not supported")
                msg.expect_continue = True
            else:
                msg.has_host = True

    def on_headers_complete(self) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        parser = self.parser
        version = parser.get_http_version()
        if version == "1.1":
            msg.version = "1.1"
            if not msg.has_host:
                raise _Reject(400, "missing Host header")
        elif version == "1.0":
            msg.version = "1.0"
            msg.expect_continue = False  # HTTP/1.0 clients cannot expect it
        else:
            raise _Reject(505, f"HTTP/{version} is not supported")
        raw_method = parser.get_method()
        method = _METHODS.get(raw_method) or raw_method.decode("ascii")
        msg.method = method
        msg.keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():
            # Serve it as a plain request (the upgrade is declined) and close after.
            if method == "CONNECT":
                raise _Reject(501, "CONNECT is not supported")
            if msg.chunked or msg.content_length:
                raise _Reject(501, "protocol upgrade with a request body is not supported")
            msg.keep_alive = False
        if msg.content_length is not None and msg.content_length > self.limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        msg.path, msg.query = _split_target(msg.url)
        msg.head_bytes = 0  # from here on it counts trailers
        msg.head_done = True

    def on_body(self, data: bytes) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.body_len += len(data)
        if msg.body_len > self.limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        msg.body.append(data)

    def on_chunk_header(self) -> None:
        self.progress = True

    def on_chunk_complete(self) -> None:
        self.progress = True

    def on_message_complete(self) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.done = True
        self.cur = None

    # ------------------------------------------------------------------ parsing
    def _feed(self, data: bytes) -> None:
        """Feed bytes to the parser; turn its errors into `self.failure`."""
        self.progress = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.failure = (0, "")  # the upgrade request itself completed; nothing after it
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self.failure = (cause.status, cause.message)
            elif isinstance(cause, Exception):
                logger.error("%s: request parsing failed", self.server.name, exc_info=cause)
                self.failure = (500, "internal server error")
            else:
                self.failure = (400, f"malformed request: {exc}")
        else:
            if self.progress:
                self.stall = 0
                return
            # No callback fired: all of `data` belongs to one header (or piece of
            # chunk framing / trailer) the parser buffers until it ends. Bound it.
            self.stall += len(data)
            if self.stall <= self.limits.max_header_bytes:
                return
            msg = self.cur
            if msg is None or not msg.head_done:
                self.failure = (431, "request header too large")
            else:
                self.failure = (400, "chunk framing or trailers too large")
        # Parsing is over: a request that had not completed never will.
        self.cur = None
        msgs = self.msgs
        while msgs and not msgs[-1].done:
            msgs.pop()

    # ------------------------------------------------------------------- reading
    async def _recv(self, deadline: float, *, idle: bool = False) -> bytes:
        """Next bytes from the client (b"" at EOF); `_Timeout` past `deadline`."""
        if self.early:
            data = b"".join(self.early)
            self.early.clear()
            self.early_len = 0
            return data
        sock = self.sock
        while True:
            try:
                return sock.recv(_RECV_SIZE)
            except BlockingIOError:
                pass
            except OSError:
                return b""
            if idle and self.server.draining:
                raise _Timeout
            self.waited = True
            with trio.CancelScope(deadline=deadline) as scope:
                if idle:
                    self.idle_scope = scope
                await trio.lowlevel.wait_readable(sock)
            self.idle_scope = None
            if scope.cancelled_caught:
                raise _Timeout

    async def _read_head(self, first: bool) -> bool:
        """Read until the next request head is complete (or parsing failed).

        False: the connection ended quietly (EOF, idle timeout, drain)."""
        limits = self.limits
        msgs = self.msgs
        if self.cur is None and self.stall == 0:
            # Idle: no byte of the next request yet.
            idle_for = limits.header_timeout_s if first else limits.keepalive_timeout_s
            try:
                data = await self._recv(trio.current_time() + idle_for, idle=True)
            except _Timeout:
                return False
            if not data:
                return False
            self._feed(data)
        deadline = trio.current_time() + limits.header_timeout_s
        while self.failure is None and not (msgs and msgs[0].head_done):
            data = await self._recv(deadline)
            if not data:
                return False
            self._feed(data)
        return True

    async def _read_body(self, msg: _Message) -> bool:
        """Read until `msg` is complete (or parsing failed). False at EOF."""
        deadline = trio.current_time() + self.limits.body_timeout_s
        while not msg.done and self.failure is None:
            data = await self._recv(deadline)
            if not data:
                return False
            self._feed(data)
        return True

    # ------------------------------------------------------------------- writing
    async def _send_all(self, data: bytes) -> None:
        """Write all of `data`; one system call when the socket buffer has room."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise _PeerGone from exc
        if sent < len(data):
            await self._send_rest(memoryview(data)[sent:])

    async def _send_rest(self, view: memoryview) -> None:
        sock = self.sock
        while view:
            with trio.move_on_after(self.limits.write_timeout_s) as scope:
                await trio.lowlevel.wait_writable(sock)
            if scope.cancelled_caught:
                raise _PeerGone("write timed out")
            try:
                sent = sock.send(view)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _PeerGone from exc
            view = view[sent:]

    async def _linger(self) -> None:
        """Half-close, then drain what the client still sends before the close.

        Closing with unread input makes the kernel send a reset, which can
        destroy the response we just wrote before the client reads it."""
        sock = self.sock
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        total = 0
        with trio.move_on_after(_LINGER_S):
            while total < _LINGER_BYTES:
                try:
                    data = sock.recv(_RECV_SIZE)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
                    continue
                except OSError:
                    return
                if not data:
                    return
                total += len(data)

    async def _send_error(self, status: int, message: str) -> None:
        """Answer a protocol error or timeout, then close (lingering)."""
        if status == 0:
            return
        try:
            await self._send_all(
                _wire.error_response(self.server.error_body, status, message, keep_alive=False)
            )
        except _PeerGone:
            return
        await self._linger()

    # ---------------------------------------------------------------- main loop
    async def run(self) -> None:
        """Serve requests one at a time until the connection should close."""
        msgs = self.msgs
        first = True
        while True:
            if not (msgs and msgs[0].head_done):
                if self.failure is None:
                    if self.server.draining and not msgs and self.cur is None:
                        return
                    try:
                        if not await self._read_head(first):
                            return
                    except _Timeout:
                        await self._send_error(408, "timed out reading the request head")
                        return
                if not (msgs and msgs[0].head_done):
                    assert self.failure is not None
                    await self._send_error(*self.failure)
                    return
            first = False
            msg = msgs[0]
            if not msg.done:
                try:
                    if msg.expect_continue and self.failure is None:
                        await self._send_all(_wire.CONTINUE)
                    if not await self._read_body(msg):
                        return
                except _Timeout:
                    await self._send_error(408, "timed out reading the request body")
                    return
                except _PeerGone:
                    return
                if not msg.done:
                    assert self.failure is not None
                    await self._send_error(*self.failure)
                    return
            msgs.popleft()
            try:
                keep_alive = await self._respond(msg)
            except _PeerGone:
                return
            if not keep_alive:
                if not self.peer_gone:
                    await self._linger()
                return
            if not self.waited:
                # Pipelined requests were served from buffered bytes without ever
                # blocking: let other tasks run.
                await trio.lowlevel.checkpoint()
            self.waited = False

    async def _respond(self, msg: _Message) -> bool:
        """Run the handler for `msg` and write its response. True: keep the connection."""
        server = self.server
        body = msg.body
        request = Request(
            method=msg.method,
            path=msg.path,
            query=msg.query,
            headers=Headers(msg.headers),
            body=(body[0] if len(body) == 1 else b"".join(body)) if body else b"",
            client=self.client,
            http_version=msg.version,
        )
        server._in_flight += 1
        try:
            with trio.CancelScope() as scope:
                self.handler_scope = scope
                self._wake_watcher()
                try:
                    response = await server.handler(request)
                    return await self._write_response(msg, response)
                except (_PeerGone, trio.Cancelled):
                    raise
                except _BadResponse as exc:
                    logger.error(
                        "%s: invalid response to %s %s: %s",
                        server.name, msg.method, msg.path, exc,
                    )
                except Exception:
                    logger.exception(
                        "%s: handler failed for %s %s", server.name, msg.method, msg.path
                    )
                await self._send_all(
                    _wire.error_response(
                        server.error_body,
                        500,
                        "internal server error",
                        keep_alive=msg.keep_alive,
                        head_only=msg.method == "HEAD",
                    )
                )
                return msg.keep_alive
            return False  # cancelled: the client went away
        finally:
            server._in_flight -= 1
            self.handler_scope = None
            if self.watch_scope is not None:
                self.watch_scope.cancel()

    async def _write_response(self, msg: _Message, response: Response) -> bool:
        status = response.status
        body = response.body
        keep_alive = msg.keep_alive and not self.server.draining
        bodiless = msg.method == "HEAD" or status in (204, 304)
        if not 200 <= status <= 999:
            await _close_body(body)
            raise _BadResponse(f"status {status}")
        lines = [_wire.status_line(status)]
        declared: str | None = None
        for name, value in response.headers:
            key = name.lower()
            if key in _FRAMING:
                if key == "connection":
                    if "close" in value.lower():
                        keep_alive = False
                    continue
                if key == "transfer-encoding":
                    await _close_body(body)
                    raise _BadResponse("handlers must not set transfer-encoding")
                declared = value
            lines.append(f"{name}: {value}\r\n")

        streamed: AsyncIterable[bytes] | None = None
        mode = ""
        length = 0
        if isinstance(body, bytes | bytearray | memoryview):
            payload = bytes(body) if not isinstance(body, bytes) else body
            if declared is None:
                if status != 204 and status != 304:
                    lines.append(f"content-length: {len(payload)}\r\n")
            elif not bodiless and (
                not (declared.isascii() and declared.isdigit()) or int(declared) != len(payload)
            ):
                raise _BadResponse(f"content-length {declared!r} for {len(payload)} bytes")
            if bodiless:
                payload = b""
        else:
            payload = b""
            if bodiless:
                await _close_body(body)
            else:
                streamed = body
                if declared is not None:
                    if not (declared.isascii() and declared.isdigit()):
                        await _close_body(body)
                        raise _BadResponse(f"content-length {declared!r}")
                    mode = "length"
                    length = int(declared)
                elif msg.version == "1.1":
                    mode = "chunked"
                    lines.append("transfer-encoding: chunked\r\n")
                else:
                    mode = "eof"  # HTTP/1.0 without a length: the close ends the body
                    keep_alive = False
        if keep_alive:
            if msg.version == "1.0":
                lines.append("connection: keep-alive\r\n")
        else:
            lines.append("connection: close\r\n")
        lines.append(_wire.date_line())
        lines.append("\r\n")
        text = "".join(lines)
        # Every element of `lines` holds exactly one CRLF; more means a header
        # name or value tried to smuggle in a line of its own.
        if text.count("\n") != len(lines) or text.count("\r") != len(lines):
            await _close_body(streamed)
            raise _BadResponse("CR or LF in a response header")
        try:
            head = text.encode("latin-1")
        except UnicodeEncodeError:
            await _close_body(streamed)
            raise _BadResponse("response header is not latin-1") from None

        if streamed is None:
            if len(payload) <= _LARGE_BODY:
                await self._send_all(head + payload if payload else head)
            else:
                await self._send_all(head)
                await self._send_all(payload)
            return keep_alive
        await self._send_all(head)
        await self._stream(streamed, mode, length, msg)
        return keep_alive

    async def _stream(
        self, body: AsyncIterable[bytes], mode: str, length: int, msg: _Message
    ) -> None:
        """Write each chunk as soon as the handler yields it."""
        sent = 0
        finished = False
        try:
            async for chunk in body:
                if not chunk:
                    continue
                if mode == "chunked":
                    await self._send_all(b"".join((b"%x\r\n" % len(chunk), chunk, _wire.CRLF)))
                else:
                    sent += len(chunk)
                    if mode == "length" and sent > length:
                        raise _BadResponse(f"streamed body exceeds content-length {length}")
                    await self._send_all(bytes(chunk))
            finished = True
            if mode == "chunked":
                await self._send_all(_wire.LAST_CHUNK)
            elif mode == "length" and sent != length:
                raise _BadResponse(f"streamed body of {sent} bytes, content-length {length}")
        except (_PeerGone, trio.Cancelled):
            raise
        except Exception as exc:
            # The head is out: nothing to do but cut the connection, so the client
            # sees a truncated body rather than a complete wrong one.
            logger.error(
                "%s: response stream for %s %s failed",
                self.server.name, msg.method, msg.path, exc_info=exc,
            )
            raise _PeerGone("response stream failed") from exc
        finally:
            if not finished:
                await _close_body(body)

    # ------------------------------------------------------- disconnect watching
    def _wake_watcher(self) -> None:
        if not self.watcher_spawned:
            self.watcher_spawned = True
            assert self.nursery is not None
            self.nursery.start_soon(self._watch)
        elif self.watcher_parked:
            self.watcher_parked = False
            assert self.watcher is not None
            trio.lowlevel.reschedule(self.watcher)

    def _abort_park(self, _: Any) -> trio.lowlevel.Abort:
        self.watcher_parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    async def _watch(self) -> None:
        """Watcher task: while a handler runs, read the socket to notice the client leave."""
        self.watcher = trio.lowlevel.current_task()
        last: trio.CancelScope | None = None
        while True:
            scope = self.handler_scope
            if scope is None or scope is last:
                self.watcher_parked = True
                await trio.lowlevel.wait_task_rescheduled(self._abort_park)
                continue
            last = scope
            await self._watch_one(scope)

    async def _watch_one(self, handler_scope: trio.CancelScope) -> None:
        sock = self.sock
        with trio.CancelScope() as scope:
            self.watch_scope = scope
            try:
                # Checked before every read: once the request is over, the main
                # task owns the socket's input again.
                while not scope.cancel_called and self.handler_scope is handler_scope:
                    try:
                        data = sock.recv(_RECV_SIZE)
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(sock)
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self.peer_gone = True
                        handler_scope.cancel()
                        return
                    # Pipelined bytes: kept for the main task, in order.
                    self.early.append(data)
                    self.early_len += len(data)
                    if self.early_len >= _EARLY_BYTES:
                        return  # stop reading until the next request
            finally:
                if self.watch_scope is scope:
                    self.watch_scope = None


async def _close_body(body: object) -> None:
    """Close an async generator body the server will not finish iterating."""
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            logger.exception("closing a response body failed")

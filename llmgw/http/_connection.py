"""One client connection: read requests, run the handler, write responses.

See the theory of operation at the top of ``server.py``. Everything here runs
on a non-blocking stdlib socket driven with ``trio.lowlevel.wait_readable`` /
``wait_writable``: a read or write that can complete at once costs one system
call and no trip through trio's scheduler.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterable
from typing import Any

import trio

from . import _wire
from ._budget import BodyBudget
from ._deadlines import SocketDeadlines
from ._framing import BadResponse, Framed, frame_response
from ._parsing import FULL, Message, RequestParser
from ._throttle import Throttled
from .logsafe import printable
from .types import Admit, ErrorBody, Handler, Request, Response, ServerLimits, default_error_body

logger = logging.getLogger("llmgw.http")

_RECV_SIZE = 65536
_LARGE_BODY = 65536  # above this, head and body are sent separately rather than copied together
_LINGER_S = 2.0  # after a server-side close, how long to drain what the client still sends
_LINGER_BYTES = 1024 * 1024
_EARLY_BYTES = 256 * 1024  # pipelined bytes read while a handler runs, before watching pauses
_VICTIM_SCAN = 64  # connections looked at, oldest first, for one to close at the limit


class _Timeout(Exception):
    """A read deadline passed (or drain ended an idle wait)."""


class _Interrupted(Exception):
    """A read was ended from outside: the budget dropped the body being read."""


class _TooSlow(Exception):
    """A request body arrived slower than ``min_body_rate``."""


class _PeerGone(Exception):
    """The client reset or closed the connection under a write, or a write timed out."""


class Shared:
    """What a server shares with its connections: all a connection reads of its
    server, and the things it changes (``in_flight``; the bytes charged to
    ``budget``; ``deadlines``' waits)."""

    __slots__ = (
        "_error_body",
        "admit",
        "budget",
        "deadlines",
        "draining",
        "handler",
        "in_flight",
        "limits",
        "name",
        "reserve_answer",
        "reserve_from",
        "untrusted",
        "warn_dropped",
        "warn_full",
        "warn_reserve",
        "warn_slow_body",
        "warn_slow_reader",
    )

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits,
        name: str,
        error_body: ErrorBody,
        deadlines: SocketDeadlines[Connection],
        admit: Admit | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.name = name
        self.admit = admit
        self.budget = BodyBudget(limits.max_bodies_bytes)  # request bodies held, all connections
        self._error_body = error_body
        self.deadlines = deadlines  # waits for a kept-alive connection's next request
        self.draining = False
        self.in_flight = 0  # requests whose handler runs or whose response is being written
        # Connections none of whose requests proved who sent them, oldest first: the
        # ones closed to make room at the connection limit, and the ones kept out of
        # the reserved connections.
        self.untrusted: dict[Connection, None] = {}
        self.reserve_from = limits.max_connections - limits.reserved_connections
        content_type, body = self.error_body(
            503, "the server keeps its last connections for requests with credentials; retry"
        )
        self.reserve_answer = (content_type, body)
        self.warn_reserve = Throttled(
            "%s: %d connections prove nobody, the most it lets in before its reserved"
            " ones; refused a request from %s that proves nobody"
        )
        self.warn_slow_body = Throttled(
            "%s: cut the request body from %s: %d bytes in the last %g s, under the floor"
            " of %g bytes/s; it got a 408"
        )
        self.warn_dropped = Throttled(
            "%s: dropped a request body still arriving from %s (%s): a client holding"
            " less of the %d MiB for request bodies needed room; it got a 503"
        )
        self.warn_full = Throttled(
            "%s: the %d MiB for request bodies is full; refused a body from %s (%s) with 503"
        )
        self.warn_slow_reader = Throttled(
            "%s: %s took no response bytes for %g s; its connection is cut and its"
            " request cancelled"
        )

    def victim(self, sparing: Connection | None = None) -> Connection | None:
        """The connection to close for another: the oldest that proved nobody and waits
        for a request head (``sparing`` aside); None when there is none."""
        for i, conn in enumerate(self.untrusted):
            if i >= _VICTIM_SCAN:
                break
            if conn.awaiting_head and not conn.evicted and conn is not sparing:
                return conn
        return None

    def error_body(self, status: int, message: str) -> tuple[str, bytes]:
        """The configured error body; the default one if it fails."""
        try:
            return self._error_body(status, message)
        except Exception:
            logger.exception("%s: error_body failed", self.name)
            return default_error_body(status, message)


class Connection:
    """State of one accepted connection; `run` is its main loop."""

    def __init__(self, server: Shared, sock: socket.socket, client: tuple[str, int]) -> None:
        self.server = server
        self.limits = server.limits
        self.sock = sock
        self.client = client
        self.requests = RequestParser(
            server.limits,
            server.name,
            client,
            server.admit,
            server.budget,
            self._gate,
            self._interrupt,
        )
        self.trusted = False  # one of its requests proved who sent it
        self.awaiting_head = False  # reading a request head (or waiting for one)
        self.evicted = False  # closed at the connection limit to make room
        self.read_scope: trio.CancelScope | None = None  # a read for a head or a body
        self.waited = False  # the main task blocked since the last response
        # The wait for the next request's first byte (server.deadlines): its
        # deadline, and whether it passed (or drain() ended the wait).
        self.deadline = 0.0
        self.expired = False
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

    def dispose(self) -> None:
        """Drop buffers once the connection is over."""
        self.requests.dispose()
        self.early.clear()

    # ----------------------------------------------------------------- fairness
    def _gate(self, request: Request) -> Response | None:
        """After ``admit``: a request that proved someone trusts its connection. One that
        proved nobody, while such connections fill all but the reserved ones, takes the
        place of an idle one of them (a health check during a flood of idle connections
        is served), or, with none idle, is a 503."""
        if self.trusted:
            return None
        server = self.server
        if request.principal:
            self.trusted = True
            server.untrusted.pop(self, None)
            return None
        if len(server.untrusted) > server.reserve_from:
            victim = server.victim(self)
            if victim is not None:
                victim.evict()
                return None
            server.warn_reserve.warn(server.name, server.reserve_from, self.client[0])
            content_type, body = server.reserve_answer
            return Response(503, [("content-type", content_type), ("connection", "close")], body)
        return None

    def evict(self) -> None:
        """Close this idle connection to make room for a new one (it ends quietly)."""
        self.evicted = True
        self.server.untrusted.pop(self, None)
        trio.lowlevel.notify_closing(self.sock)

    def _interrupt(self) -> None:
        """The budget dropped the body being read: wake the read to answer it."""
        dropped = self.requests.dropped
        request = dropped.request if dropped is not None else None
        server = self.server
        server.warn_dropped.warn(
            server.name,
            self.client[0],
            f"key {request.principal}" if request is not None and request.principal else "no key",
            server.budget.limit >> 20,
        )
        if self.read_scope is not None:
            self.read_scope.cancel()

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
            if self.evicted:
                return b""
            try:
                return sock.recv(_RECV_SIZE)
            except BlockingIOError:
                pass
            except OSError:
                return b""
            self.waited = True
            if idle:
                # Between requests: the common wait, so no cancel scope (see
                # _deadlines.py); the socket is closed once it expires.
                if self.server.draining:
                    raise _Timeout
                await self.server.deadlines.wait(self, True, deadline)
                if self.expired:
                    raise _Timeout
                continue
            with trio.CancelScope(deadline=deadline) as scope:
                self.read_scope = scope
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError:
                    return b""  # evicted
                finally:
                    self.read_scope = None
            if scope.cancelled_caught:
                if self.requests.failure is not None:
                    raise _Interrupted
                raise _Timeout

    async def _read_head(self, first: bool) -> bool:
        """Read until the next request head is complete (or parsing failed).

        False: the connection ended quietly (EOF, idle timeout, drain)."""
        self.awaiting_head = True
        try:
            return await self._read_head_bytes(first)
        finally:
            self.awaiting_head = False

    async def _read_head_bytes(self, first: bool) -> bool:
        limits = self.limits
        requests = self.requests
        msgs = requests.msgs
        if requests.idle:
            # Idle: no byte of the next request yet.
            idle_for = limits.header_timeout_s if first else limits.keepalive_timeout_s
            try:
                data = await self._recv(trio.current_time() + idle_for, idle=True)
            except _Timeout:
                return False
            if not data:
                return False
            requests.feed(data)
        deadline = trio.current_time() + limits.header_timeout_s
        while requests.failure is None and not (msgs and msgs[0].head_done):
            data = await self._recv(deadline)
            if not data:
                return False
            requests.feed(data)
        return True

    async def _read_body(self, msg: Message) -> bool:
        """Read until `msg` is complete (or parsing failed, or the budget dropped it).
        False at EOF. `_TooSlow` when it arrives slower than ``min_body_rate``: each
        ``body_rate_window_s`` after the first must bring its share."""
        requests = self.requests
        limits = self.limits
        now = trio.current_time()
        deadline = now + limits.body_timeout_s
        rate = limits.min_body_rate
        window = limits.body_rate_window_s
        check_at = now + window if rate > 0 else deadline  # the first window is grace
        counted: int | None = None  # bytes of the body when the current window began
        try:
            while not msg.done and requests.failure is None:
                try:
                    data = await self._recv(min(deadline, check_at))
                except _Timeout:
                    if trio.current_time() >= deadline:
                        raise
                    data = None  # a window ended with nothing more to read
                if data is not None:
                    if not data:
                        return False
                    requests.feed(data)
                if rate > 0 and trio.current_time() >= check_at:
                    if counted is not None and msg.body_len - counted < rate * window:
                        server = self.server
                        server.warn_slow_body.warn(
                            server.name, self.client[0], msg.body_len - counted, window, rate
                        )
                        raise _TooSlow
                    counted = msg.body_len
                    check_at = min(deadline, check_at + window)
        except _Interrupted:
            pass  # dropped by the budget: requests.failure says what to answer
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
                server = self.server
                server.warn_slow_reader.warn(
                    server.name, self.client[0], self.limits.write_timeout_s
                )
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
        if message is FULL:
            server = self.server
            who = self.requests.refused
            server.warn_full.warn(
                server.name,
                server.budget.limit >> 20,
                self.client[0],
                f"key {who}" if who else "no key",
            )
        logger.debug(
            "%s: %d to %s:%d: %s", self.server.name, status, *self.client, printable(message)
        )
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
        requests = self.requests
        msgs = requests.msgs
        first = True
        while True:
            if not (msgs and msgs[0].head_done):
                if requests.failure is None:
                    if self.server.draining and requests.idle and not msgs:
                        return
                    try:
                        if not await self._read_head(first):
                            return
                    except _Timeout:
                        await self._send_error(408, "timed out reading the request head")
                        return
                if not (msgs and msgs[0].head_done):
                    assert requests.failure is not None
                    await self._send_error(*requests.failure)
                    return
            first = False
            msg = msgs[0]
            if not msg.done:
                try:
                    if msg.expect_continue and requests.failure is None:
                        await self._send_all(_wire.CONTINUE)
                    if not await self._read_body(msg):
                        return
                except _Timeout:
                    await self._send_error(408, "timed out reading the request body")
                    return
                except _TooSlow:
                    await self._send_error(
                        408,
                        "the request body arrived too slowly (under"
                        f" {self.limits.min_body_rate:g} bytes/s); send it faster or smaller",
                    )
                    return
                except _PeerGone:
                    return
                if not msg.done:
                    assert requests.failure is not None
                    await self._send_error(*requests.failure)
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

    async def _respond(self, msg: Message) -> bool:
        """Write `msg`'s answer from its head, or run its handler and write its
        response; its body's bytes go back to the budget. True: keep the connection."""
        try:
            if msg.answer is not None:
                return await self._answer(msg)
            return await self._handle(msg)
        finally:
            self.requests.release(msg)

    async def _answer(self, msg: Message) -> bool:
        """Write the answer ``admit`` gave from the head; no handler runs, and no
        watcher reads a body that was refused."""
        assert msg.answer is not None
        try:
            framed = frame_response(
                msg.answer, msg.method, msg.version, msg.keep_alive and not self.server.draining
            )
        except Exception:
            logger.exception(
                "%s: invalid answer to %s %s", self.server.name, msg.method, printable(msg.path)
            )
            await _close_body(msg.answer.body)
            await self._send_all(
                _wire.error_response(
                    self.server.error_body,
                    500,
                    "internal server error",
                    keep_alive=False,
                    head_only=msg.method == "HEAD",
                )
            )
            return False
        await self._write(framed, msg)
        return framed.keep_alive

    async def _handle(self, msg: Message) -> bool:
        """Run the handler for `msg` and write its response."""
        server = self.server
        request = msg.request
        assert request is not None
        body = msg.body
        if body:
            request.body = body[0] if len(body) == 1 else b"".join(body)
            msg.body = []  # the request holds the one copy
        keep_alive = msg.keep_alive
        server.in_flight += 1
        try:
            with trio.CancelScope() as scope:
                self.handler_scope = scope
                self._wake_watcher()
                try:
                    response = await server.handler(request)
                except Exception:
                    logger.exception(
                        "%s: handler failed for %s %s", server.name, msg.method, printable(msg.path)
                    )
                else:
                    try:
                        framed = frame_response(
                            response, msg.method, msg.version, keep_alive and not server.draining
                        )
                    except BadResponse as exc:
                        logger.error(
                            "%s: invalid response to %s %s: %s",
                            server.name,
                            msg.method,
                            printable(msg.path),
                            exc,
                        )
                        await _close_body(response.body)
                    except Exception:
                        logger.exception(
                            "%s: invalid response to %s %s",
                            server.name,
                            msg.method,
                            printable(msg.path),
                        )
                        await _close_body(getattr(response, "body", None))
                    else:
                        await self._write(framed, msg)
                        return framed.keep_alive
                keep_alive = keep_alive and not server.draining
                await self._send_all(
                    _wire.error_response(
                        server.error_body,
                        500,
                        "internal server error",
                        keep_alive=keep_alive,
                        head_only=msg.method == "HEAD",
                    )
                )
                return keep_alive
            return False  # cancelled: the client went away
        finally:
            server.in_flight -= 1
            self.handler_scope = None
            if self.watch_scope is not None:
                self.watch_scope.cancel()

    async def _write(self, framed: Framed, msg: Message) -> None:
        """Write a framed response; a streamed body chunk by chunk as it is produced."""
        head = framed.head
        streamed = framed.streamed
        if streamed is None:
            payload = framed.payload
            if len(payload) <= _LARGE_BODY:
                await self._send_all(head + payload if payload else head)
            else:
                await self._send_all(head)
                await self._send_all(payload)
            return
        try:
            await self._send_all(head)
        except BaseException:
            await _close_body(streamed)  # never read: it may hold a connection of its own
            raise
        await self._stream(streamed, framed.mode, framed.length, msg)

    async def _stream(
        self, body: AsyncIterable[bytes], mode: str, length: int, msg: Message
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
                        raise BadResponse(f"streamed body exceeds content-length {length}")
                    await self._send_all(bytes(chunk))
            finished = True
            if mode == "chunked":
                await self._send_all(_wire.LAST_CHUNK)
            elif mode == "length" and sent != length:
                raise BadResponse(f"streamed body of {sent} bytes, content-length {length}")
        except (_PeerGone, trio.Cancelled):
            raise
        except Exception as exc:
            # The head is out: nothing to do but cut the connection, so the client
            # sees a truncated body rather than a complete wrong one.
            logger.error(
                "%s: response stream for %s %s failed",
                self.server.name,
                msg.method,
                printable(msg.path),
                exc_info=exc,
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

"""One client connection: read a request, have it answered, again until it should close.

``Connection.run`` is the connection's main loop; the theory of operation of
the server as a whole is at the top of ``server.py``. This module reads; the
other parts of a connection have modules of their own: writing and closing
(``_writing.py``), the rules shared with the other connections (``_shared.py``:
the connection limit, reserved connections, dropped bodies) and watching for
the client to leave while a handler runs (``_watch.py``).

Reading. Everything runs on a non-blocking stdlib socket driven with
``trio.lowlevel.wait_readable``: a read that can complete at once costs one
system call and no trip through trio's scheduler. Bytes go to the
connection's ``RequestParser`` (``_parsing.py``), which queues the messages
it completes, so pipelined requests wait in order and no early byte is lost;
bytes the watcher read while a handler ran (``early``) come first. Each wait
has its deadline:

- the first byte of the next request: ``keepalive_timeout_s`` on a kept-alive
  connection, ``header_timeout_s`` on a fresh one. This is the common wait, so
  it takes no cancel scope but one of ``SocketDeadlines``' (``_deadlines.py``),
  and ends quietly, as does ``drain()``;
- the rest of the head: ``header_timeout_s`` from its first byte (else 408);
- the body: ``body_timeout_s`` in all, and once its first
  ``body_rate_window_s`` are over, each window must bring
  ``min_body_rate`` bytes a second (else 408, counted as ``body_too_slow``),
  so a client cannot hold a body's share of the budget by trickling it.

A read is also ended from outside: by ``evict`` (the connection is closed to
make room; the read ends as at EOF) and by ``interrupt`` (the budget dropped
the body being read; the parser's ``failure`` says what to answer).

Answering. A head ``admit`` answered is written without running the
handler, and no watcher reads a body that was refused. Otherwise the body is
joined into the request (one copy), the handler runs in a cancel scope the
watcher cancels if the client leaves, and its response is framed and
written; a handler that raises, or returns what cannot be framed, gets a
logged 500. The body's bytes go back to the budget once the response is
written. Pipelined requests served from buffered bytes, without the task
ever blocking, are separated by a checkpoint so that one client cannot
monopolise the scheduler.
"""

from __future__ import annotations

import logging
import socket
import types

import trio

from . import _wire
from ._framing import BadResponse, frame_response
from ._parsing import Message, RequestParser
from ._shared import Shared, gate, interrupt
from ._watch import wake_watcher
from ._wire import RECV_SIZE
from ._writing import PeerGone, close_body, linger, send_all, send_error, write
from .logsafe import printable

logger = logging.getLogger("llmgw.http")


class _Timeout(Exception):
    """A read deadline passed (or drain ended an idle wait)."""


class _Interrupted(Exception):
    """A read was ended from outside: the budget dropped the body being read."""


class _TooSlow(Exception):
    """A request body arrived slower than ``min_body_rate``."""


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
            # Bound to this connection: called as a method is (a partial costs more).
            types.MethodType(gate, self),
            types.MethodType(interrupt, self),
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
        # Disconnect watching (_watch.py).
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
                return sock.recv(RECV_SIZE)
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
                        await send_error(self, 408, "timed out reading the request head")
                        return
                if not (msgs and msgs[0].head_done):
                    assert requests.failure is not None
                    await send_error(self, *requests.failure)
                    return
            first = False
            msg = msgs[0]
            if not msg.done:
                try:
                    if msg.expect_continue and requests.failure is None:
                        await send_all(self, _wire.CONTINUE)
                    if not await self._read_body(msg):
                        return
                except _Timeout:
                    await send_error(self, 408, "timed out reading the request body")
                    return
                except _TooSlow:
                    await send_error(
                        self,
                        408,
                        "the request body arrived too slowly (under"
                        f" {self.limits.min_body_rate:g} bytes/s); send it faster or smaller",
                    )
                    return
                except PeerGone:
                    return
                if not msg.done:
                    assert requests.failure is not None
                    await send_error(self, *requests.failure)
                    return
            msgs.popleft()
            try:
                keep_alive = await self._respond(msg)
            except PeerGone:
                return
            if not keep_alive:
                if not self.peer_gone:
                    await linger(self)
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
            await close_body(msg.answer.body)
            await send_all(
                self,
                _wire.error_response(
                    self.server.error_body,
                    500,
                    "internal server error",
                    keep_alive=False,
                    head_only=msg.method == "HEAD",
                ),
            )
            return False
        await write(self, framed, msg)
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
                wake_watcher(self)
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
                        await close_body(response.body)
                    except Exception:
                        logger.exception(
                            "%s: invalid response to %s %s",
                            server.name,
                            msg.method,
                            printable(msg.path),
                        )
                        await close_body(getattr(response, "body", None))
                    else:
                        await write(self, framed, msg)
                        return framed.keep_alive
                keep_alive = keep_alive and not server.draining
                await send_all(
                    self,
                    _wire.error_response(
                        server.error_body,
                        500,
                        "internal server error",
                        keep_alive=keep_alive,
                        head_only=msg.method == "HEAD",
                    ),
                )
                return keep_alive
            return False  # cancelled: the client went away
        finally:
            server.in_flight -= 1
            self.handler_scope = None
            if self.watch_scope is not None:
                self.watch_scope.cancel()

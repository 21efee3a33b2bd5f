"""A lean HTTP/1.1 server on trio, parsing with httptools (llhttp).

Theory of operation
===================

Accepting. One accept task per listener takes connections, sets TCP_NODELAY,
detaches the socket from trio's wrapper and spawns one task per connection
(``_connection.Connection.run``). Beyond ``max_connections_per_address`` from
one client IP address, a connection is answered with a canned 503 (in the
server's error format) and closed on the spot, with no task spawned: one
address holding connections open cannot shut every other client out. At
``max_connections``, the oldest connection that has proved nobody (no request
on it carried credentials ``admit`` accepted: ``Request.principal``) and waits
for a request head is closed to make room; only when there is none is the new
one refused with the 503. So idle connections, from however many addresses,
cannot shut out a client that sends its request at once. And connections that
prove nobody may hold all but ``reserved_connections``: past that, a request
that proves nobody takes the place of an idle such connection (so a health
check is still served), or, with none idle, is answered 503 and its
connection closed (``_shared.py``).

The connection loop. A connection serves one request at a time:

1. Read until a request head is complete. Bytes go to one
   ``httptools.HttpRequestParser`` per connection; its callbacks build a
   ``Message`` per request in a queue. The parser may complete several
   pipelined requests from one read; they wait in the queue, in order, so no
   early byte is lost. Waiting for the first byte of a request is bounded by
   ``keepalive_timeout_s`` (``header_timeout_s`` on a fresh connection) and
   ends quietly; from the first byte, the head must arrive within
   ``header_timeout_s`` or the client gets 408.
2. Admit the head: ``admit``, when given, sees the request as soon as its
   head is complete and before any byte of its body is kept, and may answer
   it from the head alone (a request without a good key); a body that was
   coming is then never read, and the connection closes after the answer.
   Otherwise answer ``Expect: 100-continue``, then read the body within
   ``body_timeout_s``, at ``min_body_rate`` or better once its first
   ``body_rate_window_s`` are over (408). Limits are enforced inside the
   parser callbacks (431/413 as soon as a bound is crossed, Content-Length
   checked up front; 503 once the bodies held by all connections together
   would pass ``max_bodies_bytes`` and no client holds more than its share:
   ``_budget.py``; a body still arriving that the budget drops for a client
   holding less wakes its connection, which answers 503).
3. Run the handler, then write the response: head and a small body in one
   ``send``; a streamed body chunk by chunk as it is produced (chunked
   encoding, or close-delimited for an HTTP/1.0 client). A handler that
   raises gets a logged 500; once a stream's head is out, a failure can only
   cut the connection. Pipelined requests already buffered are served with a
   checkpoint in between, so one client cannot monopolise the scheduler.
4. Keep the connection or close it. Any error the server answers itself
   (400, 408, 413, 431, 501, ...) closes the connection; a server-side close
   half-closes first and drains input for a moment, so the kernel does not
   answer unread input with a reset that would destroy the response
   (``_writing.py``).

Sockets are non-blocking stdlib sockets driven with
``trio.lowlevel.wait_readable`` / ``wait_writable``: an operation that can
complete at once is one system call with no trip through the scheduler, and
a task blocks only when the kernel says it must. Every blocking wait has a
deadline from ``ServerLimits``: the wait for a kept-alive connection's next
request, the common one, through ``SocketDeadlines`` (``_deadlines.py``:
one timer task, and the connection is closed when it expires, within a
quarter of the shorter of the header and keep-alive timeouts, at most 1 s,
after its deadline); the others in a cancel scope.

Disconnect watching (``_watch.py``). While a handler runs (including while
its streamed body is written), a second task per connection, the watcher,
reads the socket. EOF or a reset cancels the handler's cancel scope at once, which is
how an abandoned request cancels its upstream work. Bytes that arrive
instead (pipelined requests) are kept for the main task, in order. The
watcher is spawned once per connection and parked between requests: waking
it is a ``reschedule`` and ending its watch is a ``cancel``, which trio turns
into a synchronous withdrawal of its readiness wait, so the main task can
read the socket right away. The watcher checks, before every read, that the
request it watches is still running; it never takes bytes meant for the main
task's next read.

Drain. ``drain()`` stops the accept tasks and closes the listeners, wakes
every connection that is idle between requests so it closes, and makes
every other connection answer its current request with
``Connection: close``. ``serve()`` returns when the last connection has
finished. Cancelling ``serve()`` instead cancels everything at once:
handlers are cancelled and every socket closed before it returns.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Any

import trio

from . import _wire
from ._connection import Connection
from ._deadlines import SocketDeadlines
from ._shared import Shared, evict
from ._throttle import Throttled
from .types import Admit, ErrorBody, Handler, ServerLimits, default_error_body

logger = logging.getLogger("llmgw.http")

# accept() errors that concern only the connection being accepted.
_ACCEPT_SKIP = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNABORTED",
        "EPROTO",
        "ENETDOWN",
        "ENOPROTOOPT",
        "EHOSTDOWN",
        "ENONET",
        "EHOSTUNREACH",
        "EOPNOTSUPP",
        "ENETUNREACH",
        "EAGAIN",
        "EWOULDBLOCK",
    )
    if hasattr(errno, name)
)
# accept() errors that mean the process is out of resources for now.
_ACCEPT_BACKOFF = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_ACCEPT_BACKOFF_S = 0.1


def _notify_closing(conn: Connection) -> None:
    trio.lowlevel.notify_closing(conn.sock)  # the connection's task closes it


class HttpServer:
    """HTTP/1.1 server for one handler; see the module docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        limits: ServerLimits = ServerLimits(),  # noqa: B008 (frozen, so sharing is safe)
        error_body: ErrorBody | None = None,
        name: str = "http",
        admit: Admit | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.name = name
        error_body = error_body or default_error_body
        # Waits for a kept-alive connection's next request: one timer, not a
        # cancel scope each (_deadlines.py). Expiring one closes the connection.
        shortest = min(limits.header_timeout_s, limits.keepalive_timeout_s)
        self._shared = Shared(
            handler,
            limits,
            name,
            error_body,
            SocketDeadlines(min(1.0, shortest / 4), _notify_closing),
            admit,
        )
        self._open = 0
        self._per_address: dict[str, int] = {}  # open connections by client IP address
        self._connections: set[Connection] = set()
        self._accept_scopes: set[trio.CancelScope] = set()
        self._busy = _wire.error_response(
            self._shared.error_body, 503, "server is at its connection limit", keep_alive=False
        )
        self._busy_address = _wire.error_response(
            self._shared.error_body,
            503,
            "too many connections from your address; close some and retry",
            keep_alive=False,
        )
        self._warn_busy = Throttled(
            "%s: connection limit %d reached, and every connection has proved who sent it"
            " or is busy; refusing connections"
        )
        self._warn_evicted = Throttled(
            "%s: connection limit %d reached; closing idle connections that proved nobody"
            " (the latest from %s) to let new ones in"
        )
        self._warn_address = Throttled(
            "%s: %s holds %d connections, the limit per address; refusing more from it"
        )
        self._warn_accept = Throttled("%s: accept failed: %s; backing off")

    # ------------------------------------------------------------------ metrics
    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed."""
        return self._open

    def connections_from(self, host: str) -> int:
        """Open connections from the client IP address ``host``."""
        return self._per_address.get(host, 0)

    @property
    def body_bytes(self) -> int:
        """Request body bytes held now, all connections together."""
        return self._shared.budget.used

    def cuts(self) -> dict[str, int]:
        """How many times, by reason, the server refused or cut a connection or a request
        to keep one client from taking what others need."""
        shared = self._shared
        return {
            "connection_limit": self._warn_busy.count,
            "address_limit": self._warn_address.count,
            "idle_closed": self._warn_evicted.count,
            "reserved": shared.warn_reserve.count,
            "bodies_full": shared.warn_full.count,
            "body_dropped": shared.warn_dropped.count,
            "body_too_slow": shared.warn_slow_body.count,
            "reader_too_slow": shared.warn_slow_reader.count,
        }

    @property
    def in_flight(self) -> int:
        """Requests whose handler is running or whose response is being written."""
        return self._shared.in_flight

    @property
    def draining(self) -> bool:
        return self._shared.draining

    # ------------------------------------------------------------------ serving
    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on `listeners` until cancelled or drained.

        Calls ``task_status.started()`` once accepting. The listeners are
        closed when accepting stops."""
        await self._serve(listeners, task_status, None)

    async def serve_tcp(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on `host`:`port` (0 picks a port) and serve.

        ``task_status.started(listeners)`` lets the caller learn the bound port."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        await self._serve(listeners, task_status, listeners)

    async def _serve(
        self, listeners: list[trio.SocketListener], task_status: Any, started: object
    ) -> None:
        async with trio.open_nursery() as connections:
            accept_scope = trio.CancelScope()
            self._accept_scopes.add(accept_scope)
            if self._shared.draining:
                accept_scope.cancel()
            try:
                with accept_scope:
                    async with trio.open_nursery() as accepting:
                        for listener in listeners:
                            accepting.start_soon(self._accept_loop, listener, connections)
                        task_status.started(started)
            finally:
                self._accept_scopes.discard(accept_scope)
                for listener in listeners:
                    listener.socket.close()

    def drain(self) -> None:
        """Stop accepting, close idle connections, finish in-flight requests.

        ``serve()`` returns once every connection has finished; bound that
        with a deadline of your own."""
        self._shared.draining = True
        for scope in self._accept_scopes:
            scope.cancel()
        self._shared.deadlines.expire_all()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        listening = listener.socket
        limit = self.limits.max_connections
        per_address_limit = self.limits.max_connections_per_address
        per_address = self._per_address
        while True:
            try:
                accepted, address = await listening.accept()
            except OSError as exc:
                if exc.errno in _ACCEPT_SKIP:
                    continue
                if exc.errno in _ACCEPT_BACKOFF:
                    self._warn_accept.warn(self.name, exc)
                    await trio.sleep(_ACCEPT_BACKOFF_S)
                    continue
                raise
            sock = socket.socket(fileno=accepted.detach())
            sock.setblocking(False)
            if self._open >= limit:
                victim = self._shared.victim()
                if victim is None:
                    self._warn_busy.warn(self.name, limit)
                    _refuse(sock, self._busy)
                    continue
                self._warn_evicted.warn(self.name, limit, victim.client[0])
                evict(victim)
            if isinstance(address, tuple):
                client = (str(address[0]), int(address[1]))
            else:
                client = (str(address), 0)
            host = ""  # no cap per address for a Unix socket's clients
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                host = client[0]
                held = per_address.get(host, 0)
                if held >= per_address_limit:
                    self._warn_address.warn(self.name, host, held)
                    _refuse(sock, self._busy_address)
                    continue
                per_address[host] = held + 1
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            self._open += 1
            nursery.start_soon(self._run_connection, sock, client, host)

    async def serve_socket(self, sock: socket.socket, client: tuple[str, int]) -> None:
        """Serve one connection accepted elsewhere (``tls_front``: one end of a socket
        pair), ``client`` the address it came from; returns when it is closed."""
        sock.setblocking(False)
        self._open += 1
        await self._run_connection(sock, client, "")

    async def _run_connection(
        self, sock: socket.socket, client: tuple[str, int], host: str
    ) -> None:
        conn = Connection(self._shared, sock, client)
        self._connections.add(conn)
        self._shared.untrusted[conn] = None
        try:
            async with trio.open_nursery() as nursery:
                conn.nursery = nursery
                await conn.run()
                nursery.cancel_scope.cancel()
        except Exception:
            logger.exception("%s: connection from %s:%d failed", self.name, *client)
        finally:
            self._connections.discard(conn)
            self._shared.untrusted.pop(conn, None)
            conn.dispose()
            self._open -= 1
            if host:
                held = self._per_address[host] - 1
                if held:
                    self._per_address[host] = held
                else:
                    del self._per_address[host]
            trio.lowlevel.notify_closing(sock)
            sock.close()


def _refuse(sock: socket.socket, answer: bytes) -> None:
    """Over a connection limit: a best-effort 503, then close."""
    try:
        sock.send(answer)
    except OSError:
        pass
    sock.close()

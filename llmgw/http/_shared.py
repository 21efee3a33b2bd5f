"""What a server shares with its connections, and what keeps one client from taking it all.

``Shared`` is everything a connection reads of its server (the handler, the
limits, ``admit``, the error format, whether it drains) and the few things
connections change together: ``in_flight``, the request body bytes charged
to ``budget`` (``_budget.py``) and the waits of ``deadlines``
(``_deadlines.py``). The functions below are the rules by which connections
share the server's limits; each runs at most once per request head or per
connection, never per chunk.

Who proved someone. A connection starts in ``untrusted`` (insertion order,
so oldest first) and leaves it for good once one of its requests carries
credentials ``admit`` accepted (``Request.principal``). Only untrusted
connections are ever closed to make room or kept out of the reserved ones.

The connection limit. At ``max_connections`` the accept loop asks
``victim`` for the oldest untrusted connection that waits for a request
head; ``evict`` closes it quietly (``notify_closing`` wakes its read, which
ends as at EOF) and the new connection takes its place. The scan looks at
the first ``_VICTIM_SCAN`` only, so a flood of busy untrusted connections
costs a bounded look per accept.

Reserved connections. ``gate`` runs after ``admit`` on each request head
(``RequestParser`` calls it), until the connection is trusted: a request
that proves nobody, while untrusted connections hold more than all but
``reserved_connections``, takes an idle untrusted connection's place, or
with none idle is answered 503 from a body built once (``reserve_answer``),
closing its connection. So a health check is served during a flood of idle
connections, and clients with credentials always find a connection.

Dropped bodies. When the budget takes a body still arriving from a client
over its share for one within it, ``interrupt`` wakes the dropped body's
read (its read scope is cancelled), and the connection answers 503 from
``RequestParser.failure``.

Every such cut is logged at most so often (``Throttled``), and its count
is what ``HttpServer.cuts`` reports.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ._budget import BodyBudget
from ._deadlines import SocketDeadlines
from ._throttle import Throttled
from .types import Admit, ErrorBody, Handler, Request, Response, ServerLimits, default_error_body

if TYPE_CHECKING:
    from ._connection import Connection

logger = logging.getLogger("llmgw.http")

_VICTIM_SCAN = 64  # connections looked at, oldest first, for one to close at the limit


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


def gate(conn: Connection, request: Request) -> Response | None:
    """After ``admit``: a request that proved someone trusts its connection. One that
    proved nobody, while such connections fill all but the reserved ones, takes the
    place of an idle one of them (a health check during a flood of idle connections
    is served), or, with none idle, is a 503."""
    if conn.trusted:
        return None
    server = conn.server
    if request.principal:
        conn.trusted = True
        server.untrusted.pop(conn, None)
        return None
    if len(server.untrusted) > server.reserve_from:
        victim = server.victim(conn)
        if victim is not None:
            evict(victim)
            return None
        server.warn_reserve.warn(server.name, server.reserve_from, conn.client[0])
        content_type, body = server.reserve_answer
        return Response(503, [("content-type", content_type), ("connection", "close")], body)
    return None


def evict(conn: Connection) -> None:
    """Close this idle connection to make room for a new one (it ends quietly)."""
    conn.evicted = True
    conn.server.untrusted.pop(conn, None)
    trio.lowlevel.notify_closing(conn.sock)


def interrupt(conn: Connection) -> None:
    """The budget dropped the body being read: wake the read to answer it."""
    dropped = conn.requests.dropped
    request = dropped.request if dropped is not None else None
    server = conn.server
    server.warn_dropped.warn(
        server.name,
        conn.client[0],
        f"key {request.principal}" if request is not None and request.principal else "no key",
        server.budget.limit >> 20,
    )
    if conn.read_scope is not None:
        conn.read_scope.cancel()

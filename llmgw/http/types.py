"""The data that crosses the boundary between the HTTP server and its handler."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Sequence
from typing import TypeVar, cast, overload

import attrs


@attrs.frozen
class Headers:
    """Request headers in arrival order, names already lower-cased.

    A list scan beats a dict for the handful of headers a request carries, and
    it keeps repeated headers and their order without extra work per request.
    """

    raw: Sequence[tuple[str, str]]

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of `name` (any case), or `default`."""
        name = name.lower()
        for key, value in self.raw:
            if key == name:
                return value
        return default

    def get_all(self, name: str) -> list[str]:
        """Every value of `name` (any case), in arrival order."""
        name = name.lower()
        return [value for key, value in self.raw if key == name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        name = name.lower()
        return any(key == name for key, _ in self.raw)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


@attrs.define
class Request:
    """One complete request: head and whole body, read before the handler runs.

    The server makes it when the head is complete (``body`` still empty, which
    is how the server's ``admit`` sees it), and sets ``body`` once it is read."""

    method: str
    path: str
    query: str
    headers: Headers
    body: bytes
    client: tuple[str, int]
    http_version: str
    admitted: object = None
    """What the server's ``admit`` returned for this request's head (None without one)."""
    principal: str = ""
    """Who the head proved it came from (an API key's name, a token's holder), set by
    ``admit``; "" when it proved nobody. The server shares its body budget per
    principal as well as per address, and keeps its last connections for requests
    that prove someone (``ServerLimits.reserved_connections``)."""


@attrs.define
class Response:
    """What a handler returns.

    A bytes body goes out with Content-Length. An async iterable body is
    written chunk by chunk as it is produced (Transfer-Encoding: chunked),
    unless the handler set Content-Length itself. The server owns framing:
    handlers must not set Transfer-Encoding; `Connection: close` is honoured.
    """

    status: int
    headers: list[tuple[str, str]] = attrs.Factory(list)
    body: bytes | AsyncIterable[bytes] = b""


Handler = Callable[[Request], Awaitable[Response]]

Admit = Callable[[Request], object]
"""Called as soon as a request's head is complete, before any byte of its body is
kept (``request.body`` is still empty). A ``Response`` is the request's answer,
given from its head alone: the handler does not run, and a body the client is
sending is never read or kept (the connection closes after the answer). Anything
else is kept as ``request.admitted`` for the handler. A head that proves who sent
it should set ``request.principal``. It runs inside the parser: it must not block,
and what it raises is a 500. A request that proves nobody may still be answered
503 after ``admit`` when the server is down to its reserved connections."""

T = TypeVar("T")


def admission(request: Request, admit: Callable[[Request], T]) -> T:
    """What ``admit`` made of ``request``'s head, for its handler: what the server kept
    (a server given ``admit`` calls it before it reads the body, and answers a
    ``Response`` itself), or, from a server that was not given it, its verdict now."""
    if request.admitted is None:
        return admit(request)
    return cast(T, request.admitted)


ErrorBody = Callable[[int, str], tuple[str, bytes]]
"""(status, message) -> (content type, body) for responses the server makes itself."""


def default_error_body(status: int, message: str) -> tuple[str, bytes]:
    """`{"error": {"message": ..., "code": status}}` as JSON."""
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    return "application/json", body


@attrs.frozen
class ServerLimits:
    """Bounds on everything a client can make the server wait for or hold."""

    max_header_bytes: int = 16 * 1024
    """Request line plus headers (and, separately, chunked trailers); over -> 431."""
    max_body_bytes: int = 1024 * 1024
    """Declared Content-Length or counted chunked body; over -> 413."""
    header_timeout_s: float = 10.0
    """From the first byte of a request to its complete head -> 408. Also how long a
    fresh connection may stay silent before it is closed quietly."""
    body_timeout_s: float = 30.0
    """From the complete head (or the 100 Continue) to the complete body -> 408."""
    keepalive_timeout_s: float = 75.0
    """Idle time between requests on a kept-alive connection -> closed quietly."""
    min_body_rate: float = 0.0
    """Bytes per second a request body must keep arriving at: each ``body_rate_window_s``
    after the first must bring ``min_body_rate * body_rate_window_s`` bytes, or the
    client gets 408 (a body stalled halfway holds its memory for no one). 0: no floor."""
    body_rate_window_s: float = 5.0
    """The grace before ``min_body_rate`` applies, and the window it is measured over."""
    write_timeout_s: float = 30.0
    """Longest wait for the client to take more response bytes -> connection closed (a
    stream's upstream request is cancelled with it)."""
    max_connections: int = 10_000
    """Open connections beyond this: the oldest connection that has proved nobody
    (``Request.principal``) and waits for a request head is closed to make room; with
    none, the new one is answered 503 at once and closed."""
    reserved_connections: int = 0
    """Of ``max_connections``, how many only connections whose requests prove someone may
    use: past ``max_connections - reserved_connections`` connections that proved nobody,
    a request that proves nobody takes the place of an idle one of them, or, with none
    idle, is answered 503 and its connection closed."""
    max_connections_per_address: int = 1_000
    """Open connections from one client IP address beyond this are answered 503 at
    once and closed, so that one address cannot hold every connection there is."""
    max_bodies_bytes: int = 256 * 1024 * 1024
    """Request body bytes held at once, all connections together (from the first byte
    read until the response is written), shared fairly per principal and per address
    (``_budget.py``); a body that finds no room -> 503."""

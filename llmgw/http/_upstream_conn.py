"""One upstream connection's bytes: the request head framed, the response parsed.

The pool (``client.py``) owns the sockets, the waits and the keep-alive
decisions; this module is what one connection reads and writes.

Framing a request. ``request_head`` writes the request line and the
caller's headers as given, adds Host when absent and Content-Length for the
body (always for POST, PUT and PATCH, even when empty), and drops any
Content-Length or Transfer-Encoding of the caller's, since the pool frames
the body. It notes whether the caller asked for ``Connection: close``, which
keeps the connection out of the pool. Only header names of the lengths of
those four are lowered and compared, so the common request costs one join.
CR, LF or a space where it could smuggle in a line or a request is refused
with ``ValueError`` before anything is sent.

Parsing a response. An ``UpstreamConn`` keeps one
``httptools.HttpResponseParser`` for the life of its connection, and is the
parser's callback object: the state of the response being read lives in its
slots and is reset by ``start`` before each exchange. Header names are
decoded and lowered once and shared between responses (``_header_name``).
The callbacks:

- skip 1xx interim responses (llhttp ends one at its head; the real one
  follows), and refuse ``101 Switching Protocols``;
- mark the response ``framed`` (Content-Length or chunked), so that EOF before
  its end is a cut, not the end of a close-delimited body;
- take llhttp's ``should_keep_alive`` as the response's own say on reuse;
- end a HEAD response at its head whatever its headers say, which llhttp
  cannot be told, so the parser is replaced before the next exchange;
- hand body bytes over as the parser yields them, de-chunked, into
  ``chunks``, which ``ResponseBody`` empties;
- treat anything after a complete response (a second response, garbage, an
  upgrade) as making the connection ``broken``: never reused, and nothing of
  it reaches the response that was asked for.

``feed`` turns a parser error into ``UpstreamProtocolError`` with the phase
the pool was in, and bounds the response head at ``max_header_bytes``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import httptools

from llmgw.addr import join_hostport

from .upstream_errors import Phase, UpstreamProtocolError

_BODY_METHODS = frozenset(("POST", "PUT", "PATCH"))  # send content-length: 0 for an empty body
# Lengths of the request header names the pool looks at: host, connection,
# content-length, transfer-encoding. Only names of these lengths are lowered.
_SPECIAL_LENGTHS = frozenset((4, 10, 14, 17))
# Response header names decoded and lowered once, then shared.
_NAMES: dict[bytes, str] = {}
_NAMES_MAX = 512


class _Fail(Exception):
    """Raised inside a parser callback to stop parsing with a protocol error."""


def _header_name(raw: bytes) -> str:
    name = _NAMES.get(raw)
    if name is None:
        name = raw.decode("latin-1").lower()
        if len(_NAMES) < _NAMES_MAX:
            _NAMES[raw] = name
    return name


class UpstreamConn:
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


def request_head(
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

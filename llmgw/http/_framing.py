"""Response framing: a handler's `Response` -> the bytes of its head, and how its body goes."""

from __future__ import annotations

from collections.abc import AsyncIterable

from . import _wire
from .types import Response

# Response headers the server owns (framing and connection management).
_FRAMING = frozenset(("content-length", "transfer-encoding", "connection"))


class BadResponse(Exception):
    """The handler's response cannot be framed as given."""


class Framed:
    """A framed response, ready to write.

    ``mode`` says how ``streamed`` goes out: "chunked", "length" (exactly
    ``length`` bytes, the handler's Content-Length) or "eof" (the close ends
    it, for HTTP/1.0). Without ``streamed``, ``payload`` is the whole body."""

    __slots__ = ("head", "keep_alive", "length", "mode", "payload", "streamed")

    def __init__(
        self,
        head: bytes,
        payload: bytes,
        keep_alive: bool,
        streamed: AsyncIterable[bytes] | None = None,
        mode: str = "",
        length: int = 0,
    ) -> None:
        self.head = head
        self.payload = payload
        self.keep_alive = keep_alive
        self.streamed = streamed
        self.mode = mode
        self.length = length


def _is_length(value: str) -> bool:
    return value.isascii() and value.isdigit()


def frame_response(response: Response, method: str, version: str, keep_alive: bool) -> Framed:
    """Frame `response` to a `method` request over HTTP/`version`.

    `keep_alive`: whether the connection may stay open as far as the request
    and the server are concerned; the response can only turn it off. Raises
    `BadResponse`; the caller then still owns (and closes) a streamed body."""
    status = response.status
    body = response.body
    if not 200 <= status <= 999:
        raise BadResponse(f"status {status}")
    bodiless = method == "HEAD" or status == 204 or status == 304
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
                raise BadResponse("handlers must not set transfer-encoding")
            if not _is_length(value):
                raise BadResponse(f"content-length {value!r}")
            declared = value
        lines.append(f"{name}: {value}\r\n")

    streamed: AsyncIterable[bytes] | None = None
    payload = b""
    mode = ""
    length = 0
    if isinstance(body, bytes | bytearray | memoryview):
        payload = body if isinstance(body, bytes) else bytes(body)
        if declared is None:
            if status != 204 and status != 304:
                lines.append(f"content-length: {len(payload)}\r\n")
        elif not bodiless and int(declared) != len(payload):
            raise BadResponse(f"content-length {declared} for {len(payload)} bytes")
        if bodiless:
            payload = b""
    elif not hasattr(body, "__aiter__"):
        raise BadResponse(f"body of type {type(body).__name__}")
    elif not bodiless:
        streamed = body
        if declared is not None:
            mode = "length"
            length = int(declared)
        elif version == "1.1":
            mode = "chunked"
            lines.append("transfer-encoding: chunked\r\n")
        else:
            mode = "eof"
            keep_alive = False
    if keep_alive:
        if version == "1.0":
            lines.append("connection: keep-alive\r\n")
    else:
        lines.append("connection: close\r\n")
    lines.append(_wire.date_line())
    lines.append("\r\n")
    text = "".join(lines)
    # Every element of `lines` holds exactly one CRLF; more means a header
    # name or value tried to smuggle in a line of its own.
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise BadResponse("CR or LF in a response header")
    try:
        head = text.encode("latin-1")
    except UnicodeEncodeError:
        raise BadResponse("response header is not latin-1") from None
    return Framed(head, payload, keep_alive, streamed, mode, length)

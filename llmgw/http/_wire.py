"""Response heads, the few byte strings the server writes on its own, and how much it reads."""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

from .types import ErrorBody

_STATUS_LINES: dict[int, str] = {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n" for s in HTTPStatus}

RECV_SIZE = 65536  # bytes asked of the kernel per read of a client connection

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CRLF = b"\r\n"


def status_line(status: int) -> str:
    """`HTTP/1.1 <status> <reason>\\r\\n`, cached for the statuses Python knows."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} \r\n"
    return line


_date_second = -1
_date_line = ""


def date_line() -> str:
    """The `date:` header line, formatted at most once a second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_line = f"date: {formatdate(now, usegmt=True)}\r\n"
        _date_second = now
    return _date_line


def error_response(
    error_body: ErrorBody, status: int, message: str, *, keep_alive: bool, head_only: bool = False
) -> bytes:
    """A complete response for an error the server reports itself."""
    content_type, body = error_body(status, message)
    head = "".join(
        (
            status_line(status),
            f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n",
            "connection: keep-alive\r\n" if keep_alive else "connection: close\r\n",
            date_line(),
            "\r\n",
        )
    ).encode("latin-1")
    return head if head_only else head + body

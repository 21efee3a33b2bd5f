"""Writing to the client: one system call when the socket has room, a bound when not.

Every write goes through ``send_all``: a ``send`` on the non-blocking socket,
which in the common case takes all of it, so a response costs one system call
and no trip through trio's scheduler. What the kernel does not take is
written as the socket becomes writable, each wait bounded by
``write_timeout_s``: a client that stops reading (a slow reader holding a
streamed response, and with it the handler's upstream work) is cut, counted
and logged (``reader_too_slow``), and its request cancelled. A reset, a
close or that cut raise ``PeerGone``, after which nothing more is written.

A response arrives framed (``_framing.py``). ``write`` sends its head and a
small body (up to ``_LARGE_BODY``) together, copied once into one buffer; a
larger body goes separately rather than copied. A streamed body is written
chunk by chunk as the handler yields it (``_stream``), chunked or
length-checked as its framing says. Once the head is out, a stream that fails
can only cut the connection, so the client sees a truncated body rather than
a complete wrong one; a body that is not finished, whatever the reason, is
closed (``close_body``), since it may hold an upstream connection of its own.

Errors the server answers itself (``send_error``: 400, 408, 413, 431, 503,
...) close the connection. A server-side close half-closes first and drains
what the client still sends for a moment (``linger``): closing with unread
input makes the kernel answer with a reset, which can destroy the response
before the client reads it.

These functions take the connection; ``send_all`` is the only one on the
per-chunk path, and a chunk costs it one call.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING

import trio

from . import _wire
from ._framing import BadResponse, Framed
from ._parsing import FULL, Message
from ._wire import RECV_SIZE
from .logsafe import printable

if TYPE_CHECKING:
    from ._connection import Connection

logger = logging.getLogger("llmgw.http")

_LARGE_BODY = 65536  # above this, head and body are sent separately rather than copied together
_LINGER_S = 2.0  # after a server-side close, how long to drain what the client still sends
_LINGER_BYTES = 1024 * 1024


class PeerGone(Exception):
    """The client reset or closed the connection under a write, or a write timed out."""


async def send_all(conn: Connection, data: bytes) -> None:
    """Write all of `data`; one system call when the socket buffer has room."""
    try:
        sent = conn.sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        raise PeerGone from exc
    if sent < len(data):
        await _send_rest(conn, memoryview(data)[sent:])


async def _send_rest(conn: Connection, view: memoryview) -> None:
    sock = conn.sock
    while view:
        with trio.move_on_after(conn.limits.write_timeout_s) as scope:
            await trio.lowlevel.wait_writable(sock)
        if scope.cancelled_caught:
            server = conn.server
            server.warn_slow_reader.warn(server.name, conn.client[0], conn.limits.write_timeout_s)
            raise PeerGone("write timed out")
        try:
            sent = sock.send(view)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise PeerGone from exc
        view = view[sent:]


async def linger(conn: Connection) -> None:
    """Half-close, then drain what the client still sends before the close.

    Closing with unread input makes the kernel send a reset, which can
    destroy the response we just wrote before the client reads it."""
    sock = conn.sock
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return
    total = 0
    with trio.move_on_after(_LINGER_S):
        while total < _LINGER_BYTES:
            try:
                data = sock.recv(RECV_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError:
                return
            if not data:
                return
            total += len(data)


async def send_error(conn: Connection, status: int, message: str) -> None:
    """Answer a protocol error or timeout, then close (lingering)."""
    if status == 0:
        return
    if message is FULL:
        server = conn.server
        who = conn.requests.refused
        server.warn_full.warn(
            server.name,
            server.budget.limit >> 20,
            conn.client[0],
            f"key {who}" if who else "no key",
        )
    logger.debug("%s: %d to %s:%d: %s", conn.server.name, status, *conn.client, printable(message))
    try:
        await send_all(
            conn, _wire.error_response(conn.server.error_body, status, message, keep_alive=False)
        )
    except PeerGone:
        return
    await linger(conn)


async def write(conn: Connection, framed: Framed, msg: Message) -> None:
    """Write a framed response; a streamed body chunk by chunk as it is produced."""
    head = framed.head
    streamed = framed.streamed
    if streamed is None:
        payload = framed.payload
        if len(payload) <= _LARGE_BODY:
            await send_all(conn, head + payload if payload else head)
        else:
            await send_all(conn, head)
            await send_all(conn, payload)
        return
    try:
        await send_all(conn, head)
    except BaseException:
        await close_body(streamed)  # never read: it may hold a connection of its own
        raise
    await _stream(conn, streamed, framed.mode, framed.length, msg)


async def _stream(
    conn: Connection, body: AsyncIterable[bytes], mode: str, length: int, msg: Message
) -> None:
    """Write each chunk as soon as the handler yields it."""
    sent = 0
    finished = False
    try:
        async for chunk in body:
            if not chunk:
                continue
            if mode == "chunked":
                await send_all(conn, b"".join((b"%x\r\n" % len(chunk), chunk, _wire.CRLF)))
            else:
                sent += len(chunk)
                if mode == "length" and sent > length:
                    raise BadResponse(f"streamed body exceeds content-length {length}")
                await send_all(conn, bytes(chunk))
        finished = True
        if mode == "chunked":
            await send_all(conn, _wire.LAST_CHUNK)
        elif mode == "length" and sent != length:
            raise BadResponse(f"streamed body of {sent} bytes, content-length {length}")
    except (PeerGone, trio.Cancelled):
        raise
    except Exception as exc:
        # The head is out: nothing to do but cut the connection, so the client
        # sees a truncated body rather than a complete wrong one.
        logger.error(
            "%s: response stream for %s %s failed",
            conn.server.name,
            msg.method,
            printable(msg.path),
            exc_info=exc,
        )
        raise PeerGone("response stream failed") from exc
    finally:
        if not finished:
            await close_body(body)


async def close_body(body: object) -> None:
    """Close an async generator body the server will not finish iterating."""
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            logger.exception("closing a response body failed")

"""Closing streams on the way out: bounded, shielded, and quiet about broken peers.

Shared by both ends of the agent stream. A close runs under a shield (so a
cancellation, such as shutdown, still sends the close frame) and under a
short deadline (so a peer that never answers cannot hold a shutdown up).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

CLOSE_TIMEOUT = 0.25


async def close_ws(ws: WebSocketConnection, code: int, reason: str) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
        try:
            await ws.aclose(code, reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionClosed):
            pass


async def close_quietly(stream: trio.abc.AsyncResource) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
        try:
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            pass


@contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a nursery's lone exception as itself.

    A session's nursery wraps whatever ends it in an ExceptionGroup; the
    callers that log *why* a stream ended want the one exception back (a
    close code and reason, a TLS error). Groups of several stay groups.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from group
        raise


def split_cancelled(exc: BaseException) -> tuple[BaseException | None, BaseException | None]:
    """(what failed, the cancellation) in an exception that may be a group of both.

    A session cancelled (shutdown, the test ending) just as its peer closed the
    stream ends with a group holding both. The failure is for logging; the
    cancellation must be re-raised so the cancel scope that asked for it ends.
    """
    if isinstance(exc, trio.Cancelled):
        return None, exc
    if not isinstance(exc, BaseExceptionGroup):
        return exc, None
    cancelled, rest = exc.split(trio.Cancelled)
    return rest, cancelled

"""Closing streams on the way out: bounded, shielded, and quiet about broken peers.

Shared by both ends of the agent stream. A close runs under a shield (so a
cancellation, such as shutdown, still sends the close frame) and under a
short deadline (so a peer that never answers cannot hold a shutdown up).
"""

from __future__ import annotations

import ssl

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

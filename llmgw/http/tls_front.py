"""TLS in front of an ``HttpServer``, for a listener of few clients (the web console).

The server drives plain stdlib sockets for speed; here each TLS connection is
accepted and its handshake made by trio (bounded by a timeout), then handed to the
server as one end of a socket pair, while two tasks carry the bytes between the TLS
stream and the pair's other end. The server's limits, timeouts and framing apply
unchanged; what the copy costs does not matter at a console's rate.
"""

from __future__ import annotations

import logging
import socket
import ssl

import trio

from llmgw.http.server import HttpServer

log = logging.getLogger("llmgw.http")

CHUNK = 64 * 1024


async def serve_tls(
    server: HttpServer,
    context: ssl.SSLContext,
    host: str,
    port: int,
    *,
    handshake_timeout_s: float = 10.0,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host``:``port`` and serve ``server`` over TLS until cancelled."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    limit = trio.CapacityLimiter(server.limits.max_connections)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, server, context, listener, handshake_timeout_s, limit)
        task_status.started(listeners)


async def _accept(
    server: HttpServer,
    context: ssl.SSLContext,
    listener: trio.SocketListener,
    handshake_timeout_s: float,
    limit: trio.CapacityLimiter,
) -> None:
    async with trio.open_nursery() as nursery:
        while True:
            tcp = await listener.accept()
            if limit.available_tokens < 1:
                await tcp.aclose()  # at its limit: the client tries again
                continue
            nursery.start_soon(_connection, server, context, tcp, handshake_timeout_s, limit)


async def _connection(
    server: HttpServer,
    context: ssl.SSLContext,
    tcp: trio.SocketStream,
    handshake_timeout_s: float,
    limit: trio.CapacityLimiter,
) -> None:
    async with limit:
        peer = tcp.socket.getpeername()
        client = (str(peer[0]), int(peer[1]))
        stream = trio.SSLStream(tcp, context, server_side=True)
        try:
            with trio.fail_after(handshake_timeout_s):
                await stream.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError) as exc:
            log.debug("%s: TLS handshake with %s:%d failed: %s", server.name, *client, exc)
            await trio.aclose_forcefully(tcp)
            return
        inner, outer = socket.socketpair()
        inner.setblocking(False)
        pair = trio.SocketStream(trio.socket.from_stdlib_socket(outer))
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                await server.serve_socket(inner, client)
                nursery.cancel_scope.cancel()

            async def up() -> None:  # the client's bytes to the server
                try:
                    while data := await stream.receive_some(CHUNK):
                        await pair.send_all(data)
                    await pair.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
                    nursery.cancel_scope.cancel()

            async def down() -> None:  # the server's answers to the client
                try:
                    while data := await pair.receive_some(CHUNK):
                        await stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(serve)
            nursery.start_soon(up)
            nursery.start_soon(down)
        await trio.aclose_forcefully(pair)
        await trio.aclose_forcefully(stream)

"""A TCP proxy we own, so a test can sever every connection for real.

Helpers that "close client connections" may skip upgraded ones (the seed's
TestAgentReconnects passed for no reason that way); this proxy closes the
sockets themselves and counts every connection it opened. It also keeps what
clients sent through it (``sent``), for a test that reads what went over the wire.
"""

from __future__ import annotations

import trio


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.opened = 0
        self.port = 0
        self.sent = bytearray()  # every byte clients sent, all connections together
        self._scopes: set[trio.CancelScope] = set()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.port)

    def sever(self) -> int:
        """Close every proxied connection now; returns how many were open."""
        n = len(self._scopes)
        for scope in list(self._scopes):
            scope.cancel()
        return n

    @property
    def open(self) -> int:
        return len(self._scopes)

    async def _handle(self, client: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                with trio.fail_after(5):
                    upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                self.opened += 1
                async with upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(_pump, client, upstream, nursery.cancel_scope, self.sent)
                    nursery.start_soon(_pump, upstream, client, nursery.cancel_scope)
            except (OSError, trio.TooSlowError):
                pass
            finally:
                self._scopes.discard(scope)
        await client.aclose()


async def _pump(
    src: trio.SocketStream,
    dst: trio.SocketStream,
    scope: trio.CancelScope,
    keep: bytearray | None = None,
) -> None:
    try:
        while data := await src.receive_some(65536):
            if keep is not None:
                keep += data
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()

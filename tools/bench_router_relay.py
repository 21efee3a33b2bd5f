"""The floors for ``tools/bench_router.py``: a raw TCP byte relay, no HTTP at all.

Each client connection gets its own upstream connection, and bytes are copied
both ways as they arrive: no parsing, no routing, no framing. Whatever a
proxy costs beyond this is the proxy's own work; what this costs is what the
machine and the event loop charge any process that sits in the middle
(waking up, one receive and one send per piece). Two event loops:

- ``uvloop``: asyncio protocols on uvloop, the cheapest Python event loop;
- ``trio``: trio with non-blocking sockets and ``wait_readable``, the way
  llmgw's own hot path is written, so the gap between this and llmgw is
  llmgw's work and the gap between this and uvloop is trio's.

    python -m tools.bench_router_relay PORT UPSTREAM_PORT [uvloop|trio]
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import cast


class Pipe(asyncio.Protocol):
    """One side of a relayed connection; what it receives goes to its peer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Pipe | None = None
        self.pending: list[bytes] = []  # received before the peer connected
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class Downstream(Pipe):
    """The client's side: opens the upstream connection when the client connects."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(self._connect(loop))

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, up = await loop.create_connection(Pipe, "127.0.0.1", UPSTREAM_PORT)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        up.peer, self.peer = self, up
        assert up.transport is not None
        for data in self.pending:
            up.transport.write(data)
        self.pending.clear()


UPSTREAM_PORT = int(sys.argv[2]) if len(sys.argv) > 2 else 8000


async def uvloop_main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Downstream, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def trio_main(port: int) -> None:
    import trio

    async def copy(src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(src)
                continue
            except OSError:
                return
            if not data:
                return
            view = memoryview(data)
            while view:
                try:
                    view = view[dst.send(view) :]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dst)
                except OSError:
                    return

    async def relay(down: socket.socket) -> None:
        with down, socket.create_connection(("127.0.0.1", UPSTREAM_PORT)) as up:
            for s in (down, up):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with trio.open_nursery() as nursery:

                async def one_way(src: socket.socket, dst: socket.socket) -> None:
                    await copy(src, dst)
                    nursery.cancel_scope.cancel()  # either side closing ends both

                nursery.start_soon(one_way, down, up)
                nursery.start_soon(one_way, up, down)

    listener = socket.create_server(("127.0.0.1", port), backlog=512)
    listener.setblocking(False)
    async with trio.open_nursery() as nursery:
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                continue
            nursery.start_soon(relay, conn)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "trio":
        import trio

        trio.run(trio_main, int(sys.argv[1]))
    else:
        import uvloop

        uvloop.run(uvloop_main(int(sys.argv[1])))

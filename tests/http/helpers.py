"""Raw-socket HTTP clients and servers for the server's tests.

Responses are parsed with httptools' response parser, so a test reads what a
strict HTTP/1.1 client would see.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

import attrs
import httptools
import trio

from llmgw.http import HttpServer, Request, Response


@attrs.define
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class RawClient:
    """Send raw bytes, read parsed replies, observe the close."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = httptools.HttpResponseParser(self)
        self.replies: collections.deque[Reply] = collections.deque()
        self._cur: Reply | None = None

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._cur = Reply(0, [], b"")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._cur is not None
        self._cur.headers.append((name.decode().lower(), value.decode()))

    def on_headers_complete(self) -> None:
        assert self._cur is not None
        self._cur.status = self.parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        assert self._cur is not None
        self._cur.body += data

    def on_message_complete(self) -> None:
        assert self._cur is not None
        self.replies.append(self._cur)
        self._cur = None

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def reply(self) -> Reply:
        """The next complete reply; fails if the server closes first."""
        while not self.replies:
            data = await self.stream.receive_some()
            assert data, "server closed the connection before a complete reply"
            self.parser.feed_data(data)
        return self.replies.popleft()

    async def closed(self) -> bytes:
        """Read to EOF; returns whatever arrived that was not part of a reply."""
        rest = b""
        while True:
            data = await self.stream.receive_some()
            if not data:
                return rest
            rest += data

    async def aclose(self) -> None:
        await self.stream.aclose()


async def read_raw_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    """Raw bytes up to and including `marker` (or EOF)."""
    data = b""
    while marker not in data:
        chunk = await stream.receive_some()
        if not chunk:
            break
        data += chunk
    return data


async def eventually(predicate: Callable[[], bool], *, tries: int = 500) -> None:
    """Poll `predicate` (every 10 ms, bounded) for state that has no event to wait on."""
    for _ in range(tries):
        if predicate():
            return
        await trio.sleep(0.01)
    raise AssertionError("condition never became true")


async def echo(request: Request) -> Response:
    """Echo the request so tests can see what the server parsed."""
    text = f"{request.method} {request.path} {request.query} {request.http_version}"
    return Response(
        200,
        [("content-type", "text/plain"), ("x-request", text)],
        request.body or text.encode(),
    )


StartServer = Callable[..., Awaitable[tuple[HttpServer, int]]]


def server_starter(nursery: trio.Nursery) -> StartServer:
    async def start(
        handler: Callable[[Request], Awaitable[Response]] = echo, **kwargs: object
    ) -> tuple[HttpServer, int]:
        server = HttpServer(handler, **kwargs)  # type: ignore[arg-type]
        listeners = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
        return server, listeners[0].socket.getsockname()[1]

    return start

"""Server behaviour: requests as handlers see them, failures, streaming, disconnects, lifecycle."""

from __future__ import annotations

import errno
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from llmgw.http import Headers, HttpServer, Request, Response, ServerLimits

from .helpers import RawClient, StartServer, eventually, read_raw_until


def url(port: int, path: str = "/") -> str:
    return f"http://127.0.0.1:{port}{path}"


async def test_request_as_the_handler_sees_it(start_server: StartServer) -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(201, [("content-type", "text/plain"), ("X-Out", "1")], b"made")

    _, port = await start_server(handler)
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            r = await client.post(
                url(port, "/v1/a%20b/c?x=1&y=%20"),
                headers=[("X-Multi", "one"), ("x-multi", "two")],
                content=b"payload",
            )
    assert r.status_code == 201
    assert r.text == "made"
    assert r.headers["x-out"] == "1"
    assert r.headers["content-length"] == "4"
    (req,) = seen
    assert req.method == "POST"
    assert req.path == "/v1/a b/c"
    assert req.query == "x=1&y=%20"
    assert req.body == b"payload"
    assert req.http_version == "1.1"
    assert req.client[0] == "127.0.0.1"
    assert req.client[1] > 0
    assert req.headers.get("X-MULTI") == "one"
    assert req.headers.get_all("x-multi") == ["one", "two"]
    assert req.headers.get("absent") is None
    assert req.headers.get("absent", "d") == "d"
    assert "Content-Length" in req.headers
    assert ("host", f"127.0.0.1:{port}") in list(req.headers)


async def test_absolute_form_target(start_server: StartServer) -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(204)

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET http://t/p%2Fq?z=9 HTTP/1.1\r\nHost: t\r\n\r\n")
        reply = await c.reply()
    assert reply.status == 204
    assert reply.header("content-length") is None
    assert (seen[0].path, seen[0].query) == ("/p/q", "z=9")


def test_headers_lookup_is_case_insensitive() -> None:
    h = Headers([("a", "1"), ("b", "2"), ("a", "3")])
    assert h.get("A") == "1"
    assert h.get_all("A") == ["1", "3"]
    assert len(h) == 3
    assert 5 not in h


async def test_handler_exception_gives_500_and_is_logged(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("secret detail")
        return Response(200, body=b"fine")

    _, port = await start_server(handler)
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            r = await client.get(url(port, "/boom"))
            assert r.status_code == 500
            assert r.json() == {"error": {"message": "internal server error", "code": 500}}
            assert "secret" not in r.text
            assert (await client.get(url(port, "/ok"))).text == "fine"
    records = [r for r in caplog.records if r.name == "llmgw.http"]
    assert any(
        r.levelno == logging.ERROR and r.exc_info and "secret detail" in str(r.exc_info[1])
        for r in records
    )


@pytest.mark.parametrize(
    "response",
    [
        Response(200, [("x-evil", "a\r\nset-cookie: b=c")], b""),
        Response(200, [("content-length", "3")], b"four"),
        Response(200, [("transfer-encoding", "chunked")], b"x"),
        Response(101),
        Response(200, [], "text, not bytes"),  # type: ignore[arg-type]
        None,
    ],
)
async def test_unframeable_response_becomes_500(
    start_server: StartServer, response: Response | None
) -> None:
    async def handler(request: Request) -> Response:
        return response  # type: ignore[return-value]

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        reply = await c.reply()
    assert reply.status == 500
    assert reply.header("set-cookie") is None


async def test_custom_error_body(start_server: StartServer) -> None:
    def error_body(status: int, message: str) -> tuple[str, bytes]:
        return "text/plain", f"E{status}: {message}".encode()

    _, port = await start_server(error_body=error_body)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\n\r\n")
        reply = await c.reply()
    assert reply.status == 400
    assert reply.header("content-type") == "text/plain"
    assert reply.body == b"E400: missing Host header"


async def test_large_bodies_both_ways(start_server: StartServer) -> None:
    big = bytes(range(256)) * 16 * 1024  # 4 MiB: more than one socket buffer

    async def handler(request: Request) -> Response:
        return Response(200, body=request.body[::-1])

    _, port = await start_server(handler, limits=ServerLimits(max_body_bytes=len(big)))
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            r = await client.post(url(port), content=big)
    assert r.status_code == 200
    assert r.content == big[::-1]


async def test_streamed_chunks_reach_the_client_as_they_are_yielded(
    start_server: StartServer,
) -> None:
    release = trio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        await release.wait()
        yield b""  # empty chunks are skipped, not sent as the terminator
        yield b"second"

    async def handler(request: Request) -> Response:
        return Response(200, [("content-type", "text/event-stream")], chunks())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
        early = await read_raw_until(c.stream, b"first\r\n")
        assert early.endswith(b"5\r\nfirst\r\n")
        head = early.partition(b"\r\n\r\n")[0].lower()
        assert b"transfer-encoding: chunked" in head
        assert b"content-length" not in head
        release.set()
        rest = await read_raw_until(c.stream, b"0\r\n\r\n")
        assert rest == b"6\r\nsecond\r\n0\r\n\r\n"
        # And the connection is reusable after the stream.
        await c.send(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await c.reply()).body == b"firstsecond"


async def test_streamed_body_with_handler_content_length(start_server: StartServer) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"abc"
        yield b"def"

    async def handler(request: Request) -> Response:
        return Response(200, [("content-length", "6")], chunks())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            r = await client.get(url(port))
    assert r.content == b"abcdef"
    assert r.headers["content-length"] == "6"
    assert "transfer-encoding" not in r.headers


async def test_streamed_body_to_http10_is_close_delimited(start_server: StartServer) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"abc"
        yield b"def"

    async def handler(request: Request) -> Response:
        return Response(200, [], chunks())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        raw = await c.closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head
    assert b"transfer-encoding" not in head
    assert body == b"abcdef"


async def test_stream_that_fails_midway_cuts_the_connection(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"partial"
        raise ValueError("upstream broke")

    async def handler(request: Request) -> Response:
        return Response(200, [], chunks())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        raw = await c.closed()
    assert raw.endswith(b"7\r\npartial\r\n")  # no terminating chunk: the client sees truncation
    assert any("upstream broke" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


async def test_client_disconnect_cancels_the_handler(start_server: StartServer) -> None:
    started = trio.Event()
    cancelled = trio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    server, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
        await started.wait()
        assert server.in_flight == 1
        await c.aclose()
        with trio.fail_after(1):
            await cancelled.wait()
        await eventually(lambda: server.open_connections == 0)
        assert server.in_flight == 0


async def test_client_disconnect_cancels_a_streaming_response(start_server: StartServer) -> None:
    cancelled = trio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"token"
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async def handler(request: Request) -> Response:
        return Response(200, [], chunks())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await read_raw_until(c.stream, b"token")
        await c.aclose()
        with trio.fail_after(1):
            await cancelled.wait()


async def test_a_streamed_body_is_closed_even_if_its_head_never_went_out(
    start_server: StartServer,
) -> None:
    """The client leaves while the handler finishes; the body it returned is
    never read, and must still be closed (it holds an upstream connection)."""
    closed = trio.Event()

    class Body:
        def __aiter__(self) -> Body:
            return self

        async def __anext__(self) -> bytes:
            raise StopAsyncIteration

        async def aclose(self) -> None:
            closed.set()

    left = trio.Event()

    async def handler(request: Request) -> Response:
        with trio.CancelScope(shield=True):  # finishes its work though the client left
            await left.wait()
            await trio.sleep(0.1)
        return Response(200, [], Body())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await trio.sleep(0.1)
        # gone with a reset, so that writing the head fails
        c.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await c.aclose()
        left.set()
        with trio.fail_after(1):
            await closed.wait()


async def test_client_that_stops_reading_is_given_up_on(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    closed = trio.Event()
    megabyte = b"x" * (1 << 20)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            for _ in range(512):
                yield megabyte
        finally:
            closed.set()

    async def handler(request: Request) -> Response:
        return Response(200, [], chunks())

    server, port = await start_server(handler, limits=ServerLimits(write_timeout_s=5.0))
    with trio.fail_after(30):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await closed.wait()  # the writer gave up and closed the body
        await eventually(lambda: server.open_connections == 0)
        await c.aclose()


async def test_server_keeps_serving_others_while_one_handler_blocks(
    start_server: StartServer,
) -> None:
    release = trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/block":
            await release.wait()
        return Response(200, body=request.path.encode())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
            results: list[str] = []

            async def blocked() -> None:
                results.append((await client.get(url(port, "/block"))).text)

            nursery.start_soon(blocked)
            for i in range(5):
                assert (await client.get(url(port, f"/{i}"))).text == f"/{i}"
            assert results == []
            release.set()
        assert results == ["/block"]


async def test_cancelling_serve_closes_everything_promptly() -> None:
    cancelled = trio.Event()
    started = trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/hang":
            started.set()
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()
        return Response(200)

    server = HttpServer(handler)
    with trio.fail_after(10):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as serving:
                (listener,) = await serving.start(server.serve_tcp, "127.0.0.1", 0)
                port = listener.socket.getsockname()[1]
                idle = await RawClient.connect(port)
                await idle.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                assert (await idle.reply()).status == 200
                busy = await RawClient.connect(port)
                await busy.send(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
                await started.wait()
                fresh = await RawClient.connect(port)
                t0 = trio.current_time()
                serving.cancel_scope.cancel()
            assert trio.current_time() - t0 < 0.5
            assert cancelled.is_set()
            assert server.open_connections == 0
            for c in (idle, busy, fresh):
                with trio.fail_after(0.5):
                    assert await c.closed() == b""
            outer.cancel_scope.cancel()
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_drain_finishes_in_flight_closes_idle_and_stops_accepting() -> None:
    started = trio.Event()
    release = trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            started.set()
            await release.wait()
        return Response(200, body=request.path.encode())

    server = HttpServer(handler)
    served = trio.Event()

    async def serve(task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        await server.serve_tcp("127.0.0.1", 0, task_status=task_status)
        served.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(serve)
            port = listener.socket.getsockname()[1]
            idle = await RawClient.connect(port)
            await idle.send(b"GET /idle HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await idle.reply()).status == 200
            busy = await RawClient.connect(port)
            await busy.send(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            await started.wait()

            server.drain()
            with trio.fail_after(1):
                assert await idle.closed() == b""
            with pytest.raises(OSError) as refused:
                await trio.open_tcp_stream("127.0.0.1", port)
            assert refused.value.errno in (errno.ECONNREFUSED, None)
            assert not served.is_set()

            release.set()
            reply = await busy.reply()
            assert reply.body == b"/slow"
            assert reply.header("connection") == "close"
            assert await busy.closed() == b""
            await busy.aclose()  # the server lingers until the client has closed too
            with trio.fail_after(1):
                await served.wait()
    assert server.open_connections == 0


def trusting(request: Request) -> None:
    """An admit for which every request proves who sent it."""
    request.principal = "someone"


async def test_connections_beyond_the_limit_are_refused(start_server: StartServer) -> None:
    """At the limit, with no idle connection that proved nobody to close, a new one
    gets a 503 and is closed."""
    server, port = await start_server(limits=ServerLimits(max_connections=1), admit=trusting)
    with trio.fail_after(10):
        first = await RawClient.connect(port)
        await first.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await first.reply()).status == 200
        assert server.open_connections == 1

        second = await RawClient.connect(port)
        raw = await second.closed()
        assert raw.startswith(b"HTTP/1.1 503 ")
        assert server.open_connections == 1

        await first.aclose()
        await eventually(lambda: server.open_connections == 0)
        third = await RawClient.connect(port)
        await third.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await third.reply()).status == 200


async def test_error_body_failure_falls_back_to_the_default(
    start_server: StartServer,
) -> None:
    def broken(status: int, message: str) -> tuple[str, bytes]:
        raise KeyError(status)

    _, port = await start_server(error_body=broken)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\n\r\n")
        reply = await c.reply()
    assert reply.status == 400
    assert json.loads(reply.body)["error"]["code"] == 400


async def test_serve_on_given_listeners(nursery: trio.Nursery) -> None:
    server = HttpServer(echo_path)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            assert (await client.get(url(port, "/given"))).text == "/given"
            # Accepted sockets have Nagle's algorithm off: small responses go out at once.
            (conn,) = server._connections
            assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def echo_path(request: Request) -> Response:
    return Response(200, body=request.path.encode())

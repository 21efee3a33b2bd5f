"""HTTP/1.1 conformance over raw sockets: framing, keep-alive, pipelining, errors, timeouts."""

from __future__ import annotations

import json

import pytest
import trio

from llmgw.http import Request, Response, ServerLimits

from .helpers import RawClient, StartServer, eventually, read_raw_until

GET = b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n"


def get(path: str, *extra: str) -> bytes:
    head = [f"GET {path} HTTP/1.1", "Host: t", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


async def test_keep_alive_serves_several_requests_on_one_connection(
    start_server: StartServer,
) -> None:
    clients: list[tuple[str, int]] = []

    async def handler(request: Request) -> Response:
        clients.append(request.client)
        return Response(200, body=request.path.encode())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        for path in ("/1", "/2", "/3"):
            await c.send(get(path))
            reply = await c.reply()
            assert reply.status == 200
            assert reply.body == path.encode()
            assert reply.header("connection") is None
    assert len(set(clients)) == 1  # same client port: one connection


async def test_connection_close_from_client_is_honoured(start_server: StartServer) -> None:
    _, port = await start_server()
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(get("/x", "Connection: close"))
        reply = await c.reply()
        assert reply.status == 200
        assert reply.header("connection") == "close"
        assert await c.closed() == b""


async def test_connection_close_from_handler_is_honoured(start_server: StartServer) -> None:
    async def handler(request: Request) -> Response:
        return Response(200, [("Connection", "close")], b"bye")

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(GET)
        reply = await c.reply()
        assert reply.body == b"bye"
        assert reply.header("connection") == "close"
        assert await c.closed() == b""


async def test_http10_closes_unless_keep_alive_asked(start_server: StartServer) -> None:
    _, port = await start_server()
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET /old HTTP/1.0\r\n\r\n")
        reply = await c.reply()
        assert reply.status == 200
        assert reply.header("x-request") == "GET /old  1.0"
        assert await c.closed() == b""

        c = await RawClient.connect(port)
        for _ in range(2):
            await c.send(b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            reply = await c.reply()
            assert reply.status == 200
            assert reply.header("connection") == "keep-alive"


async def test_pipelined_requests_in_one_write_are_answered_in_order(
    start_server: StartServer,
) -> None:
    async def handler(request: Request) -> Response:
        await trio.sleep(0.01 if request.path == "/1" else 0)
        return Response(200, body=request.path.encode() + request.body)

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(
            get("/1") + b"POST /2 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc" + get("/3")
        )
        assert [(await c.reply()).body for _ in range(3)] == [b"/1", b"/2abc", b"/3"]


async def test_bytes_arriving_while_a_handler_runs_are_not_lost(
    start_server: StartServer,
) -> None:
    started = trio.Event()
    release = trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            started.set()
            await release.wait()
        return Response(200, body=request.path.encode())

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(get("/slow"))
        await started.wait()
        # These arrive while the first handler runs; the disconnect watcher reads them.
        await c.send(get("/2"))
        await c.send(get("/3") + get("/4")[:10])
        await trio.sleep(0.05)
        release.set()
        assert (await c.reply()).body == b"/slow"
        assert (await c.reply()).body == b"/2"
        assert (await c.reply()).body == b"/3"
        await c.send(get("/4")[10:])
        assert (await c.reply()).body == b"/4"


async def test_request_fed_byte_by_byte(start_server: StartServer) -> None:
    _, port = await start_server()
    request = b"POST /p?q=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        for i in range(len(request)):
            await c.send(request[i : i + 1])
            await trio.sleep(0.001)
        reply = await c.reply()
        assert reply.status == 200
        assert reply.body == b"hello"
        assert reply.header("x-request") == "POST /p q=1 1.1"


async def test_trailing_garbage_gets_400_after_the_good_request(
    start_server: StartServer,
) -> None:
    _, port = await start_server()
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(GET + b"\x16\x03\x01 garbage\r\n\r\n")
        assert (await c.reply()).status == 200
        bad = await c.reply()
        assert bad.status == 400
        assert bad.header("connection") == "close"
        message = json.loads(bad.body)["error"]["message"]
        assert message.startswith("malformed request: ")
        assert "method" in message.lower()  # httptools' own reason
        assert await c.closed() == b""


async def test_chunked_request_body(start_server: StartServer) -> None:
    _, port = await start_server()
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(
            b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n"
        )
        await trio.sleep(0.01)
        await c.send(b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n" + GET)
        reply = await c.reply()
        assert reply.status == 200
        assert reply.body == b"hello world"
        assert (await c.reply()).status == 200  # the connection stays usable


async def test_expect_100_continue(start_server: StartServer) -> None:
    _, port = await start_server()
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(
            b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await c.reply()
        assert interim.status == 100
        await c.send(b"data")
        reply = await c.reply()
        assert reply.status == 200
        assert reply.body == b"data"


async def test_expect_100_continue_over_the_limit_gets_413_instead(
    start_server: StartServer,
) -> None:
    _, port = await start_server(limits=ServerLimits(max_body_bytes=10))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(
            b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n"
        )
        reply = await c.reply()
        assert reply.status == 413
        assert await c.closed() == b""


async def test_head_gets_headers_without_body(start_server: StartServer) -> None:
    async def handler(request: Request) -> Response:
        return Response(200, [("content-type", "text/plain")], b"0123456789")

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        raw = await read_raw_until(c.stream, b"0123456789")
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert b"content-length: 10" in head.lower()
        # The next bytes are the second response: the HEAD reply carried no body.
        assert rest.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    ("request_bytes", "status", "words"),
    [
        (b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n", 400, "Invalid header token"),
        (b"GET /\xff HTTP/1.1\r\nHost: t\r\n\r\n", 400, "malformed request"),
        (b"GET / HTTP/1.1\r\n\r\n", 400, "missing Host header"),
        (b"GET / HTTP/2.0\r\nHost: t\r\n\r\n", 505, "HTTP/2.0"),
        (
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            501,
            "gzip",
        ),
        (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "gzip"),
        (
            b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            400,
            "Content-Length",
        ),
        (b"GET / HTTP/1.1\r\nHost: t\r\nExpect: magic\r\n\r\n", 417, "magic"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nHost: t\r\n\r\n", 501, "CONNECT"),
    ],
)
async def test_bad_requests_are_answered_in_words_then_closed(
    start_server: StartServer, request_bytes: bytes, status: int, words: str
) -> None:
    called = False

    async def handler(request: Request) -> Response:
        nonlocal called
        called = True
        return Response(200)

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(request_bytes)
        reply = await c.reply()
        assert reply.status == status
        assert reply.header("connection") == "close"
        assert words in json.loads(reply.body)["error"]["message"]
        assert await c.closed() == b""
    assert not called


async def test_oversized_headers_get_431(start_server: StartServer) -> None:
    _, port = await start_server(limits=ServerLimits(max_header_bytes=1024))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(get("/", "X-Big: " + "a" * 2000))
        assert (await c.reply()).status == 431
        assert await c.closed() == b""

        # A header that never ends is refused once it is over the limit, not buffered forever.
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Endless: ")
        for _ in range(4):
            await c.send(b"b" * 512)
            await trio.sleep(0.01)
        assert (await c.reply()).status == 431


async def test_header_just_under_the_limit_is_accepted(start_server: StartServer) -> None:
    _, port = await start_server(limits=ServerLimits(max_header_bytes=1024))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(get("/", "X-Big: " + "a" * 900))
        assert (await c.reply()).status == 200


async def test_oversized_bodies_get_413(start_server: StartServer) -> None:
    _, port = await start_server(limits=ServerLimits(max_body_bytes=100))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 101\r\n\r\n")
        assert (await c.reply()).status == 413  # refused up front, body never sent
        assert await c.closed() == b""

        c = await RawClient.connect(port)
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            await c.send(b"3c\r\n" + b"x" * 60 + b"\r\n")
        assert (await c.reply()).status == 413
        assert await c.closed() == b""

        c = await RawClient.connect(port)
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)
        assert (await c.reply()).status == 200


async def test_slow_head_gets_408_counted_from_the_first_byte(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    _, port = await start_server(limits=ServerLimits(header_timeout_s=2.0))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        t0 = trio.current_time()
        await c.send(b"GET / HTTP/1.1\r\n")

        async def trickle() -> None:
            # A byte every 0.5 s: each read is quick, the head never completes.
            for _ in range(20):
                await trio.sleep(0.5)
                try:
                    await c.send(b"X")
                except trio.BrokenResourceError:
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            reply = await c.reply()
            nursery.cancel_scope.cancel()
        assert reply.status == 408
        assert 2.0 <= trio.current_time() - t0 < 2.6


async def test_slow_body_gets_408(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    _, port = await start_server(limits=ServerLimits(body_timeout_s=3.0))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
        t0 = trio.current_time()
        reply = await c.reply()
        assert reply.status == 408
        assert 3.0 <= trio.current_time() - t0 < 3.5
        assert await c.closed() == b""


async def test_idle_keep_alive_connection_is_closed_quietly(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    _, port = await start_server(limits=ServerLimits(keepalive_timeout_s=5.0))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(GET)
        assert (await c.reply()).status == 200
        t0 = trio.current_time()
        assert await c.closed() == b""  # no 408: nothing was asked
        assert 5.0 <= trio.current_time() - t0 < 5.5


async def test_silent_fresh_connection_is_closed_after_the_header_timeout(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    _, port = await start_server(
        limits=ServerLimits(header_timeout_s=1.0, keepalive_timeout_s=60.0)
    )
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        t0 = trio.current_time()
        assert await c.closed() == b""
        assert 1.0 <= trio.current_time() - t0 < 1.5


async def test_upgrade_request_is_served_plainly_then_closed(start_server: StartServer) -> None:
    _, port = await start_server()
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(get("/ws", "Connection: Upgrade", "Upgrade: websocket") + GET)
        reply = await c.reply()
        assert reply.status == 200
        assert reply.header("connection") == "close"
        assert await c.closed() == b""


async def test_server_drains_input_after_an_error_instead_of_resetting(
    start_server: StartServer, autojump_clock: trio.testing.MockClock
) -> None:
    # Closing with unread input makes the kernel answer with a reset, which can
    # destroy the error reply before the client reads it. The server half-closes
    # and reads what is still coming, for a bounded time.
    server, port = await start_server(limits=ServerLimits(max_body_bytes=100))
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 400000\r\n\r\n")
        assert (await c.reply()).status == 413
        assert await c.closed() == b""  # half-closed: EOF for the client...
        for _ in range(5):  # ...which may still send (the rest of its body) without a reset
            await c.send(b"x" * 10_000)
            await trio.sleep(0.01)
        assert server.open_connections == 1
        await eventually(lambda: server.open_connections == 0)  # bounded: gives up in time
        await c.aclose()

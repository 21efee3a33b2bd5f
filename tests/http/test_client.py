"""UpstreamPool against real servers on loopback.

Normal paths run against the project's own ``HttpServer``; misbehaviour
(slow heads, stalls, resets, malformed or oversized heads, close-delimited
bodies) against tiny raw trio socket servers that do exactly one bad thing.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial

import pytest
import trio

from llmgw.http import (
    ClientLimits,
    ConnectFailed,
    ConnectTimeout,
    Request,
    Response,
    ServerLimits,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
)

from .helpers import StartServer, eventually, read_raw_until

HOST = "127.0.0.1"

RawHandler = Callable[[trio.SocketStream], Awaitable[None]]
MakePool = Callable[..., UpstreamPool]


@pytest.fixture
async def make_pool() -> AsyncIterator[MakePool]:
    """`make_pool(**limits)` -> a pool, closed when the test ends."""
    pools: list[UpstreamPool] = []

    def make(**limits: object) -> UpstreamPool:
        pool = UpstreamPool(ClientLimits(**limits))  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.aclose()


async def start_raw(nursery: trio.Nursery, handler: RawHandler) -> int:
    """Serve each connection with `handler` on 127.0.0.1; -> port.

    The connection is closed when `handler` returns; the peer going away
    under it ends it quietly."""

    async def run(stream: trio.SocketStream) -> None:
        try:
            await handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, run, 0, host=HOST))
    return int(listeners[0].socket.getsockname()[1])


async def until_eof(stream: trio.SocketStream, event: trio.Event | None = None) -> None:
    """Read and discard until the client closes (or resets); then set `event`."""
    try:
        while await stream.receive_some():
            pass
    except trio.BrokenResourceError:
        pass
    if event is not None:
        event.set()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


# ---------------------------------------------------------------- normal paths
async def test_request_as_the_server_sees_it(
    start_server: StartServer, make_pool: MakePool
) -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(201, [("content-type", "text/plain"), ("X-Out", "yes")], b"made")

    _, port = await start_server(handler)
    pool = make_pool()
    with trio.fail_after(10):
        response = await pool.request(
            "POST",
            HOST,
            port,
            "/v1/chat?x=1",
            [("X-Multi", "one"), ("x-multi", "two"), ("Content-Length", "999")],
            b"payload",
        )
        assert await response.read() == b"made"
        empty = await pool.request("POST", HOST, port, "/empty", [], b"")
        assert await empty.read() == b"made"
    assert response.status == 201
    assert response.headers.get("x-out") == "yes"  # names lower-cased
    assert response.headers.get("Content-Length") == "4"
    req = seen[0]
    assert (req.method, req.path, req.query, req.body) == ("POST", "/v1/chat", "x=1", b"payload")
    assert req.headers.get("host") == f"{HOST}:{port}"
    assert req.headers.get_all("content-length") == ["7"]  # the caller's is replaced
    assert req.headers.get_all("x-multi") == ["one", "two"]
    assert seen[1].headers.get("content-length") == "0"


async def test_caller_host_header_is_kept(start_server: StartServer, make_pool: MakePool) -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(204)

    _, port = await start_server(handler)
    pool = make_pool()
    with trio.fail_after(10):
        response = await pool.request("GET", HOST, port, "/", [("Host", "engine-7")], b"")
        assert await response.read() == b""
    assert response.status == 204
    assert seen[0].headers.get_all("host") == ["engine-7"]
    assert "content-length" not in seen[0].headers  # a GET without a body carries none


async def test_keepalive_reuse(start_server: StartServer, make_pool: MakePool) -> None:
    server, port = await start_server()
    pool = make_pool()
    with trio.fail_after(10):
        for i in range(20):
            response = await pool.request("POST", HOST, port, "/", [], b"n%d" % i)
            assert response.status == 200
            assert await response.read() == b"n%d" % i
            assert pool.idle_count(HOST, port) == 1
    assert pool.connections_opened == 1
    assert server.open_connections == 1


async def test_concurrent_requests(start_server: StartServer, make_pool: MakePool) -> None:
    async def handler(request: Request) -> Response:
        await trio.sleep(0.02)  # keep them all in flight together
        return Response(200, [], request.body[::-1])

    _, port = await start_server(handler)
    pool = make_pool()
    results: dict[int, tuple[int, bytes]] = {}

    async def one(i: int) -> None:
        response = await pool.request("POST", HOST, port, f"/{i}", [], b"request-%03d" % i)
        results[i] = (response.status, await response.read())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(one, i)
    assert results == {i: (200, (b"request-%03d" % i)[::-1]) for i in range(50)}
    assert pool.connections_opened == 50
    assert pool.idle_count(HOST, port) == 50
    assert pool.open_connections == 50
    # A second wave reuses them all.
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(one, i)
    assert pool.connections_opened == 50


async def test_chunked_stream_passes_chunks_promptly(
    start_server: StartServer, make_pool: MakePool
) -> None:
    release = trio.Event()

    async def handler(request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            await release.wait()  # chunk 2 only once the client has chunk 1
            yield b"data: 2\n\n"
            yield b"data: [DONE]\n\n"

        return Response(200, [("content-type", "text/event-stream")], events())

    _, port = await start_server(handler)
    pool = make_pool()
    with trio.fail_after(5):
        async with pool.stream("POST", HOST, port, "/v1/chat/completions", [], b"{}") as response:
            assert response.status == 200
            assert response.headers.get("transfer-encoding") == "chunked"
            body = response.body_iter
            assert await body.__anext__() == b"data: 1\n\n"
            assert not release.is_set()
            release.set()
            rest = [chunk async for chunk in body]
    assert b"".join(rest) == b"data: 2\n\ndata: [DONE]\n\n"
    assert pool.idle_count(HOST, port) == 1  # read to its end: back in the pool


async def test_head_request_then_reuse(start_server: StartServer, make_pool: MakePool) -> None:
    _, port = await start_server()
    pool = make_pool()
    with trio.fail_after(10):
        head = await pool.request("HEAD", HOST, port, "/", [], b"")
        assert head.status == 200
        assert int(head.headers.get("content-length", "0")) > 0
        assert await head.read() == b""
        after = await pool.request("POST", HOST, port, "/", [], b"after")
        assert await after.read() == b"after"
    assert pool.connections_opened == 1


async def test_response_with_connection_close_is_not_pooled(
    start_server: StartServer, make_pool: MakePool
) -> None:
    async def handler(request: Request) -> Response:
        return Response(200, [("connection", "close")], b"bye")

    _, port = await start_server(handler)
    pool = make_pool()
    with trio.fail_after(10):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"bye"
    assert pool.idle_count(HOST, port) == 0
    assert pool.open_connections == 0


async def test_request_connection_close_is_not_pooled(
    start_server: StartServer, make_pool: MakePool
) -> None:
    _, port = await start_server()
    pool = make_pool()
    with trio.fail_after(10):
        response = await pool.request("GET", HOST, port, "/", [("Connection", "close")], b"")
        await response.read()
    assert pool.idle_count(HOST, port) == 0
    assert pool.open_connections == 0


async def test_interim_responses_are_skipped(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + ok(b"real"))
        await until_eof(stream)

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"real"
    assert response.status == 200
    assert "link" not in response.headers


async def test_close_delimited_body(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\npart1 ")
        await trio.sleep(0.05)
        await stream.send_all(b"part2")

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert response.status == 200
        assert await response.read() == b"part1 part2"
    assert pool.idle_count(HOST, port) == 0
    assert pool.open_connections == 0


# ---------------------------------------------------------------- timeouts
async def test_head_timeout(nursery: trio.Nursery, make_pool: MakePool) -> None:
    gone = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await until_eof(stream, gone)  # never answers

    port = await start_raw(nursery, handler)
    pool = make_pool(first_byte_timeout_s=0.2)
    with trio.fail_after(5):
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request("GET", HOST, port, "/", [], b"")
        await gone.wait()  # the connection was closed
    assert info.value.phase == "head"
    assert pool.open_connections == 0


async def test_body_stall_timeout(nursery: trio.Nursery, make_pool: MakePool) -> None:
    gone = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await until_eof(stream, gone)  # the other 7 bytes never come

    port = await start_raw(nursery, handler)
    pool = make_pool(idle_timeout_s=0.2)
    with trio.fail_after(5):
        async with pool.stream("GET", HOST, port, "/", [], b"") as response:
            assert await response.body_iter.__anext__() == b"abc"
            with pytest.raises(UpstreamTimeout) as info:
                await response.body_iter.__anext__()
        await gone.wait()
    assert info.value.phase == "body"
    assert pool.open_connections == 0


@pytest.mark.parametrize(("first_gap", "times_out"), [(0.5, False), (1.2, True)])
async def test_the_first_body_byte_has_the_first_byte_timeout(
    nursery: trio.Nursery, make_pool: MakePool, first_gap: float, times_out: bool
) -> None:
    """Engines send a stream's head as soon as they take the request, then read
    the prompt: until the first body byte the wait is the first-byte timeout,
    not the idle one, or a long prefill would cut the stream."""

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await trio.sleep(first_gap)  # the prefill
        await stream.send_all(b"1\r\nx\r\n")
        await trio.sleep(0.05)
        await stream.send_all(b"1\r\ny\r\n0\r\n\r\n")

    port = await start_raw(nursery, handler)
    pool = make_pool(idle_timeout_s=0.2, first_byte_timeout_s=1.0)
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        if times_out:  # past the first-byte timeout, counted from the request
            with pytest.raises(UpstreamTimeout) as info:
                await response.read()
            assert info.value.phase == "body"
        else:
            assert await response.read() == b"xy"


async def test_a_steady_body_outlives_the_idle_timeout(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    """The idle deadline is per read: a body whose chunks each come in time is
    never cut, however long it takes in all."""

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):
            await trio.sleep(0.08)
            await stream.send_all(b"1\r\nx\r\n")
        await stream.send_all(b"0\r\n\r\n")

    port = await start_raw(nursery, handler)
    pool = make_pool(idle_timeout_s=0.2)  # the whole body takes over 0.6 s
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"x" * 8
    assert pool.idle_count(HOST, port) == 1


async def test_aclose_interrupts_a_body_read_with_a_reset(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await until_eof(stream)

    port = await start_raw(nursery, handler)
    pool = make_pool(idle_timeout_s=0.2)
    errors: list[BaseException] = []

    async def read() -> None:
        response = await pool.request("GET", HOST, port, "/", [], b"")
        try:
            await response.read()
        except (UpstreamReset, UpstreamTimeout) as exc:
            errors.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            inner.start_soon(read)
            await trio.sleep(0.05)
            await pool.aclose()
    assert [type(e) for e in errors] == [UpstreamReset]
    assert pool.open_connections == 0


async def test_send_timeout(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()  # never reads

    port = await start_raw(nursery, handler)
    pool = make_pool(write_timeout_s=0.3)
    with trio.fail_after(10):
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request("POST", HOST, port, "/", [], b"x" * (64 * 1024 * 1024))
    assert info.value.phase == "send"
    assert pool.open_connections == 0


@pytest.fixture
def full_listener() -> Iterator[int]:
    """A port whose accept queue is full: connecting hangs (SYNs are dropped)."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect((HOST, port))
        except BlockingIOError:
            pass
        fillers.append(sock)
    try:
        yield port
    finally:
        for sock in fillers:
            sock.close()
        listener.close()


async def test_connect_timeout(full_listener: int, make_pool: MakePool) -> None:
    pool = make_pool(connect_timeout_s=0.3)
    with trio.fail_after(5):
        with pytest.raises(ConnectTimeout) as info:
            await pool.request("GET", HOST, full_listener, "/", [], b"")
    assert isinstance(info.value, ConnectFailed)  # nothing was sent
    assert isinstance(info.value, UpstreamTimeout)
    assert info.value.phase == "connect"
    assert pool.open_connections == 0


async def test_connect_refused(make_pool: MakePool) -> None:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        pool = make_pool()
        with trio.fail_after(5):
            with pytest.raises(ConnectFailed) as info:
                await pool.request("GET", HOST, port, "/", [], b"")
    assert info.value.phase == "connect"
    assert not isinstance(info.value, UpstreamTimeout)
    assert pool.connections_opened == 0


# ---------------------------------------------------------------- resets
async def test_reset_before_response(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")  # then close without a word

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        with pytest.raises(UpstreamReset) as info:
            await pool.request("GET", HOST, port, "/", [], b"")
    assert info.value.before_response
    assert info.value.phase == "head"
    assert pool.connections_opened == 1  # a fresh connection is not retried
    assert pool.open_connections == 0


async def test_reset_mid_head(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-le")

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        with pytest.raises(UpstreamReset) as info:
            await pool.request("GET", HOST, port, "/", [], b"")
    assert not info.value.before_response
    assert info.value.phase == "head"


async def test_reset_mid_body(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await trio.sleep(0.05)  # then die before the last chunk

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert response.status == 200
        with pytest.raises(UpstreamReset) as info:
            await response.read()
    assert not info.value.before_response
    assert info.value.phase == "body"
    assert pool.open_connections == 0


async def test_stale_pooled_connection_is_retried_once(
    start_server: StartServer, make_pool: MakePool
) -> None:
    served: list[bytes] = []

    async def handler(request: Request) -> Response:
        served.append(request.body)
        return Response(200, [], request.body)

    server, port = await start_server(handler, limits=ServerLimits(keepalive_timeout_s=0.1))
    pool = make_pool()
    with trio.fail_after(10):
        first = await pool.request("POST", HOST, port, "/", [], b"one")
        assert await first.read() == b"one"
        assert pool.idle_count(HOST, port) == 1
        await eventually(lambda: server.open_connections == 0)  # the server dropped it
        second = await pool.request("POST", HOST, port, "/", [], b"two")
        assert await second.read() == b"two"
    assert pool.connections_opened == 2
    assert served == [b"one", b"two"]  # the stale attempt never reached the server


async def test_close_after_response_without_connection_close(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(ok(b"conn%d" % connections))
        # and close, though the response promised keep-alive

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        for i in (1, 2, 3):
            response = await pool.request("GET", HOST, port, "/", [], b"")
            assert await response.read() == b"conn%d" % i
            await trio.sleep(0.05)  # let the close arrive
    assert pool.connections_opened == 3


async def test_retry_happens_only_once(nursery: trio.Nursery, make_pool: MakePool) -> None:
    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await read_raw_until(stream, b"\r\n\r\n")
        if connections == 1:
            await stream.send_all(ok(b"first"))
        # every connection then closes without (another) answer

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"first"
        await trio.sleep(0.05)
        with pytest.raises(UpstreamReset) as info:
            await pool.request("GET", HOST, port, "/", [], b"")
    assert info.value.before_response
    assert pool.connections_opened == 2  # the reused one, then one fresh retry


async def test_an_upstream_that_dies_under_a_reused_connection_is_a_reset(
    make_pool: MakePool,
) -> None:
    """It answers once (kept alive), reads the next request, then dies: the
    connection closes and its port refuses. That is the request's connection closed
    without a response (the upstream may have died of it), not a refused connect."""
    listener = trio.socket.socket()
    await listener.bind((HOST, 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    async def serve() -> None:
        sock, _ = await listener.accept()
        stream = trio.SocketStream(sock)
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(ok(b"first"))
        await read_raw_until(stream, b"\r\n\r\n")
        listener.close()  # the process is gone: nothing listens any more
        await stream.aclose()

    pool = make_pool()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            response = await pool.request("GET", HOST, port, "/", [], b"")
            assert await response.read() == b"first"
            with pytest.raises(UpstreamReset) as info:
                await pool.request("GET", HOST, port, "/", [], b"")
    assert info.value.before_response
    assert "connection closed without a response" in str(info.value)


async def test_no_retry_once_response_bytes_arrived(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(ok(b"first"))
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\n")  # and die

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"first"
        with pytest.raises(UpstreamReset) as info:
            await pool.request("GET", HOST, port, "/", [], b"")
    assert not info.value.before_response
    assert pool.connections_opened == 1


async def test_expired_idle_connection_is_not_reused(
    start_server: StartServer, make_pool: MakePool
) -> None:
    _, port = await start_server()
    pool = make_pool(idle_keepalive_s=0.1)
    with trio.fail_after(5):
        await (await pool.request("GET", HOST, port, "/", [], b"")).read()
        await trio.sleep(0.2)
        await (await pool.request("GET", HOST, port, "/", [], b"")).read()
    assert pool.connections_opened == 2
    assert pool.open_connections == 1  # the expired one was closed


# ---------------------------------------------------------------- protocol errors
async def test_malformed_response(nursery: trio.Nursery, make_pool: MakePool) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 2x0 OK\r\n\r\n")
        await until_eof(stream)

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        with pytest.raises(UpstreamProtocolError) as info:
            await pool.request("GET", HOST, port, "/", [], b"")
    assert info.value.phase == "head"
    assert pool.open_connections == 0


@pytest.mark.parametrize("shape", ["one-header", "many-headers"])
async def test_huge_response_head(nursery: trio.Nursery, make_pool: MakePool, shape: str) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        if shape == "one-header":
            head = b"x-big: " + b"a" * 100_000 + b"\r\n"
        else:
            head = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 40) for i in range(2000))
        await stream.send_all(b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 0\r\n\r\n")
        await until_eof(stream)

    port = await start_raw(nursery, handler)
    pool = make_pool(max_header_bytes=16 * 1024)
    with trio.fail_after(5):
        with pytest.raises(UpstreamProtocolError, match="too large") as info:
            await pool.request("GET", HOST, port, "/", [], b"")
    assert info.value.phase == "head"


async def test_bytes_after_response_make_connection_unusable(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(ok(b"fine") + b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nodd")
        await until_eof(stream)

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"fine"
    assert pool.idle_count(HOST, port) == 0
    assert pool.open_connections == 0


async def test_header_injection_is_refused(make_pool: MakePool) -> None:
    pool = make_pool()
    for headers, target in (
        ([("x-a", "1\r\nx-b: 2")], "/"),
        ([("x-a\r\nx-b", "2")], "/"),
        ([], "/ HTTP/1.1\r\nx-b: 2\r\n\r\nGET /"),
        ([], "/a b"),
    ):
        with pytest.raises(ValueError, match="CR, LF"):
            await pool.request("GET", HOST, 1, target, headers, b"")
    assert pool.connections_opened == 0


# ---------------------------------------------------------------- cancellation and leaks
async def test_cancelled_stream_closes_upstream(nursery: trio.Nursery, make_pool: MakePool) -> None:
    gone = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"
        )
        await until_eof(stream, gone)

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        with trio.CancelScope() as scope:
            async with pool.stream("GET", HOST, port, "/", [], b"") as response:
                assert await response.body_iter.__anext__() == b"first"
                scope.cancel()
                await response.body_iter.__anext__()  # waits for more: cancelled
        assert scope.cancelled_caught
        with trio.fail_after(1):
            await gone.wait()
    assert pool.open_connections == 0
    assert pool.idle_count(HOST, port) == 0


async def test_stream_exit_with_unread_body_closes_upstream(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    gone = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        await until_eof(stream, gone)

    port = await start_raw(nursery, handler)
    pool = make_pool()
    with trio.fail_after(5):
        async with pool.stream("GET", HOST, port, "/", [], b"") as response:
            assert response.status == 200  # leaves without reading the body
        assert pool.open_connections == 0
        await gone.wait()
    assert pool.idle_count(HOST, port) == 0


async def test_cancel_while_waiting_for_head_closes_upstream(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    gone = trio.Event()
    got_request = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        got_request.set()
        await until_eof(stream, gone)

    port = await start_raw(nursery, handler)
    pool = make_pool()

    async def call() -> None:
        await pool.request("GET", HOST, port, "/", [], b"")

    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            inner.start_soon(call)
            await got_request.wait()
            inner.cancel_scope.cancel()
        with trio.fail_after(1):
            await gone.wait()
    assert pool.open_connections == 0


async def test_abandoned_response_cancels_the_engine(
    start_server: StartServer, make_pool: MakePool
) -> None:
    stopped = trio.Event()

    async def handler(request: Request) -> Response:
        async def tokens() -> AsyncIterator[bytes]:
            try:
                yield b"token "
                await trio.sleep_forever()  # generating, until the client goes
            finally:
                stopped.set()

        return Response(200, [], tokens())

    _, port = await start_server(handler)
    pool = make_pool()
    with trio.fail_after(5):
        response = await pool.request("POST", HOST, port, "/", [], b"{}")
        assert await response.body_iter.__anext__() == b"token "
        await response.aclose()
        assert pool.open_connections == 0
        await stopped.wait()  # the server noticed the close and cancelled the handler


async def test_idle_connections_bounded_and_closed(
    start_server: StartServer, make_pool: MakePool
) -> None:
    async def handler(request: Request) -> Response:
        await trio.sleep(0.02)
        return Response(200, [], b"ok")

    server, port = await start_server(handler)
    pool = make_pool(max_idle_per_host=4)

    async def one() -> None:
        response = await pool.request("GET", HOST, port, "/", [], b"")
        assert await response.read() == b"ok"

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(one)
        assert pool.connections_opened == 20
        assert pool.idle_count(HOST, port) == 4
        assert pool.open_connections == 4
        await eventually(lambda: server.open_connections == 4)
        await pool.aclose()
        assert pool.open_connections == 0
        assert pool.idle_count(HOST, port) == 0
        await eventually(lambda: server.open_connections == 0)
        with pytest.raises(ConnectFailed, match="closed"):
            await pool.request("GET", HOST, port, "/", [], b"")


async def test_aclose_interrupts_a_request_in_flight(
    nursery: trio.Nursery, make_pool: MakePool
) -> None:
    got_request = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        await read_raw_until(stream, b"\r\n\r\n")
        got_request.set()
        await until_eof(stream)

    port = await start_raw(nursery, handler)
    pool = make_pool()
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await pool.request("GET", HOST, port, "/", [], b"")
        except UpstreamReset as exc:
            errors.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            inner.start_soon(call)
            await got_request.wait()
            await pool.aclose()
    assert len(errors) == 1
    assert pool.open_connections == 0

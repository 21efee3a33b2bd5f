"""What one client can make the server hold: bodies before they are admitted, bodies in
all, connections from one address; and what it can make the server log."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.http import HttpServer, Request, Response, ServerLimits, printable

from .helpers import RawClient, StartServer, echo, eventually


def error_body(status: int, message: str) -> tuple[str, bytes]:
    """OpenAI's shape, as the router's server answers its own errors."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return "application/json", json.dumps(body).encode()


def keyed(request: Request) -> object:
    """An admit that answers 401 from the head unless the request holds the key."""
    if request.path == "/open":
        return None
    if request.headers.get("authorization") != "Bearer k":
        return Response(401, [("content-type", "text/plain")], b"no key")
    request.principal = "the key's name"
    return "the key's name"


async def connect_from(source: str, port: int) -> RawClient:
    """A connection to the server on 127.0.0.1 from the loopback address ``source``."""
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return RawClient(trio.SocketStream(sock))


async def test_a_request_without_a_key_is_answered_from_its_head_and_its_body_never_kept(
    start_server: StartServer,
) -> None:
    handled: list[Request] = []

    async def handler(request: Request) -> Response:
        handled.append(request)
        return Response(200, body=request.body)

    limits = ServerLimits(max_body_bytes=16 * 1024 * 1024)
    server, port = await start_server(handler, limits=limits, admit=keyed)
    held: list[int] = []
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        size = 8 * 1024 * 1024
        # a body declared and partly sent, then the client stalls
        await c.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size)
        await c.send(b"x" * 300_000)
        reply = await c.reply()
        held.append(server.body_bytes)
        assert (reply.status, reply.body) == (401, b"no key")
        assert reply.header("connection") == "close"
        await c.closed()  # the server closed it: it never waits for the rest
        await c.aclose()
        # the same with Expect: no 100 Continue for a request that is refused
        c = await RawClient.connect(port)
        await c.send(
            b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        reply = await c.reply()
        assert reply.status == 401
        assert b"100 Continue" not in await c.closed()
        await c.aclose()
    assert handled == [] and held == [0]
    await eventually(lambda: server.open_connections == 0)
    assert server.body_bytes == 0


async def test_an_answer_from_the_head_keeps_a_bodiless_request_alive_and_admits_the_rest(
    start_server: StartServer,
) -> None:
    handled: list[object] = []

    async def handler(request: Request) -> Response:
        handled.append(request.admitted)
        return Response(200, body=request.body or b"none")

    server, port = await start_server(handler, admit=keyed)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        # pipelined: a refused GET, an admitted POST, an unchecked GET
        await c.send(
            b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
            b"Content-Length: 4\r\n\r\nbody"
            b"GET /open HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        refused = await c.reply()
        assert (refused.status, refused.body) == (401, b"no key")
        assert refused.header("connection") is None  # kept alive: the next ones follow
        assert (await c.reply()).body == b"body"
        assert (await c.reply()).body == b"none"
    assert handled == ["the key's name", None]
    assert server.body_bytes == 0


async def test_admit_that_raises_is_a_500(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(request: Request) -> object:
        raise RuntimeError("admit broke")

    _, port = await start_server(admit=broken)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await c.reply()).status == 500
    assert any("admit broke" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


async def test_bodies_held_by_all_connections_together_are_bounded(
    start_server: StartServer,
) -> None:
    release = trio.Event()
    entered = trio.Event()

    async def holder(request: Request) -> Response:
        if request.path == "/hold":
            entered.set()
            await release.wait()
        return Response(200, body=b"%d" % len(request.body))

    limits = ServerLimits(max_body_bytes=200_000, max_bodies_bytes=150_000)
    server, port = await start_server(holder, limits=limits, error_body=error_body)
    with trio.fail_after(10):
        async with httpx.AsyncClient(timeout=5) as client, trio.open_nursery() as nursery:
            held: list[httpx.Response] = []

            async def hold() -> None:
                held.append(
                    await client.post(f"http://127.0.0.1:{port}/hold", content=b"a" * 100_000)
                )

            nursery.start_soon(hold)
            await entered.wait()
            assert server.body_bytes == 100_000  # held while its handler runs
            # a second body that does not fit beside it: 503 in the server's error format
            c = await RawClient.connect(port)
            await c.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 60000\r\n\r\n")
            await c.send(b"b" * 60_000)
            over = await c.reply()
            assert over.status == 503
            assert json.loads(over.body)["error"]["type"] == "server_error"
            assert "too many request bodies" in json.loads(over.body)["error"]["message"]
            await c.closed()
            await c.aclose()
            assert server.body_bytes == 100_000  # the refused one's bytes went back
            # one that fits is served meanwhile
            small = await client.post(f"http://127.0.0.1:{port}/x", content=b"c" * 40_000)
            assert small.text == "40000"
            release.set()
        assert held[0].text == "100000"
        # a client that leaves halfway through its body gives its bytes back too
        c = await RawClient.connect(port)
        await c.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 120000\r\n\r\n")
        await c.send(b"d" * 100_000)
        await eventually(lambda: server.body_bytes == 100_000)
        await c.aclose()
        await eventually(lambda: server.open_connections == 0)
    assert server.body_bytes == 0


async def test_one_address_cannot_take_every_connection(start_server: StartServer) -> None:
    limits = ServerLimits(max_connections=6, max_connections_per_address=3)
    server, port = await start_server(limits=limits, error_body=error_body)
    with trio.fail_after(10):
        flood = [await connect_from("127.0.0.2", port) for _ in range(3)]
        await eventually(lambda: server.connections_from("127.0.0.2") == 3)
        # one more from that address: refused at once, in the server's error format
        extra = await connect_from("127.0.0.2", port)
        raw = await extra.closed()
        assert raw.startswith(b"HTTP/1.1 503 ")
        body = json.loads(raw.partition(b"\r\n\r\n")[2])
        assert body["error"]["message"].startswith("too many connections from your address")
        # every other address is served all the same
        for source in ("127.0.0.1", "127.0.0.3"):
            other = await connect_from(source, port)
            await other.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await other.reply()).status == 200
            await other.aclose()
        # a connection that closes makes room for its address again
        await flood.pop().aclose()
        await eventually(lambda: server.connections_from("127.0.0.2") == 2)
        again = await connect_from("127.0.0.2", port)
        await again.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await again.reply()).status == 200
        for c in [*flood, again]:
            await c.aclose()
    await eventually(lambda: server.open_connections == 0)
    assert server.connections_from("127.0.0.2") == 0


async def test_the_global_limit_answers_in_the_servers_error_format(
    start_server: StartServer,
) -> None:
    _, port = await start_server(
        limits=ServerLimits(max_connections=1), error_body=error_body, admit=keyed
    )
    with trio.fail_after(10):
        first = await RawClient.connect(port)
        await first.send(b"GET / HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n")
        assert (await first.reply()).status == 200
        raw = await (await RawClient.connect(port)).closed()
    assert raw.startswith(b"HTTP/1.1 503 ")
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("text", "field", "logged"),
    [
        ("/v1/chat/completions", True, "/v1/chat/completions"),
        ("a\nb\rc\x1b[2J", False, "a\\x0ab\\x0dc\\x1b[2J"),
        ("one two", False, "one two"),
        ("one two", True, "one\\x20two"),
        ("back\\slash", False, "back\\\\slash"),
        ("rtl\u202eelif\u2028\U000e0001", False, "rtl\\u202eelif\\u2028\\U000e0001"),
        ("caf\xe9 \u4e2d", False, "caf\xe9 \u4e2d"),
    ],
)
def test_printable_escapes_what_could_forge_or_hide_a_line(
    text: str, field: bool, logged: str
) -> None:
    assert printable(text, field=field) == logged


async def test_a_path_that_decodes_to_a_newline_logs_as_one_line(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(request: Request) -> Response:
        raise RuntimeError("boom")

    _, port = await start_server(handler)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        await c.send(b"GET /a%0aFORGED%0d%1b HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await c.reply()).status == 500
    [line] = [r.getMessage() for r in caplog.records if "handler failed" in r.getMessage()]
    assert line == "http: handler failed for GET /a\\x0aFORGED\\x0d\\x1b"


async def test_unix_socket_clients_have_no_address_to_cap(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server = HttpServer(echo, limits=ServerLimits(max_connections_per_address=1))
    path = str(tmp_path / "s")
    sock = trio.socket.socket(socket.AF_UNIX)
    await sock.bind(path)
    sock.listen()
    await nursery.start(server.serve, [trio.SocketListener(sock)])
    with trio.fail_after(10):
        clients = [RawClient(await trio.open_unix_socket(path)) for _ in range(3)]
        for c in clients:
            await c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await c.reply()).status == 200
        for c in clients:
            await c.aclose()


def by_key(request: Request) -> object:
    """An admit that takes any ``Bearer NAME`` as the key NAME (its principal)."""
    scheme, _, name = (request.headers.get("authorization") or "").partition(" ")
    if scheme == "Bearer" and name:
        request.principal = name
    return None


async def stall_body(source: str, port: int, key: str, declared: int, sent: int) -> RawClient:
    """A request whose body is declared ``declared`` bytes, of which ``sent`` are sent."""
    c = await connect_from(source, port)
    await c.send(
        b"POST /x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
        % (key.encode(), declared)
    )
    await c.send(b"s" * sent)
    return c


async def test_a_key_over_its_share_of_the_body_budget_gives_way_to_one_within_it(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One key fills the budget with bodies it stalls, from two addresses: a body from
    another key (within its share) takes room from the stalled ones, whose connections
    are answered 503; the first key alone, over its share, gets no more."""
    limits = ServerLimits(max_body_bytes=200_000, max_bodies_bytes=300_000)
    server, port = await start_server(limits=limits, admit=by_key, error_body=error_body)
    with trio.fail_after(10):
        stalled = [
            await stall_body(source, port, "greedy", 200_000, 150_000)
            for source in ("127.0.0.2", "127.0.0.3")
        ]
        await eventually(lambda: server.body_bytes == 300_000)
        # the same key, from a third address: over its share, refused
        more = await stall_body("127.0.0.4", port, "greedy", 20_000, 20_000)
        assert (await more.reply()).status == 503
        # another key: served, its body in room taken from the greedy key's
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.post(
                f"http://127.0.0.1:{port}/x",
                content=b"g" * 100_000,
                headers={"authorization": "Bearer good"},
            )
        assert r.status_code == 200 and len(r.content) == 100_000
        answers = []
        for c in stalled:
            with trio.move_on_after(0.5):
                answers.append((await c.reply()).status)
        assert answers == [503]  # the one dropped; the other still holds its body
        for c in [*stalled, more]:
            await c.aclose()
        await eventually(lambda: server.open_connections == 0)
    assert server.body_bytes == 0
    logged = [r.getMessage() for r in caplog.records]
    assert any("dropped a request body still arriving from 127.0.0." in m for m in logged)
    assert any("(key greedy)" in m and "is full" in m for m in logged)


async def test_a_stalled_body_is_cut_by_the_minimum_rate(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A body that stops arriving is answered 408 once a window after the first brings
    less than the floor; one that keeps arriving at the floor or above is served."""
    limits = ServerLimits(min_body_rate=2_000, body_rate_window_s=0.3, body_timeout_s=10)
    server, port = await start_server(limits=limits)
    with trio.fail_after(10):
        c = await RawClient.connect(port)
        start = trio.current_time()
        await c.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n")
        await c.send(b"x" * 50_000)  # then nothing
        reply = await c.reply()
        took = trio.current_time() - start
        assert reply.status == 408
        assert b"arrived too slowly" in reply.body
        assert 0.5 < took < 2.0, took  # the grace, then one window with nothing
        await c.aclose()
        # a trickle above the floor: 1,500 bytes every 0.1 s
        c = await RawClient.connect(port)
        await c.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 30000\r\n\r\n")
        for _ in range(20):
            await c.send(b"y" * 1_500)
            await trio.sleep(0.1)
        reply = await c.reply()
        assert (reply.status, len(reply.body)) == (200, 30_000)
        await c.aclose()
    await eventually(lambda: server.open_connections == 0)
    assert server.body_bytes == 0
    assert any("under the floor of 2000 bytes/s" in r.getMessage() for r in caplog.records)


async def test_idle_connections_that_proved_nobody_make_room_for_new_ones(
    start_server: StartServer,
) -> None:
    """At the limit, idle connections from many addresses that proved nobody do not shut
    a new client out: the oldest of them is closed for it; one that proved someone stays."""
    limits = ServerLimits(max_connections=6, max_connections_per_address=6)
    server, port = await start_server(limits=limits, admit=keyed)
    with trio.fail_after(10):
        keeper = await RawClient.connect(port)
        await keeper.send(b"GET /x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n")
        assert (await keeper.reply()).status == 200
        idle = [await connect_from(f"127.0.0.{2 + i % 3}", port) for i in range(5)]
        await eventually(lambda: server.open_connections == 6)
        newcomers = []
        for _ in range(3):  # each new client (kept connected) closes the oldest idle one
            c = await connect_from("127.0.0.9", port)
            await c.send(b"GET /x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n")
            assert (await c.reply()).status == 200
            newcomers.append(c)
        for c in idle[:3]:
            assert await c.closed() == b""  # closed quietly, oldest first
        assert server.open_connections == 6
        # the ones that proved someone are still served on their connections
        for c in [keeper, *newcomers]:
            await c.send(b"GET /x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n")
            assert (await c.reply()).status == 200
        for c in [keeper, *newcomers, *idle]:
            await c.aclose()
    await eventually(lambda: server.open_connections == 0)


async def test_the_reserved_connections_are_for_requests_with_a_key(
    start_server: StartServer,
) -> None:
    """Past max_connections - reserved_connections connections that proved nobody, a
    request without a key takes the place of an idle such connection, or, with none
    idle, is answered 503 and closed; a request with a key is served."""
    release = trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/open":
            await release.wait()
        return Response(200, body=b"ok")

    limits = ServerLimits(max_connections=5, reserved_connections=3)
    server, port = await start_server(handler, limits=limits, admit=keyed, error_body=error_body)
    with trio.fail_after(10):
        busy = []
        for _ in range(2):  # two requests without a key, held by the handler
            c = await RawClient.connect(port)
            await c.send(b"GET /open HTTP/1.1\r\nHost: t\r\n\r\n")
            busy.append(c)
        await eventually(lambda: server.in_flight == 2)
        extra = await RawClient.connect(port)
        await extra.send(b"GET /open HTTP/1.1\r\nHost: t\r\n\r\n")
        refused = await extra.reply()
        assert refused.status == 503
        assert "last connections for requests with credentials" in refused.body.decode()
        await extra.closed()
        await extra.aclose()
        keyed_client = await RawClient.connect(port)
        await keyed_client.send(b"GET /x HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n")
        assert (await keyed_client.reply()).status == 200
        # once the two are idle (kept alive), a request without a key takes the place
        # of the older one
        release.set()
        for c in busy:
            assert (await c.reply()).status == 200
        late = await RawClient.connect(port)
        await late.send(b"GET /open HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await late.reply()).status == 200
        assert await busy[0].closed() == b""
        for c in [*busy, keyed_client, late]:
            await c.aclose()
    await eventually(lambda: server.open_connections == 0)

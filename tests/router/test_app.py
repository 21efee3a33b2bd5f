"""The router's HTTP side in process: a real router server, real HTTP engines on loopback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import msgspec
import openai
import pytest
import trio

from llmgw.engines.base import LoadSignals
from llmgw.http import HttpServer, Request, Response
from llmgw.router.app import RouterApp, error_body
from llmgw.router.breaker import BreakerState
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelLoad, ModelRouting, Route, Snapshot

KEY = "llmgw-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@attrs.define
class Engine:
    """A small OpenAI-shaped engine: counts requests, streams slowly if asked."""

    name: str
    status: int = 200
    chunk_delay: float = 0.0
    chunks: int = 3
    reply_delay: float = 0.0  # before a whole (non-streamed) reply
    first_delay: float = 0.0  # before a stream's first event
    tail_delay: float = 0.0  # after a stream's last event, before its body ends
    fail_after: int | None = None  # a stream breaks (the engine dies) after this many tokens
    received: int = 0
    abandoned: int = 0  # requests whose connection closed before the reply was done
    port: int = 0

    async def __call__(self, request: Request) -> Response:
        self.received += 1
        body = msgspec.json.decode(request.body) if request.body else {}
        if self.reply_delay and not body.get("stream"):
            try:
                await trio.sleep(self.reply_delay)
            except trio.Cancelled:  # our server cancels a handler whose client left
                self.abandoned += 1
                raise
        if self.status != 200:
            return Response(
                self.status, [("content-type", "application/json")], b'{"error":{"message":"no"}}'
            )
        if body.get("stream"):
            return Response(200, [("content-type", "text/event-stream")], self._stream())
        reply = {
            "id": self.name,
            "choices": [{"message": {"content": self.name}}],
            "usage": {"completion_tokens": 3},
        }
        return Response(200, [("content-type", "application/json")], msgspec.json.encode(reply))

    async def _stream(self) -> AsyncIterator[bytes]:
        done = False
        try:
            await trio.sleep(self.first_delay)  # reading the prompt: the head is out
            yield f'data: {{"id":"{self.name}","delta":{{"role":"assistant","content":""}}}}\n\n'.encode()
            for i in range(self.chunks):
                await trio.sleep(self.chunk_delay)
                if i == self.fail_after:
                    raise RuntimeError("the engine died")  # the server cuts the connection
                yield f'data: {{"id":"{self.name}","n":{i},"delta":{{"content":"t"}}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
            await trio.sleep(self.tail_delay)
            done = True
        finally:
            self.abandoned += not done


async def serve(nursery: trio.Nursery, handler: object) -> int:
    listeners = await nursery.start(
        HttpServer(handler, error_body=error_body).serve_tcp,  # type: ignore[arg-type]
        "127.0.0.1",
        0,
    )
    return int(listeners[0].socket.getsockname()[1])


def snapshot(routes: list[Route], **routing: Any) -> Snapshot:
    return Snapshot(version=str(id(routes)), models={"m": ModelRouting(**routing)}, routes=routes)


@attrs.define
class Rig:
    table: RoutingTable
    app: RouterApp
    base: str
    engines: dict[str, Engine]

    def routes(self, **state: tuple[bool, bool]) -> list[Route]:
        out = []
        for name, engine in self.engines.items():
            ready, draining = state.get(name, (True, False))
            out.append(
                Route(
                    key=name,
                    model="m",
                    url=f"http://127.0.0.1:{engine.port}",
                    ready=ready,
                    draining=draining,
                )
            )
        return out


@pytest.fixture
async def rig(nursery: trio.Nursery) -> Rig:
    engines = {"a": Engine("a"), "b": Engine("b")}
    for e in engines.values():
        e.port = await serve(nursery, e)
    table = RoutingTable()
    app = RouterApp(table, KeyRing([ApiKey("t", hash_key(KEY))]))
    port = await serve(nursery, app)
    r = Rig(table, app, f"http://127.0.0.1:{port}/v1", engines)
    table.apply(snapshot(r.routes()))
    return r


def chat(stream: bool = False) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def test_a_draining_replica_takes_no_new_request_and_finishes_what_it_has(rig: Rig) -> None:
    a, b = rig.engines["a"], rig.engines["b"]
    a.chunk_delay, a.chunks = 0.05, 10
    rig.table.apply(snapshot(rig.routes(b=(False, False))))  # only a is Ready
    async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def long_stream() -> None:
            async with client.stream(
                "POST", rig.base + "/chat/completions", json=chat(True), headers=AUTH
            ) as r:
                got.extend([c async for c in r.aiter_bytes()])

        nursery.start_soon(long_stream)
        with trio.fail_after(5):
            while a.received == 0:
                await trio.sleep(0.01)
        rig.table.apply(snapshot(rig.routes(a=(True, True))))  # a drains; b is Ready
        # b busier on paper: only the draining rule keeps the next requests off a
        [b_ep] = [e for e in rig.table.endpoints["m"] if e.key == "b"]
        b_ep.in_flight = 100
        for _ in range(5):
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
            assert r.json()["id"] == "b"
    assert (a.received, b.received) == (1, 5)
    assert b"".join(got).endswith(b"data: [DONE]\n\n")  # the in-flight stream completed


async def test_a_connect_error_is_retried_on_another_replica(rig: Rig) -> None:
    dead = Route(key="dead", model="m", url="http://127.0.0.1:1")  # nothing listens
    rig.table.apply(snapshot([dead, *rig.routes(b=(False, False))]))
    a = next(e for e in rig.table.endpoints["m"] if e.key == "a")
    a.in_flight = 100  # busier on paper: "dead" is every request's first choice
    async with httpx.AsyncClient(timeout=10) as client:
        # three requests: within the retry budget's floor however often "dead" is picked
        # (a fourth retry inside the window would be refused, by design)
        for _ in range(3):
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
            assert r.status_code == 200
            assert r.json()["id"] == "a"
    assert rig.engines["a"].received == 3
    assert rig.app.metrics.retries.labels("m")._value.get() == 3  # each one retried once


def requests(rig: Rig, replica: str, status: str) -> float:
    return float(rig.app.metrics.requests.labels("m", replica, status, "t")._value.get())


def upstream_errors(rig: Rig, replica: str, kind: str) -> float:
    return float(rig.app.metrics.upstream_errors.labels("m", replica, kind)._value.get())


async def test_a_503_is_retried_and_counts_only_when_another_replica_answers(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = rig.engines["a"], rig.engines["b"]
    a.status = 503
    [a_ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
    [b_ep] = [e for e in rig.table.endpoints["m"] if e.key == "b"]
    b_ep.in_flight = 100  # busier on paper: "a" is the first choice
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == "b"
        assert (a.received, b.received) == (1, 1)
        assert rig.app.metrics.retries.labels("m")._value.get() == 1
        assert upstream_errors(rig, "a", "status_503") == 1
        assert requests(rig, "b", "200") == 1
        # b answered what a could not: a's 503 was a's
        assert (a_ep.breaker.consecutive_faults, b_ep.breaker.consecutive_faults) == (1, 0)

        b.status = 503
        with caplog.at_level(logging.WARNING, logger="llmgw.router"):
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
    # the same failure on both: the request's own (poison), counted against neither,
    # and answered with the last failure, as a 502
    assert r.status_code == 502
    assert "failed the same way on two replicas" in r.json()["error"]["message"]
    assert "answered 503" in r.json()["error"]["message"]
    assert (a.received, b.received) == (2, 2)
    assert requests(rig, "b", "502") == 1
    assert (a_ep.breaker.consecutive_faults, b_ep.breaker.consecutive_faults) == (1, 0)
    assert "failed the same way on replicas a and b" in caplog.text


async def test_a_503_on_the_only_replica_left_counts_against_it(rig: Rig) -> None:
    rig.engines["a"].status = 503
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    [a_ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
    assert r.status_code == 502  # nowhere to check it: the replica's
    assert a_ep.breaker.consecutive_faults == 1


@pytest.mark.parametrize("status", [429, 500, 507])
async def test_an_engines_own_error_is_relayed_not_retried_and_never_opens_the_breaker(
    rig: Rig, status: int
) -> None:
    # llama.cpp answers 500 to an image part a text model cannot read: a client
    # sending those must not take the model's only replica out for everybody
    a, b = rig.engines["a"], rig.engines["b"]
    a.status = status
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    [a_ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(12):  # more than the breaker's threshold
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
            assert r.status_code == status
            assert r.json() == {"error": {"message": "no"}}  # the engine's own answer
        a.status = 200
        r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert r.status_code == 200  # the good client is served
    assert (a.received, b.received) == (13, 0)
    assert a_ep.breaker.state is BreakerState.CLOSED
    assert a_ep.breaker.consecutive_faults == 0
    assert rig.app.metrics.retries.labels("m")._value.get() == 0
    assert requests(rig, "a", str(status)) == 12


async def test_client_errors_never_open_the_breaker(rig: Rig) -> None:
    rig.engines["a"].status = 400
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(12):
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
            assert r.status_code == 400  # relayed as the engine said it
    assert rig.table.endpoints["m"][0].breaker.state is BreakerState.CLOSED


async def test_every_breaker_open_is_panic_not_a_503_and_is_logged_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    now = trio.current_time()
    for ep in rig.table.endpoints["m"]:
        for _ in range(ep.breaker.failure_threshold):
            ep.breaker.on_upstream_fault(now)
        assert ep.breaker.state is BreakerState.OPEN
    metrics = rig.app.metrics
    async with httpx.AsyncClient(timeout=10) as client:
        with caplog.at_level(logging.WARNING, logger="llmgw.router"):
            for _ in range(3):
                r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
                assert r.status_code == 200  # sent to the least bad replica anyway
            assert metrics.panic_routed.labels("m")._value.get() == 3
            assert metrics.panic.labels("m")._value.get() == 1
            # a breaker closes (its cool-down over, its probe a success): panic is over
            [a_ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
            later = now + a_ep.breaker.cooldown_s + 1
            assert a_ep.breaker.allows(later)
            a_ep.breaker.on_start(later)
            a_ep.breaker.on_success(later)
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
            assert r.status_code == 200 and r.json()["id"] == "a"
    assert metrics.panic_routed.labels("m")._value.get() == 3
    assert metrics.panic.labels("m")._value.get() == 0
    entered = [r for r in caplog.records if "panic: every replica of model m" in r.message]
    left = [r for r in caplog.records if "left panic" in r.message]
    assert (len(entered), len(left)) == (1, 1)


async def test_saturated_replicas_shed_with_retry_after_or_queue_for_a_bounded_time(
    rig: Rig,
) -> None:
    rig.table.apply(snapshot(rig.routes(), target_waiting=2))
    now = trio.current_time()
    for ep in rig.table.endpoints["m"]:
        ep.load, ep.load_at = LoadSignals(waiting=9, running=4), now + 3600  # fresh, and busy
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert "busy" in r.json()["error"]["message"]

        rig.app.proxy.queue_timeout_s = 2.0

        async def room_frees_up() -> None:
            await trio.sleep(0.3)
            for ep in rig.table.endpoints["m"]:
                ep.load = LoadSignals(waiting=0, running=0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(room_frees_up)
            start = trio.current_time()
            r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert r.status_code == 200
        assert 0.25 < trio.current_time() - start < 2.0  # it waited, and not for ever


@pytest.mark.parametrize("stream", [False, True], ids=["waiting", "streaming"])
async def test_a_client_that_leaves_closes_the_upstream_and_frees_the_replica(
    rig: Rig, stream: bool
) -> None:
    """Waiting for a whole reply, nothing is written to the client, so only the
    watch on its socket can notice it leave; streaming, the relay notices too.
    Either way the engine's connection closes at once (a vLLM engine aborts the
    request then) and the replica's in-flight count goes back to 0."""
    a = rig.engines["a"]
    a.reply_delay, a.chunk_delay, a.chunks = 30.0, 0.05, 600
    rig.table.apply(snapshot(rig.routes(b=(False, False))))  # only a is Ready
    [ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
    with trio.fail_after(10):
        async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:

            async def ask() -> None:
                async with client.stream(
                    "POST", rig.base + "/chat/completions", json=chat(stream), headers=AUTH
                ) as r:
                    async for _ in r.aiter_bytes():
                        pass

            nursery.start_soon(ask)
            while a.received == 0 or (stream and ep.in_flight == 0):
                await trio.sleep(0.01)
            await trio.sleep(0.2)  # mid-wait, or a few chunks into the stream
            assert ep.in_flight == 1
            nursery.cancel_scope.cancel()  # the client goes away
    with trio.move_on_after(2):
        while a.abandoned == 0 or ep.in_flight != 0:
            await trio.sleep(0.01)
    assert (a.received, a.abandoned, ep.in_flight) == (1, 1, 0)
    # counted as the client closing the request, or as the 200 it had begun to get
    status = "200" if stream else "499"
    replica = "a" if stream else "-"
    assert rig.app.metrics.requests.labels("m", replica, status, "t")._value.get() == 1


async def test_a_streams_first_token_and_token_count_are_measured(rig: Rig) -> None:
    """An engine sends its head at once and its first token after the prompt:
    time to first token is the first event, not the head; a stream without a
    usage figure counts its events that carry text."""
    a = rig.engines["a"]
    a.first_delay, a.chunks = 0.3, 7
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", rig.base + "/chat/completions", json=chat(True), headers=AUTH) as r,
    ):
        body = b"".join([c async for c in r.aiter_bytes()])
    assert body.endswith(b"data: [DONE]\n\n")
    m = rig.app.metrics
    ttfb = m.ttfb.labels("m")._sum.get()
    ttft = m.ttft.labels("m")._sum.get()
    assert ttfb < 0.3 <= ttft, (ttfb, ttft)
    assert m.tokens.labels("m")._sum.get() == 7  # not the role event, nor [DONE]


async def test_a_streams_last_event_frees_its_replica_before_the_client_reads_it(
    rig: Rig,
) -> None:
    """A client may start its next request the moment it reads ``[DONE]``; by then the
    replica must no longer count this one, or the balancer sees one more in flight
    than there is (and, with every slot taken, sheds the next request). The engine
    here holds its body open a while after its last event."""
    a = rig.engines["a"]
    a.tail_delay = 5.0
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    [ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
    with trio.fail_after(3):
        async with (
            httpx.AsyncClient(timeout=10) as client,
            client.stream(
                "POST", rig.base + "/chat/completions", json=chat(True), headers=AUTH
            ) as r,
        ):
            seen = b""
            async for chunk in r.aiter_bytes():
                seen += chunk
                if seen.endswith(b"data: [DONE]\n\n"):
                    assert ep.in_flight == 0
                    assert ep.breaker.consecutive_faults == 0
                    break
    assert seen.endswith(b"data: [DONE]\n\n")


async def test_a_stream_whose_replica_dies_mid_way_ends_with_an_error_event(rig: Rig) -> None:
    """The engine dies after three tokens: the client gets those three, then an error
    event in OpenAI's format (the openai client raises it as an APIError with its words),
    and a whole HTTP response, never a silent cut; the replica's breaker counts it."""
    a = rig.engines["a"]
    a.chunks, a.fail_after = 10, 3
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    [ep] = [e for e in rig.table.endpoints["m"] if e.key == "a"]
    client = openai.AsyncOpenAI(base_url=rig.base, api_key=KEY, max_retries=0, timeout=10)

    async def read() -> None:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for _ in stream:
            pass

    with trio.fail_after(10), pytest.raises(openai.APIError) as raised:
        await read()
    assert "the reply was cut short: replica a failed mid-stream" in raised.value.message
    # the bytes: what was sent stands, then the error event, in a whole response (a cut
    # connection would raise httpx.RemoteProtocolError here)
    async with (
        httpx.AsyncClient(timeout=10) as raw,
        raw.stream("POST", rig.base + "/chat/completions", json=chat(True), headers=AUTH) as r,
    ):
        events = [line async for line in r.aiter_lines() if line]
    assert [e.count('"content":"t"') for e in events[1:4]] == [1, 1, 1]
    assert events[4].startswith('data: {"error":{"message":"the reply was cut short')
    assert len(events) == 5
    assert ep.in_flight == 0 and ep.breaker.consecutive_faults == 2


async def test_the_access_log_has_a_line_per_request_and_no_key(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.access")
    rig.app.access_log = True
    a = rig.engines["a"]
    a.chunks = 5
    rig.table.apply(snapshot(rig.routes(b=(False, False))))
    async with httpx.AsyncClient(timeout=10) as client:
        ok = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert ok.status_code == 200
        bad = {"authorization": "Bearer llmgw-not-a-key"}
        assert (
            await client.post(rig.base + "/chat/completions", json=chat(), headers=bad)
        ).status_code == 401
        async with client.stream(
            "POST", rig.base + "/chat/completions", json=chat(True), headers=AUTH
        ) as r:
            assert b"[DONE]" in b"".join([c async for c in r.aiter_bytes()])
        a.reply_delay = 30.0
        with trio.move_on_after(0.3):  # the client gives up waiting
            await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        with trio.fail_after(5):
            while len([r for r in caplog.records if r.name == "llmgw.router.access"]) < 4:
                await trio.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.router.access"]
    assert len(lines) == 4, lines
    whole, refused, streamed, left = lines
    assert "POST /v1/chat/completions status=200 key=t tenant=- model=m replica=a" in whole
    assert "tokens=3 cached=- end=ok" in whole and "ttft=- " in whole
    assert "status=401 key=- tenant=- model=- replica=-" in refused
    assert "status=200 key=t tenant=- model=m replica=a" in streamed
    assert "tokens=5 cached=- end=ok" in streamed and "ttft=-" not in streamed
    assert "status=499 key=t tenant=- model=m" in left and "end=client left" in left
    assert not any(KEY in line or "llmgw-not-a-key" in line for line in lines)


async def test_a_model_can_be_retrieved_by_its_id_slash_and_all(rig: Rig) -> None:
    rig.table.apply(
        Snapshot(
            version="v",
            models={"org/m": ModelRouting()},
            routes=[Route(key="a", model="org/m", url=f"http://127.0.0.1:{rig.engines['a'].port}")],
        )
    )
    async with httpx.AsyncClient(timeout=10) as client:
        for path in ("/models/org/m", "/models/org%2Fm"):
            r = await client.get(rig.base + path, headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json() == {"id": "org/m", "object": "model", "created": 0, "owned_by": "llmgw"}
        r = await client.get(rig.base + "/models/nope", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (await client.get(rig.base + "/models/org/m")).status_code == 401


async def test_a_ranged_model_with_no_replica_holds_requests_within_a_bound(rig: Rig) -> None:
    """Held while none is Ready, sent the moment one is; past ``max_held`` or the hold's
    time: a 503 that says how long a start takes, never a 429."""
    told: list[str] = []
    holds = rig.app.proxy.holds
    holds.notify, holds.hold_s, holds.max_held = told.append, 5.0, 2
    rig.table.apply(snapshot([], scales=True, start_s=12.0))  # scaled to zero
    assert holds.loads() == {}
    async with httpx.AsyncClient(timeout=10) as client:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(
                await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
            )

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(ask)
            with trio.fail_after(5):
                while not (len(answers) == 1 and holds.held("m") == 2):
                    await trio.sleep(0.01)
            # the third found the hold full: refused at once, the other two wait
            assert answers[0].status_code == 503, answers[0].text
            assert answers[0].json()["error"]["code"] == "starting"
            assert "2 requests are already held for m" in answers[0].json()["error"]["message"]
            assert answers[0].headers["retry-after"] == "12"
            assert told == ["m", "m"]  # each held one told the control plane once
            assert holds.loads() == {"m": ModelLoad(waiting=2, arrived=3)}
            rig.table.apply(snapshot(rig.routes(), scales=True, start_s=12.0))  # one is Ready
        assert [r.status_code for r in answers[1:]] == [200, 200]
        assert holds.held("m") == 0 and holds.loads() == {}

        holds.hold_s = 0.5
        rig.table.apply(snapshot([], scales=True, start_s=0.0))
        began = trio.current_time()
        r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert r.status_code == 503 and 0.45 < trio.current_time() - began < 3
        assert (
            "held 0.5 s and no replica of m started; try again soon" in r.json()["error"]["message"]
        ), r.text
        assert r.headers["retry-after"] == "1"

        rig.table.apply(snapshot([]))  # a model that does not scale: no hold
        r = await client.post(rig.base + "/chat/completions", json=chat(), headers=AUTH)
        assert r.status_code == 503 and "no replica of m can take requests" in r.text

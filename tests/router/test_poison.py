"""A request that crashes engines kills two at most (``llmgw.router.poison``): through
``llmgw server`` and real llama-servers that really die of it, and the rule itself."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.engines.base import LoadSignals
from llmgw.router import guards
from llmgw.router.poison import Crashes, Remembered
from llmgw.router.table import RoutingTable
from tests.conftest import Pki
from tests.engines.test_tinymodel import llama_server
from tests.realparts import needs_server
from tests.router.gateway import gateway
from tests.router.test_guards import HI, deep_grammar
from tests.router.test_resume import LONG, LONGER, LONGER_CONTEXT, MESSAGES, front, llama_routes
from tools.support.llama import decoded
from tools.support.tinymodel import write_model

# the guard off: what llama-server dies of reaches it (no other known input does)
UNGUARDED = "max_grammar_depth = 0\nmax_grammar_kb = 0\n"


@needs_server
async def test_a_request_that_crashes_engines_kills_two_and_good_clients_go_on(
    tmp_path: Path, pki: Pki
) -> None:
    """Three llama-servers, the grammar guard off, two good clients asking all along
    (the real openai client, no retries). One request whose grammar kills
    llama-server, sent by the openai client as it comes (two retries): the first
    engine dies, the request is moved, the second dies, and it is answered 400 and
    sent to no third, which the client does not retry. The same request again is
    refused at once. The good clients fail nothing. Without the rule: the client
    retried its 502 and all three engines died."""
    model = write_model(tmp_path / "tiny.gguf", ends_after=None)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, name="a", procs=procs, parallel=2) as a,
        llama_server(model, tmp_path, name="b", procs=procs, parallel=2) as b,
        llama_server(model, tmp_path, name="c", procs=procs, parallel=2) as c,
        gateway(tmp_path, pki, [a, b, c], router_extra=UNGUARDED) as gw,
    ):
        good = openai.AsyncOpenAI(base_url=gw.base, api_key=gw.key, max_retries=0)
        client = openai.AsyncOpenAI(base_url=gw.base, api_key=gw.key)  # retries, as shipped
        asked: list[str] = []
        failed: list[str] = []
        stop = trio.Event()

        async def ask(stream: bool) -> None:
            while not stop.is_set():
                try:
                    if stream:
                        chunks = await good.chat.completions.create(
                            model="m", messages=HI, max_tokens=16, stream=True
                        )
                        text = "".join([x.choices[0].delta.content or "" async for x in chunks])
                    else:
                        reply = await good.chat.completions.create(
                            model="m", messages=HI, max_tokens=8
                        )
                        text = reply.choices[0].message.content or ""
                    asked.append(text)
                    assert text, "an empty reply"
                except (openai.APIError, AssertionError) as exc:
                    failed.append(f"{type(exc).__name__}: {exc}")
                await trio.sleep(0.01)

        poison = {"grammar": deep_grammar(25_000)}
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, False)
                nursery.start_soon(ask, True)
                while len(asked) < 6:
                    await trio.sleep(0.05)
                with pytest.raises(openai.BadRequestError) as first:
                    await client.chat.completions.create(
                        model="m", messages=HI, max_tokens=4, extra_body=poison
                    )
                with pytest.raises(openai.BadRequestError) as again:
                    await client.chat.completions.create(
                        model="m", messages=HI, max_tokens=4, extra_body=poison
                    )
                before = len(asked)
                while len(asked) < before + 10:  # the model goes on serving
                    await trio.sleep(0.05)
                stop.set()
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert dead == [-signal.SIGSEGV] * 2, [p.returncode for p in procs]
        assert failed == [], failed
        assert "is taken for what crashed them and is not sent to another" in str(first.value)
        assert first.value.code == again.value.code == "request_crashed_engines"
        assert "crashed two engines of m" in str(again.value)
        assert await gw.sample("llmgw_router_poisoned_total", how="crashed") == 1
        assert await gw.sample("llmgw_router_poisoned_total", how="remembered") == 1
    lines = [x for x in gw.server.log().splitlines() if "as their engines died" in x]
    assert len(lines) == 1, lines
    assert "Traceback" not in gw.server.log()


@needs_server
async def test_a_good_request_beside_the_poison_one_is_kept_apart_from_it(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The race CI met: a good request waiting on the first engine as the poison one
    killed it is as suspect as the poison; sent to the same replica next, it was in
    flight at the second death too and was found poison itself (a good client's
    request refused). Here the replicas' load makes both go to B without the rule
    (A weighs most and is idle, B's engine reads a little work, C more on a tenth of
    the weight): kept apart, the good one goes to C and is answered whole, and the
    poison one alone is refused."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=LONGER_CONTEXT)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, name="a", procs=procs, parallel=2, context=8192) as a,
        llama_server(model, tmp_path, name="b", procs=procs, parallel=2, context=8192) as b,
        llama_server(model, tmp_path, name="c", procs=procs, parallel=2, context=8192) as c,
    ):
        table = RoutingTable()  # not run: no scrape overwrites the readings set below
        snapshot = llama_routes(("a", a), ("b", b), ("c", c))
        for route, weight in zip(snapshot.routes, (10.0, 10.0, 1.0), strict=True):
            route.weight, route.affinity = weight, "off"  # by load alone
        table.apply(snapshot)
        app, client = await front(nursery, table, limits=guards.OFF)
        ep = {e.key: e for e in table.endpoints["m"]}
        now = trio.current_time()
        for key, running in (("b", 2.0), ("c", 1.0)):  # scores: a 0, b 0.2, c 1
            ep[key].load, ep[key].load_at = LoadSignals(running=running, waiting=0.0), now
        good: list[str] = []

        async def ask_long() -> None:
            reply = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=LONG, temperature=0
            )
            assert reply.usage is not None
            good.append(f"{reply.choices[0].finish_reason} {reply.usage.completion_tokens}")

        with trio.fail_after(60):
            async with trio.open_nursery() as inner:
                inner.start_soon(ask_long)
                while ep["a"].in_flight < 1:  # the good one is on a, at work
                    await trio.sleep(0.01)
                await trio.sleep(0.2)
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m",
                        messages=HI,
                        max_tokens=4,
                        extra_body={"grammar": deep_grammar(25_000)},
                    )
        assert "is taken for what crashed them" in str(refused.value)
        assert good == [f"length {LONG}"], good
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert dead == [-signal.SIGSEGV] * 2, [p.returncode for p in procs]
        assert app.metrics.poisoned.labels("m", "crashed")._value.get() == 1
        assert all(e.suspects == 0 and e.in_flight == 0 for e in ep.values()), ep


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("deaths", "poison"),
    [
        # (replica, answered, alone) at each death the request was in flight at
        ([("a", False, False), ("b", False, False)], [False, True]),  # crashed both
        ([("a", False, True), ("b", True, False)], [False, True]),
        ([("a", True, True), ("b", True, False)], [False, True]),  # alone: suspect
        # answered beside others: something else killed that engine
        ([("a", True, False), ("b", True, False)], [False, False]),
        ([("a", True, False), ("b", False, False), ("c", True, False)], [False, False, True]),
        ([("a", False, False), ("a", False, False)], [False, False]),  # one engine, twice
    ],
)
def test_suspect_at_one_death_poison_at_another(
    deaths: list[tuple[str, bool, bool]], poison: list[bool]
) -> None:
    crashes = Crashes()
    said = [crashes.died(r, answered=answered, alone=alone) for r, answered, alone in deaths]
    assert said == poison
    assert crashes.poison is poison[-1]


def test_bodies_are_remembered_for_a_while_and_so_many() -> None:
    memory = Remembered(ttl_s=10, most=2)
    assert not memory and memory.since(b"x", 0) is None
    memory.add(b"x", 1)
    assert memory and memory.since(b"x", 5) == 1 and memory.since(b"y", 5) is None
    assert memory.since(b"x", 11) is None and not memory  # expired, forgotten
    for i, body in enumerate((b"1", b"2", b"3")):
        memory.add(body, 20 + i)
    assert memory.since(b"1", 23) is None  # the oldest went first
    assert memory.since(b"2", 23) == 21 and memory.since(b"3", 23) == 22


@asynccontextmanager
async def three_engines(
    tmp_path: Path, procs: list[trio.Process]
) -> AsyncIterator[tuple[str, str, str]]:
    """llama-servers a, b and c (their processes in ``procs``, in that order) on a model
    that never ends an answer: their URLs."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=LONGER_CONTEXT)
    async with (
        llama_server(model, tmp_path, context=LONGER_CONTEXT, name="a", procs=procs) as url_a,
        llama_server(model, tmp_path, context=LONGER_CONTEXT, name="b", procs=procs) as url_b,
        llama_server(model, tmp_path, context=LONGER_CONTEXT, name="c", procs=procs) as url_c,
    ):
        yield url_a, url_b, url_c


async def fail_a_then_b(
    table: RoutingTable,
    urls: tuple[str, str, str],
    procs: list[trio.Process],
    begun: trio.Event,
    a_gets: int,
) -> None:
    """Once the stream has begun on a (routed alone): b is routed beside it and a is sent
    ``a_gets``; once b has carried the stream on for 10 tokens, c is routed too and b is
    killed."""
    url_a, url_b, url_c = urls
    await begun.wait()
    table.apply(llama_routes(("a", url_a), ("b", url_b)))  # b, the only other
    procs[0].send_signal(a_gets)
    async with httpx.AsyncClient(timeout=2) as http:
        while await decoded(http, url_b) < 10:  # b carries it on now
            await trio.sleep(0.01)
    table.apply(llama_routes(("a", url_a), ("b", url_b), ("c", url_c)))
    procs[1].send_signal(signal.SIGKILL)


@needs_server
async def test_a_stream_alone_on_two_engines_that_die_goes_to_no_third(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A stream alone on its engine when it dies (kill -9 mid-stream) is suspect and
    goes on from a second replica; that one dying under it too makes it poison: it
    ends with an error event that says so, and the third replica is never asked to
    carry it on. (Without the rule it was carried on by the third.)"""
    procs: list[trio.Process] = []
    async with three_engines(tmp_path, procs) as (url_a, url_b, url_c):
        table = RoutingTable(scrape_s=60)
        table.apply(llama_routes(("a", url_a)))  # the stream starts on a
        app, client = await front(nursery, table)
        text: list[str] = []
        begun = trio.Event()

        with trio.fail_after(60):
            nursery.start_soon(
                fail_a_then_b, table, (url_a, url_b, url_c), procs, begun, signal.SIGKILL
            )
            stream = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=LONGER, stream=True
            )
            with pytest.raises(openai.APIError) as info:  # noqa: PT012
                async for chunk in stream:
                    text += [c.delta.content or "" for c in chunk.choices]
                    begun.set()
        assert "was in flight on two replicas of m whose engines died" in str(info.value)
        assert [p.poll() for p in procs] == [-signal.SIGKILL, -signal.SIGKILL, None]
        assert "".join(text)
        async with httpx.AsyncClient(timeout=5) as http:
            metrics = (await http.get(url_c + "/metrics")).text
        assert "llamacpp:prompt_tokens_total 0" in metrics  # c was never asked
        m = app.metrics
        assert m.not_resumed.labels("m", "poison")._value.get() == 1
        assert m.poisoned.labels("m", "crashed")._value.get() == 1


@needs_server
async def test_a_stream_cut_from_a_stopped_engine_is_not_taken_for_its_death(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A stream alone on an engine that is stopped (SIGSTOP: found silent, its
    streams cut and carried on) was not in flight at a death: when the engine that
    carries it on is then killed, it goes on from a third and ends whole."""
    procs: list[trio.Process] = []
    async with three_engines(tmp_path, procs) as (url_a, url_b, url_c):
        table = RoutingTable(scrape_s=0.2, silent_after_s=1.0)
        table.apply(llama_routes(("a", url_a)))  # the stream starts on a
        await nursery.start(table.run)
        app, client = await front(nursery, table)
        begun = trio.Event()

        finishes = []
        try:
            with trio.fail_after(60):
                nursery.start_soon(
                    fail_a_then_b, table, (url_a, url_b, url_c), procs, begun, signal.SIGSTOP
                )
                stream = await client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=LONGER, stream=True
                )
                async for chunk in stream:
                    begun.set()
                    finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
        finally:
            procs[0].send_signal(signal.SIGCONT)
        assert finishes == ["length"]
        assert app.metrics.resumed.labels("m")._value.get() == 2
        assert app.metrics.poisoned.labels("m", "crashed")._value.get() == 0

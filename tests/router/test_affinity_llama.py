"""What a llama.cpp replica reused, read from every kind of reply the router relays: whole
and streamed, chats and completions (a real llama-server, the openai client), and a
stream whose last token and last event arrive in one read."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.engines.llamacpp import slots_usage
from llmgw.http import Request, Response
from llmgw.router.app import RouterApp
from llmgw.router.balancer import Endpoint
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.pace import ALPHA, PREFILL_TOKENS
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.engines.test_tinymodel import llama_server
from tests.realparts import needs_server
from tests.router.test_app import serve
from tools.support.slowmodel import write_slow_model
from tools.support.tinymodel import write_model

KEY = "llmgw-test-key"
CACHED = re.compile(r"cached=(\d+)/(\d+) end=ok")
ROUTE = re.compile(r" route=(\S+)")


async def front(
    nursery: trio.Nursery,
    url: str,
    engine: str = "llama.cpp",
    *,
    resume: bool = True,
    apps: list[RouterApp] | None = None,
) -> openai.AsyncOpenAI:
    """The router in front of ``url``; a stream is relayed as it comes, or (``resume``
    and a known ``engine``) event by event, to be carried on elsewhere if it breaks.
    The router is appended to ``apps``."""
    table = RoutingTable()
    route = Route(key="a", model="m", url=url, engine=engine)
    table.apply(Snapshot(version="1", models={"m": ModelRouting()}, routes=[route]))
    keys = KeyRing([ApiKey("t", hash_key(KEY))])
    app = RouterApp(table, keys, access_log=True, resume_streams=resume)
    if apps is not None:
        apps.append(app)
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{await serve(nursery, app)}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=30,
    )


@needs_server
@pytest.mark.parametrize("resume", [True, False], ids=["by-event", "as-it-comes"])
async def test_reuse_is_read_from_whole_and_streamed_chats_and_completions(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, resume: bool
) -> None:
    caplog.set_level(logging.INFO, "llmgw.router.access")
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=2048)
    async with llama_server(model, tmp_path, context=2048) as url:
        client = await front(nursery, url, resume=resume)
        prompt = "The harbor lantern burns all night. " * 20
        with trio.fail_after(30):
            for stream in (False, True, True):
                done = await client.completions.create(
                    model="m",
                    prompt=prompt,
                    max_tokens=4,
                    stream=stream,  # type: ignore[call-overload]
                )
                if stream:
                    _ = [c async for c in done]  # type: ignore[union-attr]
            messages = [{"role": "user", "content": prompt}]
            for stream in (False, True):
                done = await client.chat.completions.create(
                    model="m",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=4,
                    stream=stream,  # type: ignore[call-overload]
                )
                if stream:
                    _ = [c async for c in done]  # type: ignore[union-attr]
    said = [(int(a), int(b)) for a, b in CACHED.findall(caplog.text)]
    assert len(said) == 5, caplog.text
    assert said[0][0] == 0 and all(c > 0.9 * p for c, p in said[1:3]), said
    assert said[4][0] > 0.9 * said[4][1], said


@needs_server
@pytest.mark.parametrize("resume", [True, False], ids=["by-event", "as-it-comes"])
async def test_a_replicas_pace_is_learned_from_what_its_replies_say(
    tmp_path: Path, nursery: trio.Nursery, resume: bool
) -> None:
    """The router learns how fast a replica computes a prompt and frees a slot from the
    ``timings`` llama-server puts in each reply (which the client sees too), and shows
    it in ``llmgw_router_pace``: the moving averages of what the replies said."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=2048)
    apps: list[RouterApp] = []
    said: list[dict[str, float]] = []
    async with llama_server(model, tmp_path, context=2048) as url:
        client = await front(nursery, url, resume=resume, apps=apps)
        with trio.fail_after(60):
            for i in range(4):  # each computed whole: a new prompt each time
                words = " ".join(f"w{i}x{j}" for j in range(120))
                chunks = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"Prompt {i}: {words}"}],
                    max_tokens=4,
                    stream=True,
                )
                async for chunk in chunks:
                    if (timings := (chunk.model_extra or {}).get("timings")) is not None:
                        said.append(timings)
    assert len(said) == 4 and all(t["prompt_n"] >= PREFILL_TOKENS for t in said), said
    prefill = slot = 0.0
    for i, t in enumerate(said):  # the moving averages, as the pace keeps them
        new_prefill = t["prompt_ms"] / t["prompt_n"] / 1e3
        new_slot = (t["prompt_ms"] + t["predicted_ms"]) / 1e3
        prefill = new_prefill if i == 0 else prefill + ALPHA * (new_prefill - prefill)
        slot = new_slot if i == 0 else slot + ALPHA * (new_slot - slot)
    registry = apps[0].metrics.registry

    def pace(measure: str) -> float | None:
        labels = {"model": "m", "replica": "a", "measure": measure}
        return registry.get_sample_value("llmgw_router_pace", labels)

    assert pace("prefill_seconds_per_token") == pytest.approx(prefill, rel=1e-6)
    assert pace("slot_seconds") == pytest.approx(slot, rel=1e-6)
    per = pace("bytes_per_token")
    assert per is not None and 1.0 < per < 8.0, per


async def test_reuse_in_the_same_read_as_the_last_token_is_read(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy engine's last token, its last event (with ``timings``) and ``[DONE]`` can
    reach the router in one read."""
    caplog.set_level(logging.INFO, "llmgw.router.access")

    async def engine(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
            yield (
                b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
                b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
                b'"timings":{"cache_n":120,"prompt_n":8,"prompt_ms":1.0}}\n\n'
                b"data: [DONE]\n\n"
            )

        return Response(200, [("content-type", "text/event-stream")], body())

    # an engine the router does not know: its stream is relayed as it comes
    client = await front(nursery, f"http://127.0.0.1:{await serve(nursery, engine)}", engine="")
    with trio.fail_after(10):
        chunks = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in chunks]) == "ab"
    assert CACHED.findall(caplog.text) == [("120", "128")], caplog.text


async def ask(client: openai.AsyncOpenAI, system: str, question: str, max_tokens: int) -> None:
    """A user's question behind ``system``, streamed to its end."""
    chunks = await client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        max_tokens=max_tokens,
        stream=True,
    )
    _ = [c async for c in chunks]


async def whole(client: openai.AsyncOpenAI, system: str, question: str, max_tokens: int) -> None:
    """A user's question behind ``system``, answered whole (not streamed)."""
    await client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        max_tokens=max_tokens,
    )


async def two_users(
    client: openai.AsyncOpenAI, replica: Endpoint, system: str, *, max_tokens: int
) -> None:
    """Two users behind one system prompt, streamed: the second sent as soon as the
    first is in flight on ``replica`` (its only one)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as users:
            users.start_soon(ask, client, system, "Who keeps the lantern?", max_tokens)
            while not replica.in_flight:  # the first is on its way to the engine
                await trio.sleep(0.005)
            users.start_soon(ask, client, system, "When is it lit?", max_tokens)


@needs_server
async def test_a_second_request_of_a_prompt_in_its_prefill_waits_and_finds_it_cached(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """Two users behind one system prompt, the second arriving while the first's is
    still being computed: llama-server would give the second its other free slot and
    compute the whole prompt again there. The router holds it until the first ends
    (its slot is then idle, holding the prompt), and the engine says it reused it."""
    caplog.set_level(logging.INFO, "llmgw.router.access")
    model = write_slow_model(tmp_path / "slow.gguf", context_length=2048)
    apps: list[RouterApp] = []
    system = "The harbor lantern burns all night and the keeper writes it down. " * 18
    async with llama_server(model, tmp_path, context=4096, parallel=2) as url:
        client = await front(nursery, url, apps=apps)
        await two_users(client, apps[0].table.endpoints["m"][0], system, max_tokens=4)
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.router.access"]
    assert len(lines) == 2, lines
    first, second = lines  # each logged as it ends: the second ended last
    assert "waited=" not in first and "waited=" in second, lines
    # why each went there: the first to the prompt's rendezvous winner (a router not
    # known to be the only one), the second where its prompt is held
    assert ROUTE.findall(first) == ["first"] and ROUTE.findall(second) == ["held"], lines
    found = [CACHED.search(line) for line in lines]
    assert all(found), lines
    cached, prompt = (int(g) for g in found[1].groups())  # type: ignore[union-attr]
    assert cached >= prompt // 2, f"the second computed its prompt again: {second}"
    labels = {"model": "m", "replica": "a", "outcome": "freed"}
    assert apps[0].metrics.registry.get_sample_value("llmgw_router_prompt_waits_total", labels) == 1


SLOT = re.compile(r" slot=(\d+)")
LANTERN = "The harbor lantern burns all night and the keeper writes it down. " * 12


@contextlib.asynccontextmanager
async def two_slots(
    tmp_path: Path, nursery: trio.Nursery, *, only: bool
) -> AsyncIterator[tuple[openai.AsyncOpenAI, RouterApp, Endpoint]]:
    """A real llama-server of the slow model with two slots and no host cache, a
    router in front (the fleet's only one, or one of several), and its replica with
    the slots read as a scrape reads them."""
    model = write_slow_model(tmp_path / "slow.gguf", context_length=2048)
    apps: list[RouterApp] = []
    async with llama_server(
        model, tmp_path, context=4096, parallel=2, args=("--cache-ram", "0")
    ) as url:
        client = await front(nursery, url, apps=apps)
        table = apps[0].table
        table.only = only  # as ``RoutingTable`` judges it each scrape
        replica = table.endpoints["m"][0]
        async with httpx.AsyncClient() as http:
            replica.load = slots_usage((await http.get(f"{url}/slots")).content)
        yield client, apps[0], replica


async def sent(replica: Endpoint, n: int) -> None:
    """Until ``n`` requests are on their way to ``replica``'s engine."""
    while replica.in_flight < n:
        await trio.sleep(0.005)


def by_tokens(caplog: pytest.LogCaptureFixture, *tokens: int) -> tuple[list[str], list[str]]:
    """The access log's lines, and the line of each request by its reply's ``tokens``
    (one request each)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.router.access"]
    assert len(lines) == len(tokens), lines
    found = {int(re.findall(r" tokens=(\d+)", line)[0]): line for line in lines}
    return lines, [found[n] for n in tokens]


def pins(app: RouterApp, *outcomes: str) -> dict[str, float | None]:
    """``llmgw_router_slot_pins_total`` of replica ``a`` by outcome."""
    labels = {"model": "m", "replica": "a"}
    registry = app.metrics.registry
    return {
        o: registry.get_sample_value("llmgw_router_slot_pins_total", {**labels, "outcome": o})
        for o in outcomes
    }


@needs_server
@pytest.mark.parametrize("only", [True, False], ids=["only-router", "one-of-several"])
async def test_a_request_let_go_for_its_prompts_slot_gets_that_slot(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, only: bool
) -> None:
    """Two prompts generating in the two slots, a second user of the one that finishes
    first waiting in the router for its slot, and a third prompt's request queued in
    the engine for whichever slot frees first: when the lantern's slot frees,
    llama-server hands it to the queued request, and the second user, let go a moment
    later, computes its prompt again in the other slot (no host cache here to keep
    it). The fleet's only router sends each request to a slot it chooses
    (``id_slot``): the queued one to the slot nobody in the router waits for, the
    second user to its prompt's slot, where it finds its prompt. Where several routers
    share the fleet none chooses (what one sent a slot another does not know), and the
    engine does as it does."""
    caplog.set_level(logging.INFO, "llmgw.router.access")
    system = LANTERN
    async with two_slots(tmp_path, nursery, only=only) as (client, app, replica):
        with trio.fail_after(90):
            async with trio.open_nursery() as users:
                one_word = "Answer in one word. " * 30
                users.start_soon(ask, client, one_word, "Which way is north?", 40)
                await sent(replica, 1)
                users.start_soon(ask, client, system, "Who keeps the lantern?", 8)
                await sent(replica, 2)
                users.start_soon(ask, client, system, "When is it lit?", 4)
                await sent(replica, 3)  # waiting in the router for the lantern's slot
                users.start_soon(ask, client, "Count the stars. " * 20, "How many?", 2)
    lines, (north, first, stars, second) = by_tokens(caplog, 40, 8, 2, 4)
    assert "waited=" in second, lines  # the router held it for its prompt's slot
    found = CACHED.search(second)
    assert found, lines
    cached, prompt = (int(g) for g in found.groups())
    if only:
        assert SLOT.findall(second) == SLOT.findall(first) != SLOT.findall(north), lines
        assert SLOT.findall(stars) == SLOT.findall(north), lines  # the one none waits for
        assert cached >= prompt // 2, f"the second computed its prompt again: {second}"
        assert pins(app, "new", "idle") == {"new": 3, "idle": 1}
    else:  # the engine's own choice, which the test is about: the slot taken, computed again
        assert not any(SLOT.search(line) for line in lines), lines
        assert cached < prompt // 2, f"the engine kept the prompt's slot by itself: {second}"


@needs_server
async def test_a_request_that_would_not_wait_and_finds_no_slot_idle_waits_for_its_prompts_slot(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """The lantern's prompt generating in one slot for a request not streamed, a
    short request of another prompt in the other, and a second user of the lantern's:
    the router does not hold it for the lantern's slot (a request not streamed says
    no time to its first token to bound the wait by), and llama-server would give it
    whichever slot frees first, the short one's, and compute the lantern's prompt
    again there. It waits in the engine either way; the fleet's only router names the
    lantern's slot, and the second user finds its prompt there."""
    caplog.set_level(logging.INFO, "llmgw.router.access")
    system = LANTERN
    async with two_slots(tmp_path, nursery, only=True) as (client, app, replica):
        with trio.fail_after(90):
            async with trio.open_nursery() as users:
                users.start_soon(whole, client, system, "Who keeps the lantern?", 40)
                await sent(replica, 1)
                users.start_soon(ask, client, "Answer in one word. " * 30, "North?", 2)
                await sent(replica, 2)
                await whole(client, system, "When is it lit?", 4)
    lines, (first, short, second) = by_tokens(caplog, 40, 2, 4)
    assert "waited=" not in second, lines  # not held in the router
    assert SLOT.findall(second) == SLOT.findall(first) != SLOT.findall(short), lines
    found = CACHED.search(second)
    assert found, lines
    cached, prompt = (int(g) for g in found.groups())
    assert cached >= prompt // 2, f"the second computed its prompt again: {second}"
    assert pins(app, "new", "waits") == {"new": 2, "waits": 1}
    assert replica.computing.waits == 1  # ``ctl replicas``: one waited, in the engine

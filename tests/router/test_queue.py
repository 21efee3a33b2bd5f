"""Queueing for room: a request that finds every replica full waits in the router, and
starts the moment room frees, woken by what frees it rather than a timer.

A real llama-server of the tiny model (one slot) behind the router in this process."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from llmgw.router import room
from llmgw.router.app import RouterApp
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.engines.test_tinymodel import llama_server
from tests.realparts import needs_server
from tests.router.test_app import AUTH, KEY, serve
from tests.router.test_resume import MESSAGES
from tools.support.tinymodel import write_model


@needs_server
async def test_a_queued_request_starts_the_moment_room_frees(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-slot llama-server whose model admits nothing that would wait on the engine
    (``target_waiting`` 0): a second request, sent while a stream holds the slot, waits
    in the router, not on the engine. It is sent the moment the stream ends on its
    replica, though the queue's re-check and the gauges' next scrape are both far off
    (30 s, 60 s): the stream's end wakes it."""
    monkeypatch.setattr(room, "RECHECK_S", 30.0)
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    async with llama_server(model, tmp_path, context=2048, name="a") as url:
        table = RoutingTable(scrape_s=60)  # one reading, now: fresh for the next 5 s
        table.apply(
            Snapshot(
                version="1",
                models={"m": ModelRouting(target_waiting=0)},
                routes=[Route(key="a", model="m", url=url, engine="llama.cpp")],
            )
        )
        await nursery.start(table.run)
        [ep] = table.endpoints["m"]
        with trio.fail_after(5):
            while ep.load is None:
                await trio.sleep(0.01)
        assert ep.load.slots == 1 and not ep.load.waiting
        app = RouterApp(table, KeyRing([ApiKey("t", hash_key(KEY))]), queue_timeout_s=30.0)
        base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"
        queue = table.rooms("m")
        sent_b: list[float] = []
        answers: list[int] = []

        async def second(client: httpx.AsyncClient) -> None:
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            r = await client.post(base + "/chat/completions", json=body, headers=AUTH)
            answers.append(r.status_code)

        async def watch_b() -> None:
            while ep.sent < 2:
                await trio.sleep(0.002)
            sent_b.append(trio.current_time())

        with trio.fail_after(20):
            async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as inner:
                # a thousand tokens: still at work when the second request is queued
                first = {"model": "m", "messages": MESSAGES, "max_tokens": 1000,
                         "temperature": 0, "stream": True}  # fmt: skip
                async with client.stream(
                    "POST", base + "/chat/completions", json=first, headers=AUTH
                ) as r:
                    lines = r.aiter_lines()
                    await lines.__anext__()  # the stream holds the slot
                    inner.start_soon(second, client)
                    inner.start_soon(watch_b)
                    while not len(queue):
                        await trio.sleep(0.002)
                    # the second waits in the router, not on the engine
                    assert (ep.sent, ep.in_flight) == (1, 1)
                    async for line in lines:
                        if line == "data: [DONE]":
                            done_at = trio.current_time()
        assert answers == [200] and not len(queue)
        # sent as the stream ended on its replica (just before the client read its end),
        # not at the queue's next re-check, 30 s on
        assert abs(sent_b[0] - done_at) < 1.0, sent_b[0] - done_at


@needs_server
async def test_a_full_model_serves_the_quiet_client_before_the_one_that_floods_it(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """One slot, nothing admitted that would wait on the engine: while a stream of the
    noisy key holds the slot, three more of its requests queue, then one of a quiet key.
    When the slot frees, the quiet one goes first (the noisy key's stream counted when
    it was sent, though it has not ended; the quiet key used nothing), then the noisy
    ones in the order they came: first come, first served would have put the quiet one
    last, and so would counting a request only when it ends."""
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    async with llama_server(model, tmp_path, context=2048, name="a") as url:
        table = RoutingTable(scrape_s=60)
        table.apply(
            Snapshot(
                version="1",
                models={"m": ModelRouting(target_waiting=0)},
                routes=[Route(key="a", model="m", url=url, engine="llama.cpp")],
            )
        )
        await nursery.start(table.run)
        [ep] = table.endpoints["m"]
        with trio.fail_after(5):
            while ep.load is None:
                await trio.sleep(0.01)
        quiet = "llmgw-quiet-key"
        keys = KeyRing([ApiKey("noisy", hash_key(KEY)), ApiKey("quiet", hash_key(quiet))])
        app = RouterApp(table, keys, queue_timeout_s=30.0)
        base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"
        queue = table.rooms("m")
        done: list[str] = []
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}

        async def ask(client: httpx.AsyncClient, who: str, key: str) -> None:
            auth = {"authorization": f"Bearer {key}"}
            r = await client.post(base + "/chat/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            done.append(who)

        with trio.fail_after(30):
            async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as inner:
                first = {**body, "max_tokens": 400, "stream": True}
                async with client.stream(
                    "POST", base + "/chat/completions", json=first, headers=AUTH
                ) as r:
                    lines = r.aiter_lines()
                    await lines.__anext__()  # the stream holds the slot
                    for i in range(3):
                        inner.start_soon(ask, client, f"noisy{i}", KEY)
                        while len(queue) < i + 1:
                            await trio.sleep(0.002)
                    inner.start_soon(ask, client, "quiet", quiet)
                    while len(queue) < 4:
                        await trio.sleep(0.002)
                    async for _ in lines:
                        pass
        assert done == ["quiet", "noisy0", "noisy1", "noisy2"], done

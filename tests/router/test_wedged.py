"""Wedged engines: work in flight and a flat progress counter take a replica out, though
its health check passes; an engine that is merely slow is never taken out."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.engines.base import Launch, LoadSignals
from llmgw.engines.vllm import VLLM
from llmgw.router.app import RouterApp
from llmgw.router.balancer import Endpoint, note_heard, note_progress, silent, wedged
from llmgw.router.breaker import Breaker, BreakerState
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.engines.test_tinymodel import llama_server
from tests.engines.test_vllm import running, spec, wait_healthy, wrapper
from tests.ports import own_port
from tests.realparts import needs_server
from tests.router.test_app import AUTH, KEY, serve
from tests.router.test_resume import llama_routes
from tools.support.tinymodel import write_model

NOW = 1000.0


def reading(ep: Endpoint, now: float, progress: float, running: float = 1) -> None:
    """What a scrape does with a fresh reading."""
    load = LoadSignals(waiting=0, running=running, progress=progress)
    ep.load, ep.load_at = load, now
    note_progress(ep, load, now)


def test_work_and_a_flat_counter_for_long_enough_is_wedged() -> None:
    ep = Endpoint(key="r", model="m", url="http://r")
    reading(ep, NOW, 500)
    for t in range(1, 30):
        reading(ep, NOW + t, 500)
        assert wedged(ep, NOW + t, 30) == ""
    reading(ep, NOW + 30, 500)
    assert wedged(ep, NOW + 30, 30) == (
        "1 requests in flight and no progress for 30 s, though its metrics answer"
    )
    reading(ep, NOW + 31, 501)  # it moved: not wedged, and the clock starts again
    assert wedged(ep, NOW + 31, 30) == ""
    assert wedged(ep, NOW + 60, 30) is None  # the last reading is stale: no judgement


def test_work_and_nothing_heard_for_long_enough_is_silent() -> None:
    """A chunk of a reply or an answered scrape is hearing from it; neither for
    ``after_s`` with work in flight is silent. With nothing in flight its clock restarts."""
    ep = Endpoint(key="r", model="m", url="http://r")
    note_heard(ep, NOW)
    assert silent(ep, NOW + 100, 8) == ""  # idle: nothing is owed
    note_heard(ep, NOW + 100)
    ep.in_flight = 2
    for t in range(101, 108):
        note_heard(ep, NOW + t)
        assert silent(ep, NOW + t, 8) == ""
    ep.chunks += 1  # a token came back
    note_heard(ep, NOW + 108)
    assert silent(ep, NOW + 115, 8) == ""
    note_heard(ep, NOW + 116)
    quiet = "2 requests in flight and not a byte of them nor an answer to a metrics scrape"
    assert silent(ep, NOW + 116, 8) == f"{quiet} for 8 s"
    reading(ep, NOW + 117, 500)  # a scrape was answered
    note_heard(ep, NOW + 117)
    assert silent(ep, NOW + 124, 8) == ""
    assert silent(ep, NOW + 125, 8).startswith(quiet)
    assert silent(ep, NOW + 125, 0) == ""  # silent_after_s = 0: never judged


def test_a_silent_engine_stays_so_once_its_work_has_moved_until_it_is_heard() -> None:
    """Its requests cut and carried on elsewhere, a stopped engine has nothing in flight
    but has still answered nothing: it stays held wedged (so the control plane restarts
    it after its grace), until a scrape is answered."""
    ep = Endpoint(key="r", model="m", url="http://r")
    note_heard(ep, NOW)
    ep.in_flight = 3
    note_heard(ep, NOW + 1)
    ep.wedged = silent(ep, NOW + 9, 8)
    assert ep.wedged.startswith("3 requests in flight and not a byte")
    ep.in_flight = 0  # cut, and carried on elsewhere
    for t in (10, 20, 60):
        note_heard(ep, NOW + t)
        assert silent(ep, NOW + t, 8) == ep.wedged
    reading(ep, NOW + 61, 500)  # it answers a scrape again
    note_heard(ep, NOW + 61)
    assert silent(ep, NOW + 61, 8) == ""


def test_an_idle_engine_is_never_wedged_and_its_clock_restarts() -> None:
    ep = Endpoint(key="r", model="m", url="http://r")
    reading(ep, NOW, 500, running=0)
    reading(ep, NOW + 100, 500, running=0)
    assert wedged(ep, NOW + 100, 30) == ""
    ep.in_flight = 1  # work arrives: flat from the last idle reading, not the first
    reading(ep, NOW + 101, 500, running=0)
    assert wedged(ep, NOW + 101, 30) == ""
    reading(ep, NOW + 129, 500, running=1)
    assert wedged(ep, NOW + 129, 30) == ""
    reading(ep, NOW + 131, 500, running=1)
    assert wedged(ep, NOW + 131, 30) == (
        "1 requests in flight and no progress for 31 s, though its metrics answer"
    )


def test_no_counter_or_no_judging_is_never_wedged() -> None:
    ep = Endpoint(key="r", model="m", url="http://r", in_flight=3)
    load = LoadSignals(waiting=0, running=3)  # an engine without a progress counter
    ep.load, ep.load_at = load, NOW
    note_progress(ep, load, NOW)
    assert wedged(ep, NOW + 100, 30) is None
    reading(ep, NOW, 1)
    assert wedged(ep, NOW + 4, 0) == ""  # wedged_after_s = 0: never judged


def test_a_trip_opens_the_breaker_and_restarts_its_cool_down() -> None:
    b = Breaker(cooldown_s=10)
    b.trip(NOW, "wedged: no progress")
    assert (b.state, b.reason) == (BreakerState.OPEN, "wedged: no progress")
    assert not b.allows(NOW + 9)
    b.trip(NOW + 9, "wedged: still")
    assert not b.allows(NOW + 18)  # restarted at +9
    assert b.allows(NOW + 19) and b.state is BreakerState.HALF_OPEN
    b.trip(NOW + 19, "wedged: again")
    assert b.state is BreakerState.OPEN


@pytest.fixture
def caplog_router(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="llmgw.router")
    return caplog


async def test_a_wedged_vllm_is_taken_out_though_its_health_passes(
    tmp_path: Path, nursery: trio.Nursery, caplog_router: pytest.LogCaptureFixture
) -> None:
    """Two vLLM stand-ins; one stops generating after its third token (vLLM #17972: it
    accepts requests, /health answers 200, /metrics answers with a flat counter). Its
    stream stalls; the router says so once, opens its breaker, shows it in the admin
    view and the metrics, and every request after goes to the other, and is answered."""
    binaries = {"vllm": wrapper(tmp_path / "bin", "vllm")}
    stuck, healthy = vllm(binaries), vllm(binaries)
    async with (
        running(stuck, tmp_path / "stuck.log", STANDIN_LOAD_S="0",
                STANDIN_TOKEN_DELAY_S="0.02", STANDIN_WEDGE_AFTER_TOKENS="3") as p1,
        running(healthy, tmp_path / "healthy.log", STANDIN_LOAD_S="0",
                STANDIN_TOKEN_DELAY_S="0.02") as p2,
        httpx.AsyncClient(timeout=10) as client,
    ):  # fmt: skip
        assert stuck.health_url is not None and healthy.health_url is not None
        await wait_healthy(client, stuck.health_url, p1)
        await wait_healthy(client, healthy.health_url, p2)
        told: list[frozenset[str]] = []  # what the control plane is told (in-process)
        table = RoutingTable(scrape_s=0.1, wedged_after_s=1.0, on_wedged=told.append)

        def routes(version: str, healthy_ready: bool) -> Snapshot:
            return Snapshot(
                version=version,
                models={"m": ModelRouting()},
                routes=[
                    Route(key=name, model="m", url=launch.removesuffix("/health"),
                          engine="vllm", ready=name == "stuck" or healthy_ready)
                    for name, launch in (("stuck", stuck.health_url),
                                         ("healthy", healthy.health_url))
                    if launch is not None
                ],
            )  # fmt: skip

        # at first only the one that wedges is Ready: the stream goes there
        table.apply(routes("1", healthy_ready=False))
        await nursery.start(table.run)
        app = RouterApp(table, KeyRing([ApiKey("t", hash_key(KEY))]))
        base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"
        [ep] = [e for e in table.endpoints["m"] if e.key == "stuck"]
        # a stream on the one that wedges: it stalls after three tokens
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        got: list[str] = []

        async def stalled() -> None:
            async with client.stream(
                "POST", base + "/chat/completions", json=body, headers=AUTH
            ) as r:
                async for line in r.aiter_lines():
                    got.append(line)

        async with trio.open_nursery() as streams:
            streams.start_soon(stalled)
            with trio.fail_after(10):
                while sum('"content"' in line for line in got) < 4:  # its role, 3 tokens
                    await trio.sleep(0.05)
            table.apply(routes("2", healthy_ready=True))
            with trio.fail_after(10):
                while not ep.wedged:
                    await trio.sleep(0.05)
            assert ep.breaker.state is BreakerState.OPEN
            assert told[-1] == frozenset({"stuck"}) and told[0] == frozenset()
            assert ep.breaker.reason.startswith("wedged: 1 requests in flight and no progress")
            # its health still passes: only its progress gave it away
            assert (await client.get(stuck.health_url)).status_code == 200
            view = table.traffic(trio.current_time())["stuck"]
            assert view.wedged and view.breaker == "open"
            # every request now goes to the other one, and is answered
            for _ in range(5):
                r = await client.post(
                    base + "/chat/completions", json={**body, "stream": False}, headers=AUTH
                )
                assert r.status_code == 200, r.text
            assert app.metrics.requests.labels("m", "healthy", "200", "t")._value.get() == 5
            samples = {
                s.labels["replica"]: s.value
                for m in app.metrics.registry.collect()
                if m.name == "llmgw_router_wedged"
                for s in m.samples
            }
            assert samples == {"stuck": 1.0, "healthy": 0.0}
            with trio.fail_after(10):  # the stream it held was cut, and went on elsewhere
                while "data: [DONE]" not in got:
                    await trio.sleep(0.05)
        events = [json.loads(line[6:]) for line in got if line.startswith("data: {")]
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
        assert text == "Hello from the vLLM stand-in."  # three tokens there, three here
        assert {e["id"] for e in events} == {events[0]["id"]}
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert not any("token_ids" in e["choices"][0] for e in events if e["choices"])
        assert app.metrics.resumed.labels("m")._value.get() == 1
        said = [r.getMessage() for r in caplog_router.records if "is wedged" in r.getMessage()]
        assert len(said) == 1, said  # once, not every scrape
        assert said[0].startswith("replica stuck of model m is wedged: 1 requests in flight")


def vllm(binaries: dict[str, str]) -> Launch:
    """A one-GPU ``vllm serve`` serving model ``m``, on a port of this test's own."""
    return VLLM.launch(
        spec(gpus=[0], port=own_port(), settings={"served_model_name": "m"}), binaries
    )


@needs_server
async def test_a_slow_llama_server_under_a_burst_is_never_wedged(
    tmp_path: Path, nursery: trio.Nursery, caplog_router: pytest.LogCaptureFixture
) -> None:
    """Slow is not wedged: 64 long requests at once on a one-slot llama-server, most of
    them deferred for seconds, with one-second wedged and silent limits judged ten
    times a second. Its decode counter moves with every step and it answers its
    metrics between steps, so it is never taken out, and every request is answered."""
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    async with llama_server(model, tmp_path) as url:
        table = RoutingTable(scrape_s=0.1, wedged_after_s=1.0, silent_after_s=1.0)
        table.apply(
            Snapshot(version="1", models={"m": ModelRouting()},
                     routes=[Route(key="one", model="m", url=url, engine="llama.cpp")])
        )  # fmt: skip
        await nursery.start(table.run)
        app = RouterApp(table, KeyRing([ApiKey("t", hash_key(KEY))]))
        base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"
        [ep] = table.endpoints["m"]
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 400, "ignore_eos": True}  # fmt: skip
        statuses: list[int] = []
        deferred: list[float] = []

        async def one(client: httpx.AsyncClient) -> None:
            r = await client.post(base + "/chat/completions", json=body, headers=AUTH)
            statuses.append(r.status_code)

        limits = httpx.Limits(max_connections=80)
        with trio.fail_after(120):
            async with (
                httpx.AsyncClient(timeout=100, limits=limits) as client,
                trio.open_nursery() as burst,
            ):
                for _ in range(64):
                    burst.start_soon(one, client)
                while len(statuses) < 64:
                    assert not ep.wedged, ep.wedged
                    assert ep.breaker.state is BreakerState.CLOSED
                    if ep.load is not None and ep.load.waiting is not None:
                        deferred.append(ep.load.waiting)
                    await trio.sleep(0.05)
    assert statuses == [200] * 64
    assert max(deferred) >= 1  # it did queue: slow, not idle
    assert ep.progress is not None  # the counter was read
    assert not [r for r in caplog_router.records if "wedged" in r.getMessage()]


@needs_server
async def test_every_request_waiting_on_a_stopped_engine_goes_to_another_replica(
    tmp_path: Path, nursery: trio.Nursery, caplog_router: pytest.LogCaptureFixture
) -> None:
    """Twelve whole (non-streamed) requests wait on a SIGSTOPped llama-server: its
    socket takes them and nothing comes back; meanwhile another replica becomes Ready.
    Once the first is found silent, each is cut and
    asked of the other replica, all twelve, though the retry budget allows three in
    this window: a replica found wedged does no work for them, so moving them adds no
    load. Every client gets its answer."""
    model = write_model(tmp_path / "never.gguf", ends_after=None)
    procs: list[trio.Process] = []
    async with (
        llama_server(model, tmp_path, name="a", procs=procs) as url_a,
        llama_server(model, tmp_path, name="b", procs=procs) as url_b,
    ):
        table = RoutingTable(scrape_s=0.2, silent_after_s=1.5)
        table.apply(llama_routes(("a", url_a), ("b", url_b), unready=frozenset({"b"})))  # all to a
        await nursery.start(table.run)
        app = RouterApp(table, KeyRing([ApiKey("t", hash_key(KEY))]))
        base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"
        [ep_a, _] = table.endpoints["m"]
        procs[0].send_signal(signal.SIGSTOP)
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 8, "temperature": 0}  # fmt: skip
        statuses: list[int] = []

        async def one(client: httpx.AsyncClient) -> None:
            r = await client.post(base + "/chat/completions", json=body, headers=AUTH)
            statuses.append(r.status_code)

        with trio.fail_after(30):
            async with (
                httpx.AsyncClient(timeout=25, limits=httpx.Limits(max_connections=20)) as client,
                trio.open_nursery() as clients,
            ):
                for _ in range(12):
                    clients.start_soon(one, client)
                while ep_a.in_flight < 12:
                    await trio.sleep(0.01)
                table.apply(llama_routes(("a", url_a), ("b", url_b)))
    assert statuses == [200] * 12, statuses
    assert "not a byte" in ep_a.wedged
    retries = app.metrics.registry.get_sample_value("llmgw_router_retries_total", {"model": "m"})
    assert retries == 12

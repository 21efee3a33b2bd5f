"""Replicas that follow demand, with real processes, real llama-server and the real
openai client: a model with a range starts with none, a request for it is held
until one starts and is answered, the model drains to zero after its idle time, an
operator's pin holds a count until released, and a hold past its bound is a 503
that says how long a start takes (never a 429)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from llmgw.router.keys import hash_key
from tests.cluster.procs import Daemon, workers_route
from tests.cluster.test_control_plane_processes import Cluster, cluster
from tests.cluster.test_router_processes import admin_metrics, routed
from tests.conftest import Pki
from tests.ports import own_port
from tests.realparts import needs_server

pytestmark = needs_server


def elastic(model: Path, idle_s: float = 3, min_memory_gb: float = 1, context: int = 512) -> str:
    """A model of the tiny engine that scales between none and two (no GPU, so that
    two fit on one node beside the tiny model)."""
    return f"""
[models.elastic]
replicas = {{ min = 0, max = 2, idle_s = {idle_s} }}
[[models.elastic.profiles]]
name = "cpu"
engine = "llama.cpp"
gpus = 0
min_memory_gb = {min_memory_gb}
model_path = "{model}"
settings = {{ context = {context}, parallel = 1, threads = 1, threads_batch = 1 }}
startup_timeout_s = 60
"""


async def models(c: Cluster) -> dict[str, dict[str, Any]]:
    out = await c.server.ctl("models", "--json")
    return {m["model"]: m for m in json.loads(out.stdout)["models"]}


async def elastic_replicas(c: Cluster) -> list[dict[str, Any]]:
    return [r for r in await c.replicas() if r["model"] == "elastic"]


async def wait_for(c: Cluster, what: str, check: Any, timeout: float = 60) -> Any:
    with trio.move_on_after(timeout):
        while not (got := await check()):
            await trio.sleep(0.2)
        return got
    raise AssertionError(f"never {what}: {await models(c)}\n{c.server.log()[-4000:]}")


async def test_a_request_at_zero_is_held_until_a_replica_starts_and_it_drains_to_zero_when_idle(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki, extra_catalog=elastic(tmp_path / "tiny.gguf")) as (
        c,
        base,
        key,
    ):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=90)
        view = (await models(c))["elastic"]
        assert view["wanted"] == 0 and view["ready"] == 0, view
        assert view["scaling"]["min"] == 0 and view["scaling"]["max"] == 2, view
        assert not await elastic_replicas(c)
        # listed though none runs: a client that asks for it gets one
        assert "elastic" in [m.id for m in (await client.models.list()).data]

        async def ask() -> str:
            r = await client.chat.completions.create(
                model="elastic", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            return r.choices[0].message.content or ""

        began = trio.current_time()
        answers: list[str] = []

        async def one() -> None:
            answers.append(await ask())

        async with trio.open_nursery() as nursery:  # three at once, all held, none fails
            for _ in range(3):
                nursery.start_soon(one)
        took = trio.current_time() - began
        assert len(answers) == 3, answers
        log = c.server.log()
        assert "holding requests for elastic until a replica of it starts" in log, log[-3000:]
        assert re.search(r"scaling elastic: 0 → 1: \d requests? held with no replica", log), log[
            -3000:
        ]
        assert "held=yes" in log  # the access log says which requests were held
        samples = await admin_metrics(c)
        assert samples("llmgw_model_scale_events_total", model="elastic", reason="held") == 1
        assert samples("llmgw_router_held_seconds_count", model="elastic") == 3
        assert samples("llmgw_replica_start_seconds_count", model="elastic", profile="cpu") == 1
        view = (await models(c))["elastic"]
        assert view["scaling"]["start_s"] is not None and view["scaling"]["start_s"] <= took

        # no request for idle_s: drained, then gone, with the reason shown
        async def none_left() -> bool:
            return not await elastic_replicas(c)

        await wait_for(c, "drained to zero", none_left, timeout=40)
        view = (await models(c))["elastic"]
        assert view["wanted"] == 0, view
        assert view["scaling"]["last_change"].startswith("1 → 0: no request for 3 s"), view
        table = (await c.server.ctl("models")).stdout.decode()
        assert "elastic" in table and "0 (0-2)" in table and "1 → 0: no request" in table, table
        # and the next request starts it again
        assert await ask()


async def test_an_operator_pins_a_count_and_releases_it(tmp_path: Path, pki: Pki) -> None:
    async with routed(tmp_path, pki, extra_catalog=elastic(tmp_path / "tiny.gguf")) as (c, _, _):
        out = await c.server.ctl("scale", "elastic", "2")
        assert "pinned at 2" in out.stdout.decode()

        async def two_ready() -> bool:
            return len([r for r in await elastic_replicas(c) if r["state"] == "Ready"]) == 2

        await wait_for(c, "two Ready", two_ready)
        view = (await models(c))["elastic"]
        assert view["wanted"] == 2 and view["scaling"]["pinned"] == 2, view
        await trio.sleep(4)  # past idle_s: a pin holds whatever the demand
        assert len(await elastic_replicas(c)) == 2

        refused = await c.server.ctl("scale", "tiny", "2", check=False)
        assert refused.returncode != 0 and "runs a fixed count" in refused.stderr.decode()
        refused = await c.server.ctl("scale", "elastic", "3", check=False)
        assert refused.returncode != 0 and "0 to 2" in refused.stderr.decode()

        out = await c.server.ctl("scale", "elastic", "--release")
        assert "released" in out.stdout.decode()

        async def none_left() -> bool:
            return not await elastic_replicas(c)

        await wait_for(c, "drained to zero after the release", none_left, timeout=40)


async def test_a_hold_past_its_bound_is_a_503_that_says_how_long_a_start_takes(
    tmp_path: Path, pki: Pki
) -> None:
    # no node can hold it: nothing starts, and the hold ends at its bound
    nowhere = elastic(tmp_path / "tiny.gguf", min_memory_gb=1000)
    async with routed(
        tmp_path, pki, extra_catalog=nowhere, router_extra="hold_timeout_s = 1.5\n"
    ) as (c, base, key):
        async with httpx.AsyncClient(timeout=30) as http:
            began = trio.current_time()
            r = await http.post(
                f"{base}/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": "elastic", "messages": [{"role": "user", "content": "hi"}]},
            )
            waited = trio.current_time() - began
        assert r.status_code == 503, r.text
        assert 1.4 <= waited < 10, waited
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["code"] == "starting", error
        assert "no replica of elastic started" in error["message"], error
        assert "a start takes about 30 s" in error["message"], error  # none measured yet
        view = (await models(c))["elastic"]
        assert view["wanted"] == 1 and view["cannot_place"], view  # it tried, and says why


async def test_a_standalone_router_holds_and_tells_the_control_plane(
    tmp_path: Path, pki: Pki
) -> None:
    """The router in another process has no way to the fleet but its report: a request
    it holds starts a replica all the same, and its load keeps the model up."""
    async with routed(tmp_path, pki, extra_catalog=elastic(tmp_path / "tiny.gguf", idle_s=5)) as (
        c,
        _,
        key,
    ):
        port = own_port()
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            "workers = 1\n"
            f'[router]\nlisten = "127.0.0.1:{port}"\naccess_log = true\n'
            f'[[router.keys]]\nname = "edge"\nsha256 = "{hash_key(key)}"\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        c.agents["router"] = router  # killed with the rest
        await workers_route(router, 1, workers=1)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60
        )
        began = trio.current_time()
        r = await client.chat.completions.create(
            model="elastic", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.choices[0].message.content is not None
        # told at once, not on the report's 20 s timer
        assert trio.current_time() - began < 15
        assert "held=yes" in router.log()
        assert re.search(r"scaling elastic: 0 → 1: 1 request held", c.server.log())

        # short requests a second apart for longer than idle_s keep the model up: each
        # is over long before the next report, but their arrival is reported
        for _ in range(9):
            await trio.sleep(1)
            await client.chat.completions.create(
                model="elastic", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert "scaling elastic: 1 → 0" not in c.server.log(), c.server.log()[-3000:]
        assert router.log().count("held=yes") == 1
        await client.close()


async def test_a_restart_in_a_scale_up_places_nothing_twice_and_keeps_the_pin(
    tmp_path: Path, pki: Pki
) -> None:
    """Killed while two replicas it pinned were starting, the control plane comes back
    to the same two: none placed again, none drained, and the pin still holds."""
    async with cluster(tmp_path, pki, extra_catalog=elastic(tmp_path / "tiny.gguf")) as c:
        c.agent("n1")
        await c.wait_ready(model="tiny")
        await c.server.ctl("scale", "elastic", "2")

        async def two() -> list[dict[str, Any]]:
            got = await elastic_replicas(c)
            return got if len(got) == 2 else []

        before = {r["replica_id"] for r in await wait_for(c, "two placed", two)}
        await c.restart_server()

        async def ready() -> bool:
            got = await elastic_replicas(c)
            return len([r for r in got if r["state"] == "Ready"]) == 2

        await wait_for(c, "two Ready after the restart", ready)
        await trio.sleep(4)  # settled, a few passes on, past idle_s
        after = await elastic_replicas(c)
        assert {r["replica_id"] for r in after} == before, after
        view = (await models(c))["elastic"]
        assert view["scaling"]["pinned"] == 2 and view["wanted"] == 2, view


async def test_a_load_that_rises_and_falls_within_a_minute_starts_no_more_and_stops_nothing(
    tmp_path: Path, pki: Pki
) -> None:
    """Hysteresis through the real stream: two users wake the model with two replicas;
    lulls shorter than the rule's patience for a fall stop nothing, and a spike to three
    users shorter than its patience for a rise starts nothing."""
    catalog = elastic(tmp_path / "tiny.gguf", idle_s=60).replace("max = 2,", "max = 3, target = 1,")
    async with routed(tmp_path, pki, extra_catalog=catalog) as (c, base, key):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)

        async def users(n: int, seconds: float) -> None:
            until = trio.current_time() + seconds

            async def user() -> None:
                while trio.current_time() < until:
                    stream = await client.chat.completions.create(
                        model="elastic",
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=64,
                        stream=True,
                    )
                    async for _ in stream:
                        pass

            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(user)

        await users(2, 20)  # from zero: two held, two started
        await trio.sleep(8)  # a lull
        await users(3, 5)  # a spike, shorter than UP_S
        await trio.sleep(8)
        await users(2, 10)
        changes = re.findall(r"scaling elastic: (\d+) → (\d+)", c.server.log())
        ups = [(a, b) for a, b in changes if int(b) > int(a)]
        downs = [(a, b) for a, b in changes if int(b) < int(a)]
        assert ups and ups[-1][1] == "2" and not downs, changes
        samples = await admin_metrics(c)
        assert samples("llmgw_replica_start_seconds_count", model="elastic") == 2, changes
        assert len(await elastic_replicas(c)) == 2


async def test_a_range_held_back_by_another_models_floor_says_so_everywhere(
    tmp_path: Path, pki: Pki
) -> None:
    """One node, 16 GiB: tiny (4) and one elastic replica (5) run; a model whose floor
    needs 9 cannot be placed, so elastic, pinned to two, stays at one: `ctl models`,
    `ctl status` and the problems gauge say which model is short and why."""
    more = elastic(tmp_path / "tiny.gguf", idle_s=600, min_memory_gb=5)
    async with routed(tmp_path, pki, extra_catalog=more) as (c, _, _):
        await c.server.ctl("scale", "elastic", "1")

        async def one_ready() -> bool:
            return [r["state"] for r in await elastic_replicas(c)] == ["Ready"]

        await wait_for(c, "one Ready", one_ready)
        catalog_path = tmp_path / "catalog.toml"
        floor = elastic(tmp_path / "tiny.gguf", min_memory_gb=9).replace(
            "[models.elastic]", "[models.floor]"
        )
        floor = floor.replace("models.elastic.", "models.floor.").replace(
            "replicas = { min = 0, max = 2, idle_s = 3 }", "replicas = 1"
        )
        catalog_path.write_text(catalog_path.read_text() + floor)
        assert "catalog reloaded" in (await c.server.ctl("reload")).stdout.decode()
        await c.server.ctl("scale", "elastic", "2")

        async def held_back() -> dict[str, Any]:
            view = await models(c)
            return view if view["elastic"]["scaling"]["yielding"] else {}

        view = await wait_for(c, "elastic held back", held_back)
        said = view["elastic"]["scaling"]["yielding"]
        assert "floor is below the minimum for want of room" in said, said
        assert view["floor"]["cannot_place"], view["floor"]
        table = (await c.server.ctl("models")).stdout.decode()
        assert f"held back: {said}" in table, table
        status = (await c.server.ctl("status")).stdout.decode()
        assert "cannot place floor:" in status and f"warning: {said}" in status, status
        metrics = await c.server.metrics()
        assert 'llmgw_model_problems{model="elastic",reason="held_back"} 1.0' in metrics
        assert 'llmgw_model_problems{model="floor",reason="memory"} 1.0' in metrics
        await trio.sleep(2)  # a few passes: it grows no further
        assert len(await elastic_replicas(c)) == 1


def _order(replica_id: str) -> int:
    """Replica ids end with a counter: the later placed, the higher."""
    return int(replica_id.rsplit("-", 1)[1])


async def test_a_scale_down_lets_the_replica_the_router_believes_least_cached_go(
    tmp_path: Path, pki: Pki
) -> None:
    """Two replicas; conversations through the router until the newest holds more of
    them than the older one (as the router's affinity index says); a scale-down to one
    keeps the newest, which "newest goes first" alone would have drained."""
    from tests.cluster.test_affinity_processes import conversation

    # room for a conversation of five documents (about 1,250 tokens each)
    catalog = elastic(tmp_path / "tiny.gguf", idle_s=600, context=8192)
    async with routed(tmp_path, pki, context=8192, extra_catalog=catalog) as (c, base, key):
        await c.server.ctl("scale", "elastic", "2")

        async def two_ready() -> list[dict[str, Any]]:
            ready = [r for r in await elastic_replicas(c) if r["state"] == "Ready"]
            return ready if len(ready) == 2 else []

        ready = await wait_for(c, "two Ready", two_ready)
        newest, older = sorted((r["replica_id"] for r in ready), key=_order, reverse=True)
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        access = re.compile(r"model=elastic replica=(\S+) ")

        async def blocks() -> dict[str, int]:
            return {
                r["replica_id"]: (r["traffic"] or {}).get("cached_blocks", 0)
                for r in await elastic_replicas(c)
            }

        async def send(messages: list[dict[str, str]]) -> str:
            await client.chat.completions.create(
                model="elastic",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=2,
            )
            return str(access.findall(c.server.log())[-1])

        held = await blocks()
        for seed in range(40):  # a conversation lands where its first turn's hash says
            messages = conversation(seed, 1)[0]
            went = await send(messages)
            held = await blocks()
            # the newest's conversations grow, a document a turn, until it holds more
            while went == newest and held[newest] <= held[older] and len(messages) < 9:
                doc = conversation(seed * 10 + len(messages), 1)[0][1]["content"]
                messages += [{"role": "assistant", "content": "Noted."}]
                messages += [{"role": "user", "content": f"Appendix: {doc}"}]
                went = await send(messages)
                held = await blocks()
            if held[newest] > held[older]:
                break
        assert held[newest] > held[older], held
        table = (await c.server.ctl("replicas")).stdout.decode()
        assert f"{held[newest]} prompt blocks held" in table, table

        await c.server.ctl("scale", "elastic", "1")

        async def one_left() -> list[dict[str, Any]]:
            left = await elastic_replicas(c)
            return left if len(left) == 1 else []

        (kept,) = await wait_for(c, "one left", one_left, timeout=60)
        assert kept["replica_id"] == newest, (kept, held)
        log = c.server.log()
        assert f"replica {older} is an extra (the least cached: {held[older]} prompt blocks)" in log

"""Routing by what replicas hold, through real processes: a server with its router, real
llama-servers (two replicas of a tiny model), the real openai client, and a standalone
router of two worker processes.

A conversation's turns land on one replica and its engine reuses their prefix; a
replica that evicted it is noticed from what the engine says it reused; a turn moves
when its replica is loaded past its bound; two workers of one router, which share
nothing, send a conversation's turns to the same replica.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import trio

from llmgw.router.keys import hash_key, new_key
from llmgw.router.prefix import prompt_key, rendezvous
from tests.cluster.procs import Daemon, workers_route
from tests.cluster.test_control_plane_processes import Cluster, cluster, engine_key
from tests.cluster.test_router_processes import Samples, admin_metrics, reserved_port
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server

SYSTEM = {"role": "system", "content": "You answer questions about the document you are given."}
ACCESS = re.compile(r"model=chat replica=(\S+) .* cached=(\d+)/(\d+) end=ok")


def chat_catalog(model: Path, *, cache_ram_mib: int) -> str:
    return f"""
[models.chat]
replicas = 2
[[models.chat.profiles]]
name = "cpu"
engine = "llama.cpp"
gpus = 1
min_memory_gb = 4
model_path = "{model}"
settings = {{ context = 4096, parallel = 1, threads = 1, threads_batch = 1, cache_ram_mib = {cache_ram_mib} }}
startup_timeout_s = 60
"""


@asynccontextmanager
async def chats(
    tmp_path: Path, pki: Pki, *, cache_ram_mib: int = 0, router_extra: str = ""
) -> AsyncIterator[tuple[Cluster, str, str]]:
    """Two replicas of model ``chat`` (one slot each; no prompt cache by default, so that
    what a slot held is gone once another prompt takes it), on two agents, behind the
    server's router with its access log on."""
    key = new_key()
    router = (
        '[router]\nlisten = "127.0.0.1:0"\naccess_log = true\n'
        f'{router_extra}[[router.keys]]\nname = "tester"\nsha256 = "{hash_key(key)}"\n'
    )
    async with cluster(
        tmp_path,
        pki,
        0,
        ends_after=None,
        context=4096,
        extra_catalog=chat_catalog(tmp_path / "tiny.gguf", cache_ram_mib=cache_ram_mib),
        server_extra=router,
        settle_s=1,
    ) as c:
        c.agent("n1")
        c.agent("n2")
        with trio.fail_after(60):  # one on each node, and nothing moving any more
            while True:
                replicas = await c.replicas()
                where = sorted(r["shards"][0]["node_id"] for r in replicas if r["shards"])
                ready = all(r["state"] == "Ready" and not r["leaving"] for r in replicas)
                if ready and where == ["n1", "n2"]:
                    break
                await trio.sleep(0.2)
        m = await c.server.wait_log(r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)")
        base = m.group(1)
        with trio.fail_after(20):
            while True:
                async with httpx.AsyncClient() as client:
                    r = await client.get(
                        base + "/models", headers={"authorization": f"Bearer {key}"}
                    )
                if r.status_code == 200 and "chat" in [m["id"] for m in r.json()["data"]]:
                    break
                await trio.sleep(0.1)
        yield c, base, key


def conversation(seed: int, turns: int) -> list[list[dict[str, str]]]:
    """Each turn's messages: the conversation's own document (about 600 tokens), then
    questions and answers."""
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "thistle"]
    doc = " ".join(words[(seed * 7 + i * i) % len(words)] for i in range(300))
    messages = [SYSTEM, {"role": "user", "content": f"Document {seed}: {doc}\nWhat is it about?"}]
    out = [list(messages)]
    for t in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"It is about item {t}."},
            {"role": "user", "content": f"Question {t}: tell me more."},
        ]
        out.append(list(messages))
    return out


class AccessLog:
    """The server's access lines for model ``chat``, one per request, in order."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.seen = 0

    async def next(self) -> tuple[str, int, int]:
        """The next request's replica and cached/prompt tokens, once its line is written."""
        with trio.fail_after(10):
            while True:
                lines = ACCESS.findall(self.c.server.log())
                if len(lines) > self.seen:
                    replica, cached, prompt = lines[self.seen]
                    self.seen += 1
                    return replica, int(cached), int(prompt)
                await trio.sleep(0.05)


async def ask(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], *, stream: bool = False
) -> None:
    if stream:
        chunks = await client.chat.completions.create(
            model="chat",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            stream=True,
        )
        assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    else:
        reply = await client.chat.completions.create(
            model="chat",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
        )
        assert reply.choices[0].message.content


async def traffic(c: Cluster) -> dict[str, dict[str, Any]]:
    """The in-process router's view of each replica, as ``ctl replicas --json`` says."""
    out = await c.server.ctl("replicas", "--json")
    return {r["replica_id"]: r for r in json.loads(out.stdout)["replicas"]}


async def test_a_conversation_stays_on_one_replica_and_an_eviction_is_noticed(
    tmp_path: Path, pki: Pki
) -> None:
    async with chats(tmp_path, pki) as (c, base, key):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        log = AccessLog(c)
        homes: dict[int, str] = {}
        for seed in range(3):  # one conversation after another, streamed and not
            for t, messages in enumerate(conversation(seed, 4)):
                await ask(client, messages, stream=t % 2 == 1)
                replica, cached, prompt = await log.next()
                assert homes.setdefault(seed, replica) == replica, (seed, t, homes, replica)
                if t:  # its replica's slot held the turn before: the engine reused it
                    assert cached > 0.6 * prompt, (seed, t, cached, prompt)
        # the server's router is the only one: new conversations are placed evenly (the
        # second where the first is not), where rendezvous alone puts all three on one
        # replica one time in four
        assert "this router places new conversations evenly" in c.server.log()
        assert len(set(homes.values())) == 2, homes
        seen = await admin_metrics(c)
        assert 2.5 < seen("llmgw_router_new_conversations", model="chat") <= 3, "decayed"
        # a first turn goes by load while its first choice is busier than its share
        # (the engine's gauges of the turn before may still say so); later turns stay
        kept = seen("llmgw_router_affinity_total", model="chat", outcome="kept")
        assert kept + seen("llmgw_router_affinity_total", outcome="overruled") == 12
        assert kept >= 9
        reused = seen("llmgw_router_prompt_tokens_cached_total", model="chat")
        assert reused > 0.5 * seen("llmgw_router_prompt_tokens_total", model="chat")
        assert seen("llmgw_router_prefix_index_bytes") > 0
        # the last conversation's first turn again, and a question more: a first turn its
        # replica holds most of (its slot still holds the conversation: the engine
        # reuses it), counted there by the part it computes
        more = {"role": "user", "content": "Which of its words comes most often? " * 16}
        await ask(client, [*conversation(2, 1)[0], more])
        assert (await log.next())[0] == homes[2]
        grew = (await admin_metrics(c))("llmgw_router_new_conversations", model="chat") - seen(
            "llmgw_router_new_conversations", model="chat"
        )
        assert 0.05 < grew < 0.5, grew  # as a new conversation, about 0.9; not counted, 0

        # another prompt straight to the home engine takes its only slot: with no
        # prompt cache, what it held of the conversation is gone
        home = homes[2]
        [shard] = (await traffic(c))[home]["shards"]
        evict = {"messages": conversation(9, 1)[0], "max_tokens": 4}
        auth = {
            "authorization": f"Bearer {engine_key(tmp_path, shard['node_id'], shard['shard_id'])}"
        }
        async with httpx.AsyncClient(timeout=30) as raw:
            r = await raw.post(
                f"http://127.0.0.1:{shard['port']}/v1/chat/completions", json=evict, headers=auth
            )
            assert r.status_code == 200, r.text
        await ask(client, conversation(2, 5)[4])
        replica, cached, prompt = await log.next()
        assert replica == home and cached < 0.2 * prompt, (cached, prompt)
        seen = await admin_metrics(c)
        assert seen("llmgw_router_prefix_evicted_total", model="chat", replica=home) == 1
        # ctl shows what the engine reused and what the router estimated
        view = (await traffic(c))[home]["traffic"]
        assert 0 < view["cache_hit_rate"] <= 1 and 0 < view["estimated_hit_rate"] <= 1, view
        assert view["affinity_overruled"] < 0.5
        table = (await c.server.ctl("replicas")).stdout.decode()
        assert "cache hits" in table and "router estimated" in table

        # a session hint keeps a client's different prompts together: OpenAI's user
        # field, or the x-session-id header (which wins)
        for hint in ({"user": "carol"}, {"extra_headers": {"x-session-id": "s-42"}}):
            where = set()
            for seed in range(20, 24):
                reply = await client.chat.completions.create(
                    model="chat",
                    messages=conversation(seed, 1)[0],  # type: ignore[arg-type]
                    max_tokens=4,
                    **hint,  # type: ignore[arg-type]
                )
                assert reply.choices[0].message.content
                where.add((await log.next())[0])
            assert len(where) == 1, (hint, where)


async def test_a_conversation_moves_when_its_replica_is_loaded_past_its_bound(
    tmp_path: Path, pki: Pki
) -> None:
    """Three long streams of the conversation hold its replica (one slot: one runs, two
    wait) while the other replica is idle: the next turn is past the bound there
    (1.5 x half of the work), so it moves; moved once, it goes on where it now is."""
    turn_line = re.compile(r"model=chat replica=(\S+) .* tokens=8 cached=(\d+)/(\d+) end=ok")

    async def turn(n: int) -> tuple[str, int, int]:
        """The replica and cached/prompt tokens of the conversation's n-th short turn."""
        with trio.fail_after(10):
            while len(found := turn_line.findall(c.server.log())) < n:
                await trio.sleep(0.05)
        replica, cached, prompt = found[n - 1]
        return replica, int(cached), int(prompt)

    async with chats(tmp_path, pki) as (c, base, key):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        turns = conversation(5, 4)
        await ask(client, turns[0])
        home, _, _ = await turn(1)
        begun = trio.Event()
        # later turns that share only the first turn with the conversation's own
        long = [
            *turns[0],
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "go on"},
        ]

        async def hold() -> None:  # a later turn of the conversation that runs long
            stream = await client.chat.completions.create(
                model="chat",
                messages=long,  # type: ignore[arg-type]
                max_tokens=3000,
                stream=True,
            )
            async for _ in stream:
                begun.set()

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(hold)
            with trio.fail_after(30):
                await begun.wait()  # the first runs; the others wait behind it
                while (await traffic(c))[home]["traffic"]["in_flight"] < 3:
                    await trio.sleep(0.05)  # all three sent: the bound counts each once
                await ask(client, turns[1])
            nursery.cancel_scope.cancel()
        moved, cached, _ = await turn(2)
        assert moved != home and cached == 0  # it held nothing of the conversation
        seen = await admin_metrics(c)
        assert seen("llmgw_router_affinity_total", replica=home, outcome="overruled") >= 1
        assert (await traffic(c))[home]["traffic"]["affinity_overruled"] > 0
        # moved once, it goes on where it now is held
        await ask(client, turns[2])
        after, cached, prompt = await turn(3)
        assert after == moved and cached > 0.6 * prompt


async def test_two_workers_of_a_standalone_router_send_a_conversation_to_one_replica(
    tmp_path: Path, pki: Pki
) -> None:
    """Each turn on a new connection, so the kernel hands it to either worker; the
    workers share nothing. The conversation's first choice is busy when its first turn
    comes (a long request straight to its engine), so that turn goes to the other
    replica, which only the worker that sent it knows; every later turn lands on the
    first choice, through either worker."""
    async with chats(tmp_path, pki) as (c, _, key):
        held = reserved_port()
        port = held.getsockname()[1]
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            "workers = 2\n"
            'metrics_listen = "127.0.0.1:0"\n'
            f'[router]\nlisten = "127.0.0.1:{port}"\n'
            f'[[router.keys]]\nname = "edge"\nsha256 = "{hash_key(key)}"\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        c.agents["router"] = router  # killed with the rest
        try:
            await workers_route(router, 2)
            m = await router.wait_log(r"router metrics on (http://127\.0\.0\.1:\d+/metrics)")
            metrics_url = m.group(1)
            # its workers report: the server's router stops placing new conversations
            # by its own counts, and every router goes by rendezvous alone
            await c.server.wait_log(r"affinity: standalone routers follow the routing")

            async def send(messages: list[dict[str, str]]) -> None:
                client = openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60
                )
                await ask(client, messages)
                await client.close()

            async def samples() -> Samples:
                async with httpx.AsyncClient(timeout=5) as raw:
                    return Samples.parse((await raw.get(metrics_url)).text)

            for seed in range(30, 36):  # new conversations first: even counts would differ
                await send(conversation(seed, 1)[0])
            # the kernel picks a worker by a hash of each connection's ports: 16 turns
            # left one worker a single turn once in CI (a chance of ~1 in 2000); 40
            # make that ~1 in 10^10, and the loop ends as soon as both have two
            turns = conversation(11, 40)
            anchor = prompt_key(msgspec.json.encode({"messages": turns[0]}), "prefix")
            assert anchor is not None
            views = await traffic(c)
            first = max(views, key=lambda replica: rendezvous(anchor.anchor, replica))
            [other] = set(views) - {first}

            async def running(replica: str) -> list[float]:
                """Each worker's reading of the engine's requests running there."""
                s = await samples()
                return [
                    s("llmgw_router_load", replica=replica, signal="running", worker=w)
                    for w in ("0", "1")
                ]

            # the first choice's only slot taken by a client of its engine's own, until
            # both workers have read so: the first turn goes to the other replica
            [shard] = views[first]["shards"]
            engine = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{shard['port']}/v1",
                api_key=engine_key(tmp_path, shard["node_id"], shard["shard_id"]),
                max_retries=0,
                timeout=60,
            )
            begun = trio.Event()

            async def hold() -> None:
                stream = await engine.chat.completions.create(
                    model="chat",
                    messages=conversation(12, 1)[0],  # type: ignore[arg-type]
                    max_tokens=3000,
                    stream=True,
                )
                async for _ in stream:
                    begun.set()

            before = await samples()

            def served(s: Samples, **labels: str) -> float:
                name = "llmgw_router_requests_total"
                return s(name, model="chat", **labels) - before(name, model="chat", **labels)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold)
                with trio.fail_after(30):
                    await begun.wait()
                    while min(await running(first)) < 1:
                        await trio.sleep(0.1)
                    await send(turns[0])
                nursery.cancel_scope.cancel()
            await engine.close()
            s = await samples()
            assert served(s, replica=other) == 1, "the first turn went to its first choice"
            with trio.fail_after(60):  # the engine let the held request go, and both read so
                while max(await running(first)) > 0:
                    await trio.sleep(0.1)

            before = await samples()  # the first turn's request, taken off below
            sent = 0
            for messages in turns[1:]:  # until each worker has served at least two turns
                await send(messages)
                sent += 1
                s = await samples()
                if served(s, worker="0") >= 2 and served(s, worker="1") >= 2:
                    break
            s = await samples()
            up = [s("llmgw_router_worker_up", worker=w) for w in ("0", "1")]
            assert served(s, worker="0") >= 2 and served(s, worker="1") >= 2, (sent, up)
            replicas = {
                dict(labels)["replica"]
                for (name, labels), v in s.items()
                if name == "llmgw_router_requests_total"
                and v > before.get((name, labels), 0.0)
                and ("model", "chat") in labels
            }
            assert replicas == {first}, (replicas, first)
            assert served(s, status="200") == sent

            # and the engine reused each turn's predecessor
            def grew(name: str) -> float:
                return s(name, model="chat") - before(name, model="chat")

            cached = grew("llmgw_router_prompt_tokens_cached_total")
            assert cached > 0.5 * grew("llmgw_router_prompt_tokens_total")
        finally:
            await router.stop()
            held.close()

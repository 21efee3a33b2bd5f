"""Engines are reached only through llmgw: each has its own key, which only the
agent, the control plane and the routers hold, and listens on the node's address
on the route to the control plane. Real processes: a server, an agent, llama-server."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.agent.supervisor import Supervisor, SupervisorSettings
from llmgw.config.errors import ConfigError
from llmgw.config.schema import AgentConfig, EnginesConfig
from llmgw.engines.base import with_key
from llmgw.engines.vllm import VLLM
from llmgw.http import Request, Response
from llmgw.protocol.messages import ShardSpec
from llmgw.router.app import RouterApp
from llmgw.router.balancer import RetryBudget
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.cluster.test_control_plane_processes import Cluster, engine_pid
from tests.cluster.test_router_processes import routed
from tests.conftest import Pki
from tests.engines.test_vllm import running, spec, wait_healthy, wrapper
from tests.ports import own_port
from tests.realparts import needs_server
from tests.router.test_app import serve

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def record_of(tmp: Path, node: str, shard_id: str) -> tuple[Path, dict[str, object]]:
    path = tmp / f"agent-{node}" / "shards" / f"{shard_id}.json"
    return path, json.loads(path.read_text())


async def chat_through(base: str, key: str) -> str:
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert reply.choices[0].message.content
    return reply.choices[0].message.content


async def restart_both(c: Cluster) -> str:
    """SIGKILL the agent and the server, start them again (the server on the same
    stream port): what the control plane knows now, it learns from the agent's
    registration, and the agent from its records. The router's new base URL."""
    await c.agents["n1"].stop(signal.SIGKILL)
    await c.server.stop(signal.SIGKILL)
    config = c.tmp / "server.toml"
    text = config.read_text()
    config.write_text(
        text.replace(
            'listen = "127.0.0.1:0"\nca =', f'listen = "127.0.0.1:{c.server.stream_port}"\nca =', 1
        )
    )
    c.server.start()
    await c.server.ready(count=2)
    c.agents["n1"].start()
    await c.agents["n1"].wait_log(r"adopted shard \S+ \(pid \d+\)")
    m = await c.server.wait_log(
        r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)", count=2
    )
    return m.group(1)


@needs_server
async def test_an_engine_answers_only_llmgw_and_its_key_leaks_nowhere(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki) as (c, base, key):
        [replica] = await c.wait_ready(1)
        shard = replica["shards"][0]
        port, sid = shard["port"], shard["shard_id"]
        path, record = record_of(tmp_path, "n1", sid)
        engine_key = record["engine_key"]
        assert isinstance(engine_key, str) and len(engine_key) >= 32
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        pid = engine_pid(tmp_path, "n1", sid)

        direct = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=10) as client:
            assert (
                await client.post(direct + "/v1/chat/completions", json=CHAT)
            ).status_code == 401
            # the gateway's key is the client's, not the engine's
            gateway = {"authorization": f"Bearer {key}"}
            r = await client.post(direct + "/v1/chat/completions", json=CHAT, headers=gateway)
            assert r.status_code == 401
            assert (await client.get(direct + "/metrics")).status_code == 401
            assert (await client.get(direct + "/slots")).status_code == 401
            own = {"authorization": f"Bearer {engine_key}"}
            r = await client.post(direct + "/v1/chat/completions", json=CHAT, headers=own)
            assert r.status_code == 200, r.text
        await chat_through(base, key)

        # it listens where the node reaches the control plane, not on every interface
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--host") + 1] == b"127.0.0.1"
        # the router reads the engine's load through its key: its scrapes answer
        with trio.fail_after(20):
            while True:
                [view] = await c.replicas()
                if (view.get("traffic") or {}).get("load_age_s") is not None:
                    break
                await trio.sleep(0.2)

        new_base = await restart_both(c)
        [after] = await c.wait_ready(1, adopted=True)
        assert after["replica_id"] == replica["replica_id"]
        assert engine_pid(tmp_path, "n1", sid) == pid  # the same engine, adopted
        with trio.fail_after(20):
            while True:
                try:
                    await chat_through(new_base, key)
                    break
                except openai.APIStatusError as exc:
                    # until the restarted router holds the replica again
                    if exc.status_code not in (404, 503):
                        raise
                    await trio.sleep(0.2)

        secret = engine_key.encode()
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert record_of(tmp_path, "n1", sid)[1]["engine_key"] == engine_key
        logs = [*tmp_path.glob("*.log"), *(tmp_path / "agent-n1" / "shards").glob("*.log*")]
        assert {p.name for p in logs} >= {"server.log", "agent-n1.log", f"{sid}.log"}
        for log in logs:
            assert secret not in log.read_bytes(), log
        for args in (("replicas", "--json"), ("replicas",), ("nodes", "--json"), ("status",)):
            out = await c.server.ctl(*args)
            assert secret not in out.stdout + out.stderr, args
        # no file anybody else can read holds it
        for f in tmp_path.rglob("*"):
            if f.is_file() and f.stat().st_mode & 0o044 and f.stat().st_size < 1 << 20:
                assert secret not in f.read_bytes(), f


async def test_the_vllm_stand_in_wants_the_key_on_v1_paths_only(tmp_path: Path) -> None:
    """As vLLM's AuthenticationMiddleware: with VLLM_API_KEY, /v1/* wants the key,
    /health and /metrics do not."""
    s = spec(gpus=[0], port=own_port())
    launch = with_key(
        VLLM.launch(s, {"vllm": wrapper(tmp_path / "bin", "vllm")}), "VLLM_API_KEY", "k1"
    )
    assert launch.env["VLLM_API_KEY"] == "k1" and "k1" not in launch.argv
    assert launch.health_url is not None and launch.metrics_url is not None
    base = launch.health_url.removesuffix("/health")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    async with (
        running(launch, tmp_path / "vllm.log", **env) as proc,
        httpx.AsyncClient(trust_env=False, timeout=5) as client,
    ):
        await wait_healthy(client, launch.health_url, proc)
        assert (await client.get(launch.metrics_url)).status_code == 200
        assert (await client.get(base + "/v1/models")).status_code == 401
        body = {"model": s.model, "prompt": "hi"}
        r = await client.post(base + "/v1/completions", json=body)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        wrong = {"authorization": "Bearer k2"}
        assert (await client.get(base + "/v1/models", headers=wrong)).status_code == 401
        right = {"authorization": "Bearer k1"}
        assert (await client.get(base + "/v1/models", headers=right)).status_code == 200
        r = await client.post(base + "/v1/completions", json=body, headers=right)
        assert r.status_code == 200


def test_engines_bind_where_the_agent_reaches_the_control_plane_unless_told() -> None:
    shard = ShardSpec(
        shard_id="s", replica_id="r", model="m", profile="p", engine="llama.cpp", host="0.0.0.0"
    )
    sup = Supervisor(SupervisorSettings(state_dir=Path("/nonexistent")), dict)
    assert sup.bind_address(shard) == "0.0.0.0"  # not connected yet: as the spec says
    sup.stream_address = "10.1.2.3"
    assert sup.bind_address(shard) == "10.1.2.3"
    every = Supervisor(SupervisorSettings(state_dir=Path("/x"), engine_bind="0.0.0.0"), dict)
    every.stream_address = "10.1.2.3"
    assert every.bind_address(shard) == "0.0.0.0"


def test_a_bind_that_is_no_address_is_refused_in_words() -> None:
    with pytest.raises(ConfigError, match=r"engines\.bind"):
        AgentConfig(control_plane=["cp:7000"], engines=EnginesConfig(bind="eth0")).validate()


class KeyedEngine:
    """An engine that answers only its own key, and remembers what it was sent."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.seen: list[str] = []

    async def __call__(self, request: Request) -> Response:
        auth = dict(request.headers).get("authorization", "")
        self.seen.append(auth)
        if auth != f"Bearer {self.key}":
            return Response(401, [("content-type", "application/json")], b'{"error":"no"}')
        return Response(200, [("content-type", "application/json")], b'{"choices":[]}')


async def test_the_router_sends_each_engine_its_key_and_never_the_clients(
    nursery: trio.Nursery,
) -> None:
    good, stale = KeyedEngine("k-good"), KeyedEngine("k-new")
    ports = {name: await serve(nursery, e) for name, e in (("good", good), ("stale", stale))}
    table = RoutingTable()
    client_key = "llmgw-client-key"
    app = RouterApp(table, KeyRing([ApiKey("t", hash_key(client_key))]))
    base = f"http://127.0.0.1:{await serve(nursery, app)}/v1"

    def route(name: str, key: str) -> Route:
        return Route(key=name, model="m", url=f"http://127.0.0.1:{ports[name]}", engine_key=key)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": f"Bearer {client_key}"}
    async with httpx.AsyncClient(timeout=10) as client:
        table.apply(
            Snapshot(version="1", models={"m": ModelRouting()}, routes=[route("good", "k-good")])
        )
        r = await client.post(base + "/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert good.seen == ["Bearer k-good"]
        # an engine started again under a key the router has not heard of: the
        # replica has failed, not the client's key
        table.apply(
            Snapshot(version="2", models={"m": ModelRouting()}, routes=[route("stale", "k-old")])
        )
        r = await client.post(base + "/chat/completions", json=body, headers=auth)
        assert r.status_code == 502, r.text
        assert "refused the router's key" in r.json()["error"]["message"]
        # and another replica takes the request
        table.apply(
            Snapshot(
                version="3",
                models={"m": ModelRouting()},
                routes=[route("stale", "k-old"), route("good", "k-good")],
            )
        )
        # (a request that meets the stale replica first is retried on the good one
        # within the retry budget, which the requests above spent: a fresh one here)
        app.proxy.budget = RetryBudget(min_retries=100)
        for _ in range(8):
            r = await client.post(base + "/chat/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
    assert client_key not in " ".join(good.seen + stale.seen)

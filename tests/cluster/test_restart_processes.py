"""A control-plane restart, as a standalone router's clients see it: real processes.

A server, two agents with real llama-servers and a standalone ``llmgw router``
(two workers) under steady traffic from the real openai client. The server is
restarted (SIGTERM, then kill -9) while the agent of the only replica of one
model is held (SIGSTOP) past the new control plane's settle time, then let go.
No request fails, no engine restarts, and nothing is placed a second time: the
router keeps the route of the node the new control plane has not heard from
yet, and the control plane places nothing while a node it knows from before is
neither back nor Lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import openai
import trio

from llmgw.agent.procs import alive
from llmgw.router.keys import hash_key, new_key
from tests.cluster.procs import Daemon, Server, lasting, workers_route, write_server_config
from tests.cluster.test_control_plane_processes import Cluster, engine_pid
from tests.conftest import Pki
from tests.ports import own_port
from tests.realparts import needs_server
from tools.support.tinymodel import write_model

pytestmark = needs_server

SETTLE_S = 2.0
LOST_AFTER_S = 30.0  # far beyond the time the late agent is held
HELD_S = SETTLE_S + 3.0  # past the settle time of the control plane that comes back


def _catalog(model: Path) -> str:
    """``tiny`` anywhere (it lands on n1, the first node up), ``other`` on n2 only."""
    settings = "settings = { context = 512, parallel = 1, threads = 1, threads_batch = 1 }"
    return "".join(
        f"""
[models.{name}]
replicas = 1
[[models.{name}.profiles]]
name = "cpu"
engine = "llama.cpp"
gpus = 1
min_memory_gb = 4
model_path = "{model}"
{settings}
startup_timeout_s = 60
{selector}
"""
        for name, selector in (("tiny", ""), ("other", 'selector = { rack = "r1" }'))
    )


@attrs.define
class Traffic:
    """Chats to both models through the router until stopped: each outcome kept."""

    base: str
    key: str
    ok: int = 0
    failed: list[str] = attrs.Factory(list)
    _stop: trio.Event = attrs.Factory(trio.Event)

    async def run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.base, api_key=self.key, max_retries=0)
        while not self._stop.is_set():
            for model in ("tiny", "other"):
                try:
                    reply = await client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=4,
                        timeout=15,
                    )
                    assert reply.choices[0].message.content is not None
                    self.ok += 1
                except (openai.APIError, AssertionError) as exc:
                    self.failed.append(f"{trio.current_time():.1f} {model}: {exc!r}")
                await trio.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()


@asynccontextmanager
async def fleet(tmp_path: Path, pki: Pki) -> AsyncIterator[tuple[Cluster, Daemon, Traffic]]:
    """The fleet, ports fixed (a restarted server listens where it did), serving both
    models through a standalone router, with traffic going."""
    model = tmp_path / "tiny.gguf"
    write_model(model, ends_after=4, context_length=512)
    (tmp_path / "catalog.toml").write_text(_catalog(model))
    admin = own_port()
    config = write_server_config(
        tmp_path,
        pki,
        stream_port=own_port(),
        heartbeat=0.2,
        unreachable_after=2,
        lost_after=LOST_AFTER_S,
    )
    text = config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{admin}"')
    config.write_text(f'catalog = "catalog.toml"\n{text}[reconcile]\nsettle_s = {SETTLE_S}\n')
    server = Server("server", ["server", "--config", "server.toml"], tmp_path)
    c = Cluster(tmp_path, pki, server)
    key = new_key()
    port = own_port()
    (tmp_path / "router.toml").write_text(
        f'admin_url = "http://127.0.0.1:{admin}"\n'
        'admin_token_file = "state/admin-token"\n'
        "workers = 2\n"
        f'[router]\nlisten = "127.0.0.1:{port}"\n'
        f'[[router.keys]]\nname = "client"\nsha256 = "{hash_key(key)}"\n'
    )
    router = Daemon("router", ["router", "--config", "router.toml"], tmp_path)
    traffic = Traffic(f"http://127.0.0.1:{port}/v1", key)
    try:
        server.start()
        await server.ready()
        c.agent("n1")
        await c.wait_ready(1, model="tiny")
        c.agent("n2")
        await c.wait_ready(2)
        c.agents["router"] = router.start()  # killed with the rest
        await workers_route(router, 2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(traffic.run)
            yield c, router, traffic
            traffic.stop()
    finally:
        if router.returncode() is None and router.proc is not None:
            with trio.move_on_after(5):  # SIGTERM: its first worker stops the other
                await router.stop(signal.SIGTERM)
        for d in [server, *c.agents.values()]:
            d.kill()
        for record in tmp_path.glob("agent-*/shards/*.json"):
            try:
                os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError, KeyError):
                pass


async def _engines(c: Cluster) -> dict[str, tuple[str, int, object]]:
    """replica id -> (model, engine pid, what stays while it is the same process)."""
    out = {}
    for r in await c.replicas():
        shard = r["shards"][0]
        pid = engine_pid(c.tmp, shard["node_id"], shard["shard_id"])
        out[r["replica_id"]] = (r["model"], pid, lasting(pid))
    return out


async def test_a_restarted_control_plane_fails_no_request_restarts_no_engine_places_nothing(
    tmp_path: Path, pki: Pki
) -> None:
    async with fleet(tmp_path, pki) as (c, router, traffic):
        before = await _engines(c)
        assert sorted(m for m, _, _ in before.values()) == ["other", "tiny"]
        await trio.sleep(1)
        for restart, sig in enumerate((signal.SIGTERM, signal.SIGKILL), start=2):
            late = c.agents["n1"]  # the agent of tiny's only replica
            assert late.proc is not None
            late.proc.send_signal(signal.SIGSTOP)
            try:
                await c.server.stop(sig)
                await trio.sleep(0.5)  # down a while: the router routes on
                c.server.start()
                await c.server.ready(count=restart)
                await c.server.wait_node("n2", "Ready")
                await trio.sleep(HELD_S)  # past the settle time, n1 still away
                # what ctl nodes says of it meanwhile
                table = (await c.server.ctl("nodes")).stdout.decode()
                [row] = [line.split() for line in table.splitlines() if line.startswith("n1 ")]
                assert row[1:3] == ["-", "Unreachable,awaited"], table
            finally:
                late.proc.send_signal(signal.SIGCONT)
            await c.server.wait_node("n1", "Ready", timeout=30)
            await c.wait_ready(2)
            await trio.sleep(1)
        after = await _engines(c)
        assert all(alive(pid) for _, pid, _ in after.values())
        failed, ok = list(traffic.failed), traffic.ok
    assert failed == [], (
        f"{len(failed)} of {ok + len(failed)} failed:\n"
        + "\n".join(failed[:20])
        + f"\n--- router log:\n{router.log()[-4000:]}"
    )
    assert ok > 50
    # nothing placed a second time: the same replicas, on the same engines
    assert after == before, f"{before}\n{after}\n{c.server.log()}"
    restarted = "".join(c.server.log().split("agent stream listening")[2:])
    assert re.search(r": placed \S+: ", restarted) is None, restarted
    # said once each, where the operator reads: the control plane waited for n1
    assert c.server.log().count("expecting 2 nodes from before this start (n1, n2)") == 2
    assert "keeping 1 routes the control plane does not list yet" in router.log()
    assert "every node from before this start is back: placement goes on" in c.server.log()

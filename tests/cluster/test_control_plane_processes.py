"""Placement and reconciliation with real processes: a server with a catalog, agents with
discovery overrides (fake GPUs, memory, labels), and real llama-server engines."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from llmgw.agent.procs import alive
from tests.cluster.procs import Daemon, Server, lasting, write_agent_config, write_server_config
from tests.conftest import Pki
from tests.realparts import LLAMA_SERVER, needs_server
from tools.support.tinymodel import write_model

pytestmark = needs_server

BASE = 23000 + (os.getpid() % 200) * 20  # engine ports: n1 gets BASE.., n2 BASE+10..


def catalog(model: Path, replicas: int = 1, context: int = 512) -> str:
    return f"""
[models.tiny]
replicas = {replicas}
[[models.tiny.profiles]]
name = "cpu"
engine = "llama.cpp"
gpus = 1
min_memory_gb = 4
model_path = "{model}"
settings = {{ context = {context}, parallel = 1, threads = 1, threads_batch = 1 }}
startup_timeout_s = 60

[models.huge]
replicas = 0
[[models.huge.profiles]]
name = "big"
engine = "llama.cpp"
min_memory_gb = 1000
model_path = "{model}"
"""


@attrs.define
class Cluster:
    tmp: Path
    pki: Pki
    server: Server
    agents: dict[str, Daemon] = attrs.Factory(dict)

    async def restart_server(self) -> None:
        """SIGKILL the control plane and start it again on the same stream port, with
        a 2 s settle time: what it knew is gone, the agents and engines are not."""
        port = self.server.stream_port
        await self.server.stop(signal.SIGKILL)
        write_server_config(
            self.tmp, self.pki, stream_port=port, heartbeat=0.2, unreachable_after=2, lost_after=6
        )
        config = self.tmp / "server.toml"
        config.write_text(
            'catalog = "catalog.toml"\n' + config.read_text() + "[reconcile]\nsettle_s = 2\n"
        )
        self.server.start()
        await self.server.ready(count=2)

    def agent(
        self, node: str, *, memory_gb: int = 16, more: str = "", env: dict[str, str] | None = None
    ) -> Daemon:
        """``more``: further sections of the agent's config (``[metrics]``, say); ``env``:
        over the agent's environment (a ``PATH`` with an engine's stand-in, say)."""
        i = int(node[1:]) - 1
        low = BASE + 10 * i
        extra = (
            f'[engines]\nllama_server = "{LLAMA_SERVER}"\nport_range = [{low}, {low + 9}]\n'
            "stop_grace_s = 5\n"
            '[discovery]\nnvidia_smi = "/nonexistent"\n' + more
        )
        config = write_agent_config(self.tmp, self.pki, node, self.server.stream_port, extra=extra)
        text = config.read_text().replace(
            "[backoff]",
            f'[inventory]\nmemory_gb = {memory_gb}\nlabels = {{ rack = "r{i}" }}\n'
            'gpus = [{ index = 0, name = "FAKE" }, { index = 1, name = "FAKE" }]\n[backoff]',
        )
        config.write_text(text)
        d = Daemon(f"agent-{node}", ["agent", "--config", config.name], self.tmp, env=env)
        self.agents[node] = d.start()
        return d

    async def replicas(self) -> list[dict[str, Any]]:
        out = await self.server.ctl("replicas", "--json")
        replicas: list[dict[str, Any]] = json.loads(out.stdout)["replicas"]
        return replicas

    async def wait_ready(
        self, n: int = 1, timeout: float = 60, **match: Any
    ) -> list[dict[str, Any]]:
        with trio.move_on_after(timeout):
            while True:
                ready = [
                    r
                    for r in await self.replicas()
                    if r["state"] == "Ready"
                    and not r["leaving"]
                    and all(r.get(k) == v for k, v in match.items())
                ]
                if len(ready) >= n:
                    return ready
                await trio.sleep(0.2)
        raise AssertionError(f"no {n} Ready replicas: {await self.replicas()}\n{self.server.log()}")


@asynccontextmanager
async def cluster(
    tmp_path: Path,
    pki: Pki,
    replicas: int = 1,
    *,
    ends_after: int | None = 4,
    context: int = 512,
    extra_catalog: str = "",
    server_extra: str = "",
    settle_s: float = 2,
    log_level: str = "info",
    server_nofile: int | None = None,
) -> AsyncIterator[Cluster]:
    """A server with the tiny model in its catalog; agents are added by the test.
    ``server_nofile``: the server's open-files limit, when lowered."""
    model = tmp_path / "tiny.gguf"
    write_model(model, ends_after=ends_after, context_length=context)
    (tmp_path / "catalog.toml").write_text(catalog(model, replicas, context) + extra_catalog)
    config = write_server_config(tmp_path, pki, heartbeat=0.2, unreachable_after=2, lost_after=6)
    config.write_text(
        f'catalog = "catalog.toml"\nlog_level = "{log_level}"\n'
        + config.read_text()
        + f"[reconcile]\nsettle_s = {settle_s}\n"
        + server_extra
    )
    server = Server("server", ["server", "--config", "server.toml"], tmp_path)
    server.nofile = server_nofile
    c = Cluster(tmp_path, pki, server)
    try:
        server.start()
        await server.ready()
        yield c
    finally:
        for d in [server, *c.agents.values()]:
            d.kill()
        # engines outlive their agents by design; a test must not leave any behind
        for record in tmp_path.glob("agent-*/shards/*.json"):
            pid = json.loads(record.read_text())["pid"]
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def engine_pid(tmp: Path, node: str, shard_id: str) -> int:
    record = json.loads((tmp / f"agent-{node}" / "shards" / f"{shard_id}.json").read_text())
    return int(record["pid"])


def engine_key(tmp: Path, node: str, shard_id: str) -> str:
    """The key the shard's engine wants, from its agent's record ("" without one)."""
    path = tmp / f"agent-{node}" / "shards" / f"{shard_id}.json"
    try:
        return str(json.loads(path.read_text()).get("engine_key", ""))
    except FileNotFoundError:
        return ""


async def chat(tmp: Path, shard: dict[str, Any]) -> None:
    """A chat straight to a shard's engine (as in ``ctl replicas --json``), with its key."""
    key = engine_key(tmp, shard["node_id"], shard["shard_id"])
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            f"http://127.0.0.1:{shard['port']}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            headers={"authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200, r.text


async def test_placed_then_adopted_across_a_control_plane_restart(tmp_path: Path, pki: Pki) -> None:
    async with cluster(tmp_path, pki, replicas=2) as c:
        c.agent("n1")
        c.agent("n2")
        before = await c.wait_ready(2)
        pids = {
            r["replica_id"]: engine_pid(
                tmp_path, r["shards"][0]["node_id"], r["shards"][0]["shard_id"]
            )
            for r in before
        }
        starts = {pid: lasting(pid) for pid in pids.values()}
        for r in before:
            await chat(tmp_path, r["shards"][0])

        await c.restart_server()
        after = await c.wait_ready(2)
        assert {r["replica_id"] for r in after} == set(pids)  # the same replicas came back
        assert all(r["adopted"] for r in after)
        assert len(await c.replicas()) == 2  # and nothing else was placed
        assert {pid: lasting(pid) for pid in pids.values()} == starts  # no engine restarted
        held = [(r["shards"][0]["node_id"], g) for r in after for g in r["shards"][0]["gpus"]]
        assert len(held) == len(set(held))  # no GPU allocated twice


async def test_an_agent_back_with_nothing_running_has_its_replica_let_go_and_replaced(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        [replica] = await c.wait_ready(1)
        shard = replica["shards"][0]
        pid = engine_pid(tmp_path, "n1", shard["shard_id"])
        await c.agents["n1"].stop(signal.SIGKILL)
        os.killpg(pid, signal.SIGKILL)  # the engine died with it
        for f in (tmp_path / "agent-n1" / "shards").glob("*"):
            f.unlink()  # and the node came back with nothing
        c.agents["n1"].start()
        await c.server.wait_log(r"let go of shard .* on n1: the agent does not report it")
        [new] = await c.wait_ready(1, timeout=90)
        assert new["replica_id"] != replica["replica_id"]
        await chat(tmp_path, new["shards"][0])
        assert not alive(pid)


async def test_draining_a_node_under_traffic_moves_the_replica_and_fails_no_request(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        [first] = await c.wait_ready(1)
        old_node = first["shards"][0]["node_id"]
        c.agent("n2")
        await c.server.wait_node("n2", "Ready")
        sent, failed = 0, []
        done = trio.Event()

        async def traffic() -> None:
            """What a router does: pick a Ready replica, retry elsewhere before the first byte."""
            nonlocal sent
            async with httpx.AsyncClient(timeout=10) as client:
                while not done.is_set():
                    ok, ports = False, []
                    for _attempt in range(3):  # a router's attempts, each on a fresh table
                        shards = [
                            s
                            for r in await c.replicas()
                            if r["state"] == "Ready"
                            for s in r["shards"]
                        ]
                        ports = [s["port"] for s in shards]
                        for s in shards:
                            key = engine_key(tmp_path, s["node_id"], s["shard_id"])
                            if not key:
                                continue  # gone with its shard: nothing sent yet
                            try:
                                r = await client.post(
                                    f"http://127.0.0.1:{s['port']}/v1/chat/completions",
                                    json={
                                        "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 8,
                                    },
                                    headers={"authorization": f"Bearer {key}"},
                                )
                            except httpx.ConnectError:
                                continue  # nothing sent yet: safe to try the next replica
                            if r.status_code in (502, 503, 504):
                                continue  # an engine stopping says so before any answer
                            ok = r.status_code == 200
                            break
                        if ok:
                            break
                    sent += 1
                    if not ok:
                        failed.append(ports)
                    await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(traffic)
            await trio.sleep(0.5)
            await c.server.ctl("drain", old_node)
            with trio.fail_after(90):
                while True:
                    replicas = await c.replicas()
                    where = [(s["node_id"], r["state"]) for r in replicas for s in r["shards"]]
                    if where == [("n2" if old_node == "n1" else "n1", "Ready")]:
                        break
                    await trio.sleep(0.2)
            await trio.sleep(1.0)  # and the new replica serves on its own
            # each round asks `ctl replicas` (a process: most of a second on a busy
            # machine), so a quick move may see few rounds: let a few more run
            with trio.fail_after(60):
                while sent < 5:
                    await trio.sleep(0.1)
            done.set()
        assert sent >= 5
        assert failed == []
        nodes = await c.server.nodes()
        assert nodes[old_node]["draining"] is True


async def test_explain_placement_says_where_replicas_run_apart_from_where_a_new_one_goes(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1", memory_gb=16)
        c.agent("n2", memory_gb=32)
        await c.server.wait_node("n1", "Ready")
        await c.server.wait_node("n2", "Ready")
        (ready,) = await c.wait_ready(1)
        (here,) = {s["node_id"] for s in ready["shards"]}
        other = ({"n1", "n2"} - {here}).pop()

        text = (await c.server.ctl("explain-placement", "tiny")).stdout.decode()
        lines = text.splitlines()
        assert lines[0] == "Running now: 1 replica", text
        assert lines[1].split() == ["REPLICA", "PROFILE", "STATE", "NODES"], text
        assert lines[2].split() == [ready["replica_id"], "cpu", "Ready", here], text
        assert lines[3] == ""
        # the replicas of a model spread: a new one would go to the other node
        assert lines[4] == f"A new replica would go: on {other} (profile cpu)", text
        assert lines[5].split() == ["NODE", "PROFILE", "FITS", "WHY"], text
        assert {line.split()[0] for line in lines[6:8]} == {"n1", "n2"}, text
        # then what a replica needs of a node's memory, and why
        assert lines[8:] == [
            "A replica of profile cpu needs of each node's memory: 4 GiB (min_memory_gb)"
        ], text

        as_json = json.loads((await c.server.ctl("explain-placement", "tiny", "--json")).stdout)
        assert as_json["running"] == [
            {
                "replica_id": ready["replica_id"],
                "profile": "cpu",
                "state": "Ready",
                "leaving": False,
                "nodes": [here],
            }
        ]
        assert as_json["model"] == "tiny" and as_json["profile"] == "cpu"
        assert [s["node_id"] for s in as_json["shards"]] == [other]
        assert {x["node_id"] for x in as_json["candidates"]} == {"n1", "n2"}

        # a model with no replica that no node can hold: both said, memory in GiB
        text = (await c.server.ctl("explain-placement", "huge")).stdout.decode()
        lines = text.splitlines()
        assert lines[0] == "Running now: 0 replicas", text
        assert lines[2].startswith("A new replica would go: nowhere; no node can hold huge: "), text
        assert "n1: has 16 GiB of memory, needs 1000 GiB" in lines[2], text
        assert "has 32 GiB of memory, needs 1000 GiB" in text, text
        assert (
            json.loads((await c.server.ctl("explain-placement", "huge", "--json")).stdout)[
                "running"
            ]
            == []
        )

        assert "n1" in text and "has 16 GiB of memory, needs 1000 GiB" in text, text
        assert "n2" in text and "has 32 GiB of memory, needs 1000 GiB" in text, text
        as_json = json.loads((await c.server.ctl("explain-placement", "huge", "--json")).stdout)
        assert as_json["profile"] is None
        assert {x["node_id"] for x in as_json["candidates"]} == {"n1", "n2"}
        result = await c.server.ctl("explain-placement", "nope", check=False)
        assert result.returncode == 2
        assert "no model 'nope' in the catalog" in result.stderr.decode()

        nodes = (await c.server.ctl("nodes")).stdout.decode()
        assert " 16 GiB " in nodes and " 32 GiB " in nodes, nodes


@pytest.fixture(autouse=True)
def _no_leftover_engines() -> None:
    return None


async def test_operator_surface_reload_cordon_survives_restart_and_metrics(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        c.agent("n2")
        await c.wait_ready(1)
        # cordon is the operator's intent: it survives a control plane restart
        assert "cordoned" in (await c.server.ctl("cordon", "n2")).stdout.decode()
        # more replicas, by editing the catalog and reloading it without a restart
        catalog_path = tmp_path / "catalog.toml"
        catalog_path.write_text(catalog_path.read_text().replace("replicas = 1", "replicas = 2", 1))
        assert "catalog reloaded" in (await c.server.ctl("reload")).stdout.decode()
        both = await c.wait_ready(2)
        assert {s["node_id"] for r in both for s in r["shards"]} == {"n1"}  # n2 is cordoned
        table = (await c.server.ctl("replicas")).stdout.decode()
        assert table.splitlines()[0].split() == [
            "REPLICA",
            "MODEL",
            "PROFILE",
            "STATE",
            "FOR",
            "SHARDS",
        ]
        assert table.count(" Ready ") == 2
        # a bad catalog changes nothing and says why
        catalog_path.write_text(
            catalog_path.read_text().replace('engine = "llama.cpp"', 'engine = "llama"', 1)
        )
        bad = await c.server.ctl("reload", check=False)
        assert bad.returncode == 2
        assert "catalog not reloaded, nothing changed" in bad.stderr.decode()
        assert "'llama' is not one of" in bad.stderr.decode()

        port = c.server.stream_port
        await c.server.stop(signal.SIGTERM)
        write_server_config(
            tmp_path, pki, stream_port=port, heartbeat=0.2, unreachable_after=2, lost_after=6
        )
        config = tmp_path / "server.toml"
        catalog_path.write_text(
            catalog_path.read_text().replace('engine = "llama"', 'engine = "llama.cpp"')
        )
        config.write_text(
            'catalog = "catalog.toml"\n' + config.read_text() + "[reconcile]\nsettle_s = 2\n"
        )
        c.server.start()
        await c.server.ready(count=2)
        node = await c.server.wait_node("n2", "Ready")
        assert node["cordoned"] is True
        nodes_table = (await c.server.ctl("nodes")).stdout.decode()
        assert "Ready,cordoned" in nodes_table

        metrics = await c.server.metrics()
        for name in (
            'llmgw_replicas{model="tiny",state="Ready"}',
            'llmgw_nodes{state="Ready"}',
            "llmgw_reconcile_pass_seconds_bucket",
            "llmgw_agent_stream_connects_total",
            "# TYPE llmgw_commands_dispatched_total counter",
            "# TYPE llmgw_placement_failures_total counter",
        ):
            assert name in metrics, name

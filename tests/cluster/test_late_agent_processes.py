"""An agent that comes back after a restarted control plane declared its node Lost (the
lost-node timeout, counted from the control plane's start): real processes. Until then
the control plane waits for the node; then it places a replacement for the replica it
has not heard of; when the late agent registers with the engine that serves, two
copies count for one wanted, and the one that serves must stay."""

from __future__ import annotations

import signal
from pathlib import Path

import trio

from llmgw.agent.procs import alive
from tests.cluster.procs import lasting
from tests.cluster.test_control_plane_processes import chat, cluster, engine_pid
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


async def test_a_late_agent_keeps_its_serving_engine_and_the_replacement_goes(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        [serving] = await c.wait_ready(1)
        assert serving["shards"][0]["node_id"] == "n1"
        shard_id = serving["shards"][0]["shard_id"]
        pid = engine_pid(tmp_path, "n1", shard_id)
        start = lasting(pid)
        c.agent("n2")
        await c.server.wait_node("n2", "Ready")

        # the control plane restarts, and n1's agent stays away until n1 is Lost
        await c.agents["n1"].stop(signal.SIGKILL)  # its engine keeps serving
        await c.restart_server()
        await c.server.wait_log(r"node n1 is Lost \(was Unreachable\)", timeout=30)
        # a replacement is placed on n2 once n1 is Lost; it comes up there
        [replacement] = await c.wait_ready(1, timeout=60)
        assert replacement["shards"][0]["node_id"] == "n2"

        c.agents["n1"].start()  # late: it adopts the engine and registers it, serving
        await c.server.wait_log(rf"adopted replica {serving['replica_id']} from n1", timeout=30)
        with trio.move_on_after(30):
            while True:
                replicas = {r["replica_id"]: r for r in await c.replicas()}
                if replacement["replica_id"] not in replicas:
                    break
                await trio.sleep(0.2)
        assert replacement["replica_id"] not in replicas, f"{replicas}\n{c.server.log()}"
        kept = replicas[serving["replica_id"]]
        assert kept["state"] == "Ready" and not kept["leaving"], replicas
        assert alive(pid) and lasting(pid) == start  # the engine that served was not touched
        await chat(tmp_path, kept["shards"][0])
        assert list(replicas) == [serving["replica_id"]]

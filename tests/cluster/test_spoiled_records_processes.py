"""An engine whose records are both spoiled, with real processes: a server, an agent,
llama-server.

The restarted agent cannot describe the engine (no readable record says which
replica it is), so it does not report it, and it does not kill it either (its tag
says this agent started it). The control plane lets the replica go and places a
new one: on a port the orphan does not hold, once, not on the orphan's port after
every failure."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio

from llmgw.agent.procs import alive, identity
from tests.cluster.test_control_plane_processes import chat, cluster, engine_pid
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


async def test_a_new_replica_is_placed_beside_an_engine_no_record_describes(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        agent = c.agent("n1")
        [first] = await c.wait_ready(1)
        sid, port = first["shards"][0]["shard_id"], first["shards"][0]["port"]
        orphan = engine_pid(tmp_path, "n1", sid)
        before = identity(orphan)
        try:
            await agent.stop(signal.SIGKILL)
            shards = tmp_path / "agent-n1" / "shards"
            (shards / f"{sid}.json").write_bytes(b"{")
            (shards / f"{sid}.json.prev").write_bytes(b"")
            agent.start()
            await agent.wait_log(rf"pid {orphan} is an engine this agent started for shard {sid}")

            new = None
            with trio.fail_after(60):
                while new is None and "is held by pid" not in c.server.log():
                    new = next(
                        (
                            r
                            for r in await c.replicas()
                            if r["state"] == "Ready" and r["replica_id"] != first["replica_id"]
                        ),
                        None,
                    )
                    await trio.sleep(0.2)
            held = [x for x in c.server.log().splitlines() if "is held by pid" in x]
            assert not held, held[0]
            assert new is not None
            shard = new["shards"][0]
            assert shard["node_id"] == "n1" and shard["port"] != port, new
            await chat(tmp_path, shard)

            # once, not again and again; the orphan is left serving, as it was
            await trio.sleep(3)
            placed = [x for x in c.server.log().splitlines() if "placed tiny-" in x]
            assert len(placed) == 2, placed
            assert [r["replica_id"] for r in await c.replicas()] == [new["replica_id"]]
            assert alive(orphan) and identity(orphan) == before
            # said once in the server's log, and where ctl shows the node
            said = [x for x in c.server.log().splitlines() if "held by processes it" in x]
            assert len(said) == 1 and said[0].endswith(
                f"node n1 has engine ports held by processes it does not run: {port}; "
                "nothing is placed on them (ctl nodes says who holds them)"
            ), said
            nodes = (await c.server.ctl("nodes")).stdout.decode()
            assert (
                f"warning: n1: port {port} is held by pid {orphan}, an engine this agent "
                f"started for shard {sid} that no readable record describes; stop it "
                f"(kill -TERM -- -{orphan}) to free the port" in nodes
            ), nodes

            # stopped by hand, as the words say: the port is free again, and said so
            os.killpg(orphan, signal.SIGTERM)
            await c.server.wait_log(
                r"node n1 has no engine port held by a process it does not run any more"
            )
        finally:
            try:
                os.killpg(orphan, signal.SIGKILL)  # no readable record names it for cleanup
            except ProcessLookupError:
                pass

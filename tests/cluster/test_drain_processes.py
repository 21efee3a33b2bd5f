"""Draining a node with real processes and the real CLI: the replica moves, the node
reads Drained as soon as nothing runs there (not at the end of the drain grace), and
`ctl drain --wait` says how it goes and how it ended."""

from __future__ import annotations

import json
import re
from pathlib import Path

import trio

from tests.cluster.test_control_plane_processes import cluster
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


async def test_drained_node_reads_drained_long_before_the_grace_and_wait_exits_0(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        [first] = await c.wait_ready(1)
        old = first["shards"][0]["node_id"]
        new = "n2" if old == "n1" else "n1"
        c.agent(new)
        await c.server.wait_node(new, "Ready")
        table = (await c.server.ctl("nodes")).stdout.decode()
        row = next(line for line in table.splitlines() if line.startswith(old + " "))
        assert row.split()[2:4] == ["Ready", "1"], table  # STATE, SHARDS
        with trio.fail_after(30):  # the drain grace is 120 s: well before it
            done = await c.server.ctl("drain", old, "--wait", "--timeout", "30", check=False)
        out = done.stdout.decode()
        assert done.returncode == 0, (out, done.stderr.decode(), c.server.log())
        assert f"{old}: 1 replicas left, 0 moved" in out, out
        assert f"node {old} drained: nothing runs there" in out, out
        nodes = await c.server.nodes()
        assert nodes[old]["drained"] is True
        assert nodes[old]["shards"] == 0
        table = (await c.server.ctl("nodes")).stdout.decode()
        row = next(line for line in table.splitlines() if line.startswith(old + " "))
        assert row.split()[2:4] == ["Ready,Drained", "0"], table
        where = [(s["node_id"], r["state"]) for r in await c.replicas() for s in r["shards"]]
        assert where == [(new, "Ready")]
        await trio.sleep(1.5)  # a few passes more: the line is said once
        log = c.server.log()
        assert len(re.findall(rf"node {old} drained: nothing runs there", log)) == 1, log
        assert "drain grace over" not in log
        # uncordon ends it: the node is a plain Ready node again
        await c.server.ctl("uncordon", old)
        node = (await c.server.nodes())[old]
        assert (node["draining"], node["drained"], node["cordoned"]) == (False, False, False)


async def test_drain_wait_with_nowhere_to_move_times_out_saying_what_still_runs(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        [replica] = await c.wait_ready(1)
        with trio.fail_after(30):
            done = await c.server.ctl(
                "drain", "n1", "--wait", "--timeout", "3", "--json", check=False
            )
        assert done.returncode != 0
        assert json.loads(done.stdout)["message"].startswith("node n1 draining")
        err = done.stderr.decode()
        assert "n1: 1 replicas left, 0 moved" in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("llmgw ctl drain: node n1 is not drained after 3 s"), err
        assert f"replica {replica['replica_id']} (tiny, Ready" in last, err
        assert not (await c.server.nodes())["n1"]["drained"]


async def test_drain_wait_waits_as_long_as_the_servers_drain_can_take(
    tmp_path: Path, pki: Pki
) -> None:
    """Without --timeout, `ctl drain --wait` waits for the server's longest drain (its
    drain grace, drain timeout and stop timeout) and a margin, not a fixed 300 s that a
    forced drain outlasts."""
    # the cluster's [reconcile] table goes on with these keys
    longer = "drain_grace_s = 400\ndrain_timeout_s = 150\n"
    async with cluster(tmp_path, pki, server_extra=longer) as c:
        c.agent("n1")
        [replica] = await c.wait_ready(1)
        c.agent("n2")
        await c.server.wait_node("n2", "Ready")
        with trio.fail_after(30):
            done = await c.server.ctl("drain", "n2", "--wait", "--json", check=False)
        assert done.returncode == 0, (done.stdout, done.stderr.decode())
        assert json.loads(done.stdout)["drain_bound_s"] == 400 + 150 + 60
        err = done.stderr.decode()
        first = err.splitlines()[0]
        assert first.startswith("waiting up to 670 s for n2 to drain"), err
        assert "node n2 drained: nothing runs there" in err, err
        # --timeout still wins
        done = await c.server.ctl("drain", "n1", "--wait", "--timeout", "1", check=False)
        assert done.returncode != 0
        out = done.stdout.decode()
        assert "waiting up to" not in out, out
        assert f"replica {replica['replica_id']}" in done.stderr.decode()

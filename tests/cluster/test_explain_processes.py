"""`llmgw ctl explain-placement` through real processes: where a model's replicas run
now, apart from where a new one would go; memory in GiB, with its unit, everywhere."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cluster.test_control_plane_processes import cluster
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


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
        assert {line.split()[0] for line in lines[6:]} == {"n1", "n2"}, text

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

        nodes = (await c.server.ctl("nodes")).stdout.decode()
        assert " 16 GiB " in nodes and " 32 GiB " in nodes, nodes

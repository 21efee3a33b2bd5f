"""Memory is accounted through real processes: two agents with 12 GiB each, a model of
two llama.cpp replicas whose need (the tiny model's weights and KV cache, and
llama-server's default 8 GiB prompt cache) is more than half a node. They land on two
nodes, though the weights are on one, and `ctl explain-placement` says what is held."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.cluster.test_control_plane_processes import cluster
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


def pair(model: Path) -> str:
    return f"""
[models.pair]
replicas = 2
[[models.pair.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "{model}"
settings = {{ context = 512, parallel = 1, threads = 1, threads_batch = 1 }}
startup_timeout_s = 60
"""


async def test_two_replicas_needing_more_than_half_a_node_land_on_two_nodes(
    tmp_path: Path, pki: Pki
) -> None:
    # the cluster's own tiny model wants no replica here; "pair" wants two
    async with cluster(tmp_path, pki, replicas=0, extra_catalog=pair(tmp_path / "tiny.gguf")) as c:
        none = tmp_path / "none"
        # n1 holds the weights (placement prefers it); n2 must fetch them
        c.agent(
            "n1", memory_gb=12, more=f'[weights]\ndirs = ["{tmp_path}"]\ndefault_dir = "{none}"\n'
        )
        c.agent("n2", memory_gb=12, more=f'[weights]\ndefault_dir = "{none}"\n')
        await c.server.wait_node("n1", "Ready")
        await c.server.wait_node("n2", "Ready")
        ready = await c.wait_ready(2, model="pair")
        nodes = sorted(s["node_id"] for r in ready for s in r["shards"])
        assert nodes == ["n1", "n2"], (nodes, c.server.log())

        out = (await c.server.ctl("explain-placement", "pair")).stdout.decode()
        rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("n")}
        # a third would fit nowhere: each node has one replica's need held
        for node in ("n1", "n2"):
            assert re.search(
                r"has 12 GiB, 8\.1 GiB held by 1 replica, needs 8\.1 GiB", rows[node]
            ), out
        assert (
            "A replica of profile cpu needs of each node's memory: 8.1 GiB: weights 0.1,"
            " KV cache 0.1 (512 tokens, f16/f16), prompt cache 8"
        ) in out, out
        as_json = json.loads((await c.server.ctl("explain-placement", "pair", "--json")).stdout)
        [n1] = [x for x in as_json["candidates"] if x["node_id"] == "n1"]
        assert n1["memory_bytes"] == 12 << 30
        assert n1["held_by"] == 1
        assert n1["held_bytes"] == n1["need_bytes"] > 8 << 30
        assert n1["ok"] is False and n1["kind"] == "memory"

"""`ctl models` and `ctl replicas --failures` with real processes: an engine that exits at
once leaves its failure visible after its replica is gone, and a model no node can hold
says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tests.cluster.test_control_plane_processes import Cluster, cluster
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


def extra(model: Path) -> str:
    """A model whose engine refuses its arguments (it exits at once), and one too big."""
    return f"""
[models.broken]
replicas = 1
[[models.broken.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "{model}"
engine_args = ["--llmgw-no-such-flag"]
settings = {{ context = 512, parallel = 1, threads = 1, threads_batch = 1 }}
startup_timeout_s = 60

[models.toobig]
replicas = 1
[[models.toobig.profiles]]
name = "big"
engine = "llama.cpp"
min_memory_gb = 1000
model_path = "/nonexistent/llmgw-test/big.gguf"
"""


async def models(c: Cluster) -> dict[str, dict[str, Any]]:
    out = await c.server.ctl("models", "--json")
    return {m["model"]: m for m in json.loads(out.stdout)["models"]}


async def test_a_failed_engine_stays_visible_and_an_unplaceable_model_says_why(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki, extra_catalog=extra(tmp_path / "tiny.gguf")) as c:
        c.agent("n1")
        await c.wait_ready(model="tiny")
        failure: dict[str, Any] | None = None
        crash_loop_seen = False
        gone = False
        with trio.move_on_after(60):
            while not (failure and gone and crash_loop_seen):
                view = await models(c)
                broken = view["broken"]
                crash_loop_seen |= broken["retry_in_s"] is not None
                if broken["failures"]:
                    failure = broken["failures"][-1]  # the first one kept
                    ids = {r["replica_id"] for r in await c.replicas()}
                    gone = failure["replica_id"] not in ids
                await trio.sleep(0.2)
        log = c.server.log()
        assert failure is not None, f"no failure kept: {await models(c)}\n{log}"
        assert gone, f"the failed replica {failure['replica_id']} is still listed\n{log}"
        assert crash_loop_seen, f"never waiting to retry: {await models(c)}"
        assert failure["node_id"] == "n1"
        assert failure["exit_code"] not in (None, 0), failure
        assert "exited with code" in failure["reason"], failure
        assert failure["output_tail"], failure  # llama-server said why it could not load

        view = await models(c)
        assert view["tiny"]["ready"] == 1 and view["tiny"]["wanted"] == 1, view["tiny"]
        assert view["tiny"]["nodes"] == ["n1"] and not view["tiny"]["failures"]
        toobig = view["toobig"]
        assert toobig["ready"] == 0 and toobig["wanted"] == 1
        assert toobig["cannot_place"], toobig
        # placement's own words, as `ctl explain-placement` gives them
        explained = json.loads((await c.server.ctl("explain-placement", "toobig", "--json")).stdout)
        assert toobig["cannot_place"] == explained["summary"], (toobig, explained)

        table = (await c.server.ctl("models")).stdout.decode()
        rows = {line.split()[0]: line for line in table.splitlines()[1:] if line.strip()}
        assert "cannot place: " + toobig["cannot_place"] in rows["toobig"], table
        assert "last failure" in rows["broken"] and "on n1" in rows["broken"], table
        assert "exited with code" in rows["broken"], table
        assert "crash loop" not in rows["toobig"], table  # it waits to be placed, not to crash
        status = (await c.server.ctl("status")).stdout.decode()
        assert f"cannot place toobig: {toobig['cannot_place']}" in status, status
        assert "cannot place tiny" not in status and "cannot place broken" not in status
        as_json = json.loads((await c.server.ctl("status", "--json")).stdout)
        assert [m["model"] for m in as_json["cannot_place"]] == ["toobig"], as_json

        failures = (await c.server.ctl("replicas", "--failures")).stdout.decode()
        assert failure["replica_id"] in failures and "broken" in failures, failures
        assert f"exit {failure['exit_code']}" in failures, failures
        assert failure["output_tail"][-1].strip() in failures, failures
        as_json = json.loads((await c.server.ctl("replicas", "--failures", "--json")).stdout)
        assert as_json["models"], as_json
        # the server's log has one line for the shard's failure (node, shard, why) and
        # none of what the engine wrote: that is in `ctl replicas --failures` only
        log = c.server.log()
        said = [x for x in log.splitlines() if f"shard {failure['shard_id']} failed:" in x]
        assert len(said) == 1, said
        assert said[0].endswith(f"node n1: shard {failure['shard_id']} failed: {failure['reason']}")
        written = [x.strip() for x in failure["output_tail"] if len(x.strip()) >= 20]
        assert written, failure
        leaked = [x for x in written if x in log]
        assert not leaked, f"the engine's output is in the server's log: {leaked[:3]}"

        metrics = await c.server.metrics()
        assert 'llmgw_replica_failures_total{model="broken",node="n1"}' in metrics, metrics
        assert 'llmgw_model_problems{model="toobig",reason="memory"} 1.0' in metrics, metrics
        assert 'llmgw_model_problems{model="tiny"' not in metrics, metrics


async def test_a_replica_failed_by_a_lost_node_is_kept_as_a_failure(
    tmp_path: Path, pki: Pki
) -> None:
    """No agent reports this failure: the control plane decides it (as it does a
    startup timeout), and it is kept all the same."""
    async with cluster(tmp_path, pki) as c:
        agent = c.agent("n1")
        [replica] = await c.wait_ready(model="tiny")
        agent.kill()  # the node goes Unreachable, then Lost (6 s)
        with trio.fail_after(30):
            while not (view := await models(c))["tiny"]["failures"]:
                await trio.sleep(0.3)
        [failure] = view["tiny"]["failures"]
        assert failure["replica_id"] == replica["replica_id"]
        assert (failure["node_id"], failure["reason"]) == ("n1", "node n1 is lost")
        out = (await c.server.ctl("replicas", "--failures")).stdout.decode()
        assert "node n1 is lost" in out, out

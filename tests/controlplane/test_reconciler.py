"""The reconciler as a pure function of reports, nodes, the catalog and a clock."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.controlplane import claims
from llmgw.controlplane.catalog import Catalog, parse_catalog
from llmgw.controlplane.nodes import NodeState, NodeTable
from llmgw.controlplane.plan import Drain, Plan, Stop
from llmgw.controlplane.reconciler import Reconciler, ReplicaIds, Timing
from llmgw.controlplane.replicas import ReplicaState
from llmgw.controlplane.routing import build_snapshot
from llmgw.protocol.messages import (
    Engine,
    Gpu,
    Heartbeat,
    Inventory,
    Memory,
    ShardReport,
    ShardStatus,
)
from tests.controlplane.parts import TINY, fleet, node_table

BIG = """
[models.big]
replicas = 1
[[models.big.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
min_memory_gb = 24
startup_timeout_s = 60
"""
CATALOG = TINY + BIG


NOW = Timing(settle_s=0)  # these tests are not about the settle time after a start


def catalog(text: str = CATALOG) -> Catalog:
    return parse_catalog(text, "catalog.toml")


def reconciler(cat: Catalog, timing: Timing = NOW, *, run: str = "t") -> Reconciler:
    return Reconciler(cat, timing, ids=ReplicaIds(run))


def ready_all(rec: Reconciler, plan: Plan, now: float) -> None:
    for s in plan.start:
        rec.shard_status(s.node, ShardStatus(shard_id=s.spec.shard_id, state="starting"), now)
        rec.shard_status(s.node, ShardStatus(shard_id=s.spec.shard_id, state="ready"), now)


def probed(rec: Reconciler, now: float, why: str = "") -> None:
    """Every engine waiting for a probe answered (``why``: "" as reported)."""
    for claim in claims.due(rec.replicas.values()):
        claims.checked(rec.replicas.values(), claim, why, now)


def report(plan: Plan, state: str = "ready") -> dict[str, list[ShardReport]]:
    out: dict[str, list[ShardReport]] = {}
    for s in plan.start:
        out.setdefault(s.node, []).append(ShardReport(spec=s.spec, state=state, pid=1))  # type: ignore[arg-type]
    return out


def test_a_model_below_its_count_is_placed_and_follows_its_shards() -> None:
    nodes = fleet("n1", "n2", gpus=2)
    rec = reconciler(catalog())
    plan = rec.reconcile(nodes.nodes, now=0)
    assert sorted(s.spec.model for s in plan.start) == ["big", "tiny"]
    ready_all(rec, plan, now=1)
    assert {r.state for r in rec.replicas.values()} == {ReplicaState.READY}
    assert not rec.reconcile(nodes.nodes, now=2)  # converged: nothing to do


def test_starting_past_its_timeout_fails_releases_gpus_and_stops_counting() -> None:
    nodes = fleet("n1", gpus=1)
    rec = reconciler(catalog(), Timing(startup_margin_s=10, retry_base_s=5, settle_s=0))
    plan = rec.reconcile(nodes.nodes, now=0)
    [(node, big)] = [(s.node, s.spec) for s in plan.start if s.spec.model == "big"]
    rec.shard_status(node, ShardStatus(shard_id=big.shard_id, state="starting"), 1)
    assert rec.reconcile(nodes.nodes, now=69).start == []  # 60 s + 10 s margin not over yet
    plan = rec.reconcile(nodes.nodes, now=71)
    assert Stop(node, big.shard_id, 10.0) in plan.stop  # told to stop, GPUs released
    failed = rec.replicas[big.replica_id]
    assert failed.state is ReplicaState.FAILED
    assert "not ready 70 s after it was placed" in failed.why
    assert not failed.counts  # it stops counting towards the model at once
    # its GPU is held until the agent confirms the engine is gone, then released
    assert 0 in rec.allocations().gpus["n1"]
    rec.shard_status(node, ShardStatus(shard_id=big.shard_id, state="stopped"), 71.5)
    assert 0 not in rec.allocations().gpus.get("n1", set())
    # retried with backoff, not in a tight loop
    assert [s for s in rec.reconcile(nodes.nodes, now=72).start if s.spec.model == "big"] == []
    assert "big" in [s.spec.model for s in rec.reconcile(nodes.nodes, now=77).start]


def test_what_an_agent_reports_is_adopted_after_a_control_plane_restart() -> None:
    nodes = fleet("n1")
    first = reconciler(catalog(TINY))
    plan = first.reconcile(nodes.nodes, now=0)
    reports = report(plan)
    # a new control plane: no replicas until the agent says what runs
    second = reconciler(first.catalog, run="t2")
    adopt = second.registered("n1", reports["n1"], now=5)
    assert adopt.stop == []  # never told to stop the replica that is serving
    [replica] = second.replicas.values()
    assert replica.adopted
    assert replica.state is ReplicaState.READY
    assert not second.reconcile(nodes.nodes, now=6).start  # no second copy placed


def test_nothing_is_placed_until_agents_had_time_to_come_back() -> None:
    """After a restart a replica placed before its agent re-registers would double one
    that already serves; agents get the settle time to say what runs."""
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY), Timing(settle_s=10))
    assert rec.reconcile(nodes.nodes, now=100).start == []
    assert rec.reconcile(nodes.nodes, now=109).start == []
    assert len(rec.reconcile(nodes.nodes, now=110).start) == 1


def test_nothing_is_placed_while_a_node_from_before_is_neither_back_nor_lost() -> None:
    """A node known from before the restart may come back any time until it is Lost
    (lost_after from this start), with the engine that serves: placing before would
    double it. Its coming back, or its loss, lets placement go on."""
    tiny = catalog(TINY)
    for comes_back in (True, False):
        nodes = fleet("n2")
        nodes.expect(["n1", "n2"], now=100, wall=100)  # n2 is back already
        rec = reconciler(tiny, Timing(settle_s=10))
        assert rec.reconcile(nodes.nodes, now=100).start == []
        assert rec.reconcile(nodes.nodes, now=150).start == []  # past the settle time
        if comes_back:
            nodes.register("n1", Inventory(), peer="p", connection=9, now=151, wall=151)
            [start] = rec.reconcile(nodes.nodes, now=151).start
        else:
            assert rec.reconcile(nodes.nodes, now=159.9).start == []
            nodes.heartbeat("n2", 0, Heartbeat(seq=1, sent_at=0), now=159, wall=159)
            nodes.sweep(160)  # 60 s from this start: Lost
            assert nodes.nodes["n1"].state is NodeState.LOST
            [start] = rec.reconcile(nodes.nodes, now=160).start
            assert start.node == "n2"


def test_a_placed_replica_loses_to_the_one_the_agent_reports() -> None:
    """The seed's story: a restarted control plane placed before its agent reconnected,
    under the same replica id, on another port; the agent's engine is the real one."""
    nodes = fleet("n1")
    cat = catalog(TINY)
    running = reconciler(cat, run="r1")
    real = report(running.reconcile(nodes.nodes, now=0))["n1"][0]
    restarted = reconciler(cat, run="r1")  # the same id sequence: the collision the seed hit
    ours = restarted.reconcile(nodes.nodes, now=1).start[0].spec
    assert ours.replica_id == real.spec.replica_id
    assert ours.port == real.spec.port  # same allocator, no ports taken yet
    real = ShardReport(
        spec=real.spec.__class__(
            **{**{f: getattr(real.spec, f) for f in real.spec.__struct_fields__}, "port": 20004}
        ),
        state="ready",
    )
    plan = restarted.registered("n1", [real], now=2)
    [replica] = restarted.replicas.values()
    [shard] = replica.shards
    assert shard.spec.port == 20004  # what the agent reports wins
    assert plan.stop == []  # and the engine that serves is not told to stop
    assert rec_ports(restarted) == {20004}


@pytest.mark.parametrize("replacement", ["starting", "ready"])
def test_a_late_agents_serving_replica_stays_and_the_replacement_goes(replacement: str) -> None:
    """A restarted control plane places a replacement once the settle time is over; the
    agent that runs the serving engine registers after that. One replica is wanted and
    two count: the one placed since goes, loading or already up, never the engine that
    served all along."""
    cat = catalog(TINY)
    serving = report(reconciler(cat, run="r1").reconcile(fleet("n1").nodes, now=0))["n1"]
    restarted = reconciler(cat, Timing(settle_s=15), run="r2")
    only_n2 = fleet("n2")
    assert restarted.reconcile(only_n2.nodes, now=100).start == []  # settling
    [start] = restarted.reconcile(only_n2.nodes, now=116).start
    assert start.node == "n2"
    for state in ("starting", replacement):
        restarted.shard_status("n2", ShardStatus(shard_id=start.spec.shard_id, state=state), 117)  # type: ignore[arg-type]
    assert restarted.registered("n1", serving, now=120).stop == []
    # which one is the extra waits for the adopted engine's probe
    waiting = restarted.reconcile(fleet("n1", "n2").nodes, now=120.5)
    assert waiting.stop == [] and waiting.drain == []
    probed(restarted, now=120.6)
    plan = restarted.reconcile(fleet("n1", "n2").nodes, now=121)
    let_go = [(s.node, s.shard_id) for s in plan.stop] + [(d.node, d.shard_id) for d in plan.drain]
    assert let_go == [("n2", start.spec.shard_id)]
    kept = restarted.replicas[serving[0].spec.replica_id]
    assert kept.state is ReplicaState.READY and not kept.leaving


def rec_ports(rec: Reconciler) -> set[int]:
    return rec.allocations().ports.get("n1", set())


def test_shards_the_node_does_not_report_are_let_go_and_replaced() -> None:
    nodes = fleet("n1", "n2")
    cat = catalog(TINY)
    rec = reconciler(cat)
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [(node, spec)] = [(s.node, s.spec) for s in plan.start]
    rec.registered(node, [], now=2)  # an empty report is news
    assert (
        spec.replica_id not in rec.replicas
        or rec.replicas[spec.replica_id].state is ReplicaState.FAILED
    )
    replacement = rec.reconcile(nodes.nodes, now=3).start
    assert len(replacement) == 1


OTHER = (
    '[models.other]\nreplicas = 0\n[[models.other.profiles]]\nname = "p"\n'
    'engine = "llama.cpp"\nmodel_path = "/m.gguf"\n'
)


def test_a_model_that_left_the_catalog_drains_and_is_not_killed_mid_request() -> None:
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [start] = plan.start
    rec.set_catalog(catalog(OTHER))
    step = rec.reconcile(nodes.nodes, now=2)
    assert step.stop == []  # what it is answering finishes
    assert step.drain == [Drain(start.node, start.spec.shard_id, NOW.drain_timeout_s)]
    assert any("drains: its model left the catalog" in n.text for n in step.notes)
    assert rec.reconcile(nodes.nodes, now=3).drain == []  # drained once
    rec.shard_status("n1", ShardStatus(shard_id=start.spec.shard_id, state="stopped"), 4)
    rec.reconcile(nodes.nodes, now=5)
    assert rec.replicas == {}
    # a replica of a model that left while still loading is stopped
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    rec.set_catalog(catalog(OTHER))
    assert [s.shard_id for s in rec.reconcile(nodes.nodes, now=1).stop] == [
        plan.start[0].spec.shard_id
    ]
    # an agent that reports such a shard after a control-plane restart: it drains too
    other = reconciler(rec.catalog, run="t2")
    assert other.registered("n1", report(plan)["n1"], now=3).stop == []
    assert [d.shard_id for d in other.reconcile(nodes.nodes, now=4).drain] == [
        plan.start[0].spec.shard_id
    ]


def changed(text: str, old: str, new: str) -> Catalog:
    assert old in text
    return catalog(text.replace(old, new))


def shard_ids(steps: list[Plan], kind: str) -> list[str]:
    return [
        c.spec.shard_id if kind == "start" else c.shard_id for p in steps for c in getattr(p, kind)
    ]  # type: ignore[attr-defined]


def test_a_changed_profile_rolls_out_one_replica_at_a_time_new_one_ready_first() -> None:
    nodes = fleet("n1", "n2")
    two = TINY.replace("replicas = 1", "replicas = 2")
    rec = reconciler(catalog(two))
    first = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, first, now=1)
    old = {s.spec.replica_id for s in first.start}
    rec.set_catalog(changed(two, "startup_timeout_s = 60", 'engine_args = ["--ctx-size", "512"]'))
    now = 2.0
    rolled: list[str] = []
    for _ in range(12):
        step = rec.reconcile(nodes.nodes, now=now)
        serving = [r for r in rec.replicas.values() if r.state is ReplicaState.READY]
        # never fewer serving than wanted: the old one drains only after the new is Ready
        assert len(serving) >= 2, [(r.replica_id, r.state) for r in rec.replicas.values()]
        assert len(step.start) <= 1  # one at a time
        for s in step.start:
            assert s.spec.engine_args == ["--ctx-size", "512"]
        ready_all(rec, step, now=now + 0.1)
        for d in step.drain:
            rolled.append(d.shard_id)
            rec.shard_status(d.node, ShardStatus(shard_id=d.shard_id, state="stopped"), now + 0.2)
        now += 1
    assert sorted(r.rsplit("-", 1)[0] for r in rolled) == sorted(old)
    assert len(rec.replicas) == 2
    assert not any(r.outdated for r in rec.replicas.values())
    assert {r.nodes[0] for r in rec.replicas.values()} == {"n1", "n2"}


def test_an_outdated_replica_is_marked_and_a_change_undone_calls_the_rollout_off() -> None:
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY))
    first = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, first, now=1)
    [replica] = rec.replicas.values()
    rec.set_catalog(changed(TINY, "/models/tiny.gguf", "/models/tiny-q8.gguf"))
    step = rec.reconcile(nodes.nodes, now=2)
    assert replica.outdated and replica.leaving
    assert [s.spec.model_path for s in step.start] == ["/models/tiny-q8.gguf"]
    rec.set_catalog(catalog(TINY))  # changed back before the new one came up
    step = rec.reconcile(nodes.nodes, now=3)
    assert not replica.outdated and not replica.leaving
    assert any("stays" in n.text for n in step.notes)
    assert step.drain == []


def test_a_rollout_whose_new_replica_fails_keeps_the_old_one_serving() -> None:
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY), Timing(settle_s=0, drain_grace_s=30))
    first = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, first, now=1)
    [replica] = rec.replicas.values()
    rec.set_catalog(changed(TINY, "/models/tiny.gguf", "/models/missing.gguf"))
    now = 2.0
    for _ in range(100):  # well past the drain grace
        step = rec.reconcile(nodes.nodes, now=now)
        for s in step.start:
            rec.shard_status(
                s.node, ShardStatus(shard_id=s.spec.shard_id, state="failed", detail="no file"), now
            )
        assert step.drain == [] and replica.shards[0].shard_id not in [
            s.shard_id for s in step.stop
        ]
        now += 5
    assert replica.state is ReplicaState.READY


def test_a_rollout_with_no_room_beside_the_old_one_replaces_it_after_the_grace() -> None:
    nodes = fleet("n1", gpus=1)
    rec = reconciler(catalog(BIG), Timing(settle_s=0, drain_grace_s=30))
    first = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, first, now=1)
    rec.set_catalog(changed(BIG, "gpus = 1", 'gpus = 1\nengine_args = ["--x"]'))
    step = rec.reconcile(nodes.nodes, now=2)
    assert step.start == [] and step.drain == []
    assert step.placement_failures["big"].kind == "gpus"
    assert rec.reconcile(nodes.nodes, now=20).drain == []  # still serving
    step = rec.reconcile(nodes.nodes, now=40)
    assert [d.shard_id for d in step.drain] == [first.start[0].spec.shard_id]


def test_replicas_spread_after_an_uncordon_one_move_at_a_time() -> None:
    nodes = fleet("n1", "n2", "n3")
    three = TINY.replace("replicas = 1", "replicas = 3")
    rec = reconciler(catalog(three))
    rec.cordon("n2")
    rec.cordon("n3")
    first = rec.reconcile(nodes.nodes, now=0)
    assert [s.node for s in first.start] == ["n1", "n1", "n1"]  # a preference, not a filter
    ready_all(rec, first, now=1)
    assert rec.reconcile(nodes.nodes, now=2).start == []
    rec.uncordon("n2")
    rec.uncordon("n3")
    now = 3.0
    moves = []
    for _ in range(20):
        step = rec.reconcile(nodes.nodes, now=now)
        assert len(step.start) <= 1
        moves += [s.node for s in step.start]
        serving = [r for r in rec.replicas.values() if r.state is ReplicaState.READY]
        assert len(serving) >= 3
        ready_all(rec, step, now=now + 0.1)
        for d in step.drain:
            rec.shard_status(d.node, ShardStatus(shard_id=d.shard_id, state="stopped"), now + 0.2)
        now += 1
    assert sorted(moves) == ["n2", "n3"]
    assert sorted(r.nodes[0] for r in rec.replicas.values()) == ["n1", "n2", "n3"]


def test_a_model_that_cannot_spread_is_not_asked_again_each_pass() -> None:
    nodes = fleet("n1", "n2")
    two = TINY.replace("replicas = 1", "replicas = 2")
    rec = reconciler(catalog(two))
    rec.cordon("n2")
    ready_all(rec, rec.reconcile(nodes.nodes, now=0), now=1)
    for t in range(2, 6):
        assert rec.reconcile(nodes.nodes, now=t).start == []
    assert not any(r.leaving for r in rec.replicas.values())


def test_failures_the_reconciler_decides_are_in_the_plan() -> None:
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    [start] = plan.start
    rec.shard_status(
        "n1",
        ShardStatus(
            shard_id=start.spec.shard_id,
            state="failed",
            detail="engine exited with code 1",
            output_tail=["error: no such file"],
        ),
        1,
    )
    [failed] = rec.shard_status("n1", ShardStatus(shard_id="x", state="failed"), 1).failed or [None]
    assert failed is None  # an unknown shard is nobody's failure
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    step = rec.shard_status(
        "n1",
        ShardStatus(
            shard_id=plan.start[0].spec.shard_id,
            state="failed",
            detail="engine exited with code 1",
            output_tail=["error: no such file"],
        ),
        1,
    )
    [failed] = step.failed
    assert (failed.model, failed.node_id, failed.why, failed.output_tail) == (
        "tiny",
        "n1",
        "engine exited with code 1",
        ("error: no such file",),
    )
    # a startup timeout is a failure too, though no agent said so
    rec = reconciler(catalog(TINY))
    rec.reconcile(nodes.nodes, now=0)
    [failed] = rec.reconcile(nodes.nodes, now=200).failed
    assert failed.why == "not ready 90 s after it was placed" and failed.node_id == "n1"


def test_a_lost_node_has_its_replicas_replaced_elsewhere() -> None:
    nodes = fleet("n1", "n2")
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [first] = [s.node for s in plan.start]
    nodes.disconnected(first, list(nodes.nodes).index(first), now=2)
    for name, node in nodes.nodes.items():
        if name != first:
            nodes.heartbeat(name, node.connection, Heartbeat(seq=1, sent_at=0), now=99, wall=99)
    nodes.sweep(100)
    moved = rec.reconcile(nodes.nodes, now=100).start
    assert [s.node for s in moved] == [n for n in ("n1", "n2") if n != first]


def test_drain_is_a_rolling_move() -> None:
    nodes = fleet("n1", "n2")
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [(old_node, old)] = [(s.node, s.spec) for s in plan.start]
    rec.drain(old_node)
    step = rec.reconcile(nodes.nodes, now=2)
    [new_node] = [s.node for s in step.start]
    assert new_node != old_node
    assert step.drain == [] and step.stop == []  # the original serves until the replacement is up
    ready_all(rec, step, now=3)
    step = rec.reconcile(nodes.nodes, now=4)
    assert step.drain == [Drain(old_node, old.shard_id, NOW.drain_timeout_s)]


def test_a_drained_node_is_empty_at_once_without_waiting_on_the_grace() -> None:
    nodes = fleet("n1", "n2")
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [(old_node, old)] = [(s.node, s.spec) for s in plan.start]
    rec.drain(old_node)
    assert not rec.is_drained(old_node)  # the replica still runs there
    step = rec.reconcile(nodes.nodes, now=2)
    ready_all(rec, step, now=3)
    step = rec.reconcile(nodes.nodes, now=4)
    assert [d.shard_id for d in step.drain] == [old.shard_id]
    assert not rec.is_drained(old_node)
    # the engine finishes its requests and stops: the replica is gone at once
    stopped = rec.shard_status(old_node, ShardStatus(shard_id=old.shard_id, state="stopped"), 5)
    assert [n.text for n in stopped.notes if "stopping" in n.text] == [
        f"replica {old.replica_id} stopping: drained"
    ]
    notes = [n.text for t in (6, 200) for n in rec.reconcile(nodes.nodes, now=t).notes]
    assert not any("drain grace over" in n for n in notes), notes
    assert rec.is_drained(old_node)
    assert [r.state for r in rec.replicas.values()] == [ReplicaState.READY]


def test_draining_the_only_node_that_can_host_a_model_still_finishes() -> None:
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY), Timing(drain_grace_s=30, settle_s=0))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    rec.draining.add("n1")
    step = rec.reconcile(nodes.nodes, now=2)
    assert step.drain == []
    assert "tiny" in step.placement_failures  # nowhere else to go
    assert "draining" in step.placement_failures["tiny"].why
    assert step.placement_failures["tiny"].kind == "draining"
    step = rec.reconcile(nodes.nodes, now=40)  # the grace is over: drain anyway
    assert [d.shard_id for d in step.drain] == [plan.start[0].spec.shard_id]


def test_above_its_count_the_newest_extra_is_drained() -> None:
    nodes = fleet("n1", "n2")
    two = TINY.replace("replicas = 1", "replicas = 2")
    rec = reconciler(catalog(two))
    plan = rec.reconcile(nodes.nodes, now=0)
    assert len(plan.start) == 2
    ready_all(rec, plan, now=1)
    newest = max(rec.replicas.values(), key=lambda r: r.replica_id)
    rec.set_catalog(catalog(two.replace("replicas = 2", "replicas = 1")))
    step = rec.reconcile(nodes.nodes, now=2)
    assert [d.shard_id for d in step.drain] == [newest.shards[0].shard_id]


@pytest.mark.parametrize(
    ("cached", "goes", "why"),
    [
        ((3, 40), "older", " (the least cached: 3 prompt blocks)"),  # before the newest
        ((5, 5), "newest", ""),  # alike: the newest goes, and nothing more is said
    ],
)
def test_a_ranged_models_scale_down_lets_the_least_cached_go_else_the_newest(
    cached: tuple[int, int], goes: str, why: str
) -> None:
    nodes = fleet("n1", "n2")
    ranged = TINY.replace("replicas = 1", "replicas = { min = 1, max = 2 }")
    rec = reconciler(catalog(ranged))
    want = {"tiny": 2}
    rec.wanted = lambda m: want[m.name]
    ready_all(rec, rec.reconcile(nodes.nodes, now=0), now=1)
    older, newest = sorted(rec.replicas.values(), key=lambda r: r.replica_id)
    rec.cached = lambda: {older.replica_id: cached[0], newest.replica_id: cached[1]}
    want["tiny"] = 1
    step = rec.reconcile(nodes.nodes, now=2)
    gone = older if goes == "older" else newest
    assert [d.shard_id for d in step.drain] == [gone.shards[0].shard_id]
    assert f"replica {gone.replica_id} is an extra{why}; draining it" in [
        n.text for n in step.notes
    ]


@pytest.mark.parametrize("memory_gb", [8])
def test_a_model_that_fits_nowhere_says_why(memory_gb: int) -> None:
    nodes = fleet("n1", "n2", gpus=1, memory_gb=memory_gb)
    rec = reconciler(catalog())
    plan = rec.reconcile(nodes.nodes, now=0)
    assert "has 8 GiB of memory, needs 24 GiB" in plan.placement_failures["big"].why
    assert plan.placement_failures["big"].kind == "memory"  # the metric's bounded label


def test_an_unhealthy_ready_replica_stays_ready_but_is_not_routed_until_it_answers() -> None:
    nodes = fleet("n1")
    rec = reconciler(catalog(TINY))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [start] = plan.start
    [replica] = rec.replicas.values()

    def routed_ready() -> list[bool]:
        return [
            r.ready for r in build_snapshot(rec.catalog, rec.replicas.values(), nodes.nodes).routes
        ]

    assert routed_ready() == [True]
    sick = ShardStatus(
        shard_id=start.spec.shard_id, state="ready", detail="no answer", healthy=False
    )
    notes = rec.shard_status("n1", sick, now=2).notes
    assert [(n.warning, n.text) for n in notes] == [
        (
            True,
            f"replica {replica.replica_id}: shard {start.spec.shard_id} on n1 is unhealthy (no answer); not routed",
        )
    ]
    assert replica.state is ReplicaState.READY and not replica.healthy
    assert routed_ready() == [False]
    assert not rec.shard_status("n1", sick, now=3).notes  # said once, at the change
    assert not rec.reconcile(nodes.nodes, now=4)  # not replaced: it may come back
    # a reconnecting agent says so again in its registration
    spec = start.spec
    assert not rec.registered("n1", [ShardReport(spec=spec, state="ready", healthy=False)], 5).notes
    well = ShardStatus(shard_id=spec.shard_id, state="ready", detail="answers")
    [note] = rec.shard_status("n1", well, now=6).notes
    assert "answers its health check again" in note.text and not note.warning
    assert replica.healthy and routed_ready() == [True]


RAY_CATALOG = """
[models.wide]
replicas = 1
[[models.wide.profiles]]
name = "ray"
engine = "vllm-ray"
gpus = 1
nodes = 2
startup_timeout_s = 60
"""


def ray_fleet() -> NodeTable:
    return node_table(
        {
            name: Inventory(
                memory=Memory(total_bytes=64 << 30),
                gpus=[Gpu(index=0, name="H200")],
                engines=[Engine(name="vllm", version="0.11"), Engine(name="ray", version="2.49")],
                address=f"10.9.0.{i + 1}",
                fabric="ib-a",
            )
            for i, name in enumerate(("n1", "n2"))
        }
    )


def status(rec: Reconciler, node: str, shard_id: str, state: str, now: float) -> Plan:
    return rec.shard_status(node, ShardStatus(shard_id=shard_id, state=state), now)  # type: ignore[arg-type]


def test_a_multi_node_replica_starts_its_head_first_and_is_ready_when_all_ranks_are() -> None:
    nodes = ray_fleet()
    rec = reconciler(catalog(RAY_CATALOG))
    plan = rec.reconcile(nodes.nodes, now=0)
    [head] = plan.start  # rank 0 alone: the Ray head the others join
    assert head.spec.rank == 0 and head.spec.world_size == 2
    [replica] = rec.replicas.values()
    [worker] = [s for s in replica.shards if s.rank == 1]
    # the head's address is the node's reported address, for every rank
    assert worker.spec.head_address == head.spec.head_address == nodes.nodes[head.node].address
    assert rec.reconcile(nodes.nodes, now=1).start == []  # no worker before the head runs
    later = status(rec, head.node, head.spec.shard_id, "starting", 2)
    assert [(s.node, s.spec.rank) for s in later.start] == [(worker.node_id, 1)]
    assert any("starting rank 1 on" in n.text for n in later.notes)
    assert rec.reconcile(nodes.nodes, now=3).start == []  # sent once
    status(rec, worker.node_id, worker.shard_id, "starting", 3)
    status(rec, worker.node_id, worker.shard_id, "ready", 4)
    assert replica.state is ReplicaState.STARTING  # a worker alone serves nothing
    status(rec, head.node, head.spec.shard_id, "ready", 5)
    assert replica.state is ReplicaState.READY


def ready_ray_replica(rec: Reconciler, nodes: NodeTable) -> tuple[str, list[tuple[str, str]]]:
    plan = rec.reconcile(nodes.nodes, now=0)
    [head] = plan.start
    ranks = [(head.node, head.spec.shard_id)]
    plan = status(rec, head.node, head.spec.shard_id, "starting", 1)
    ranks += [(s.node, s.spec.shard_id) for s in plan.start]
    for node, sid in ranks:
        status(rec, node, sid, "ready", 2)
    [replica] = rec.replicas.values()
    assert replica.state is ReplicaState.READY
    return replica.replica_id, ranks


def test_any_rank_failing_fails_the_replica_stops_every_rank_and_frees_every_gpu() -> None:
    for failing in (0, 1):
        nodes = ray_fleet()
        rec = reconciler(catalog(RAY_CATALOG), Timing(settle_s=0, retry_base_s=100))
        rid, ranks = ready_ray_replica(rec, nodes)
        node, sid = ranks[failing]
        plan = status(rec, node, sid, "failed", 1000)
        assert rec.replicas[rid].state is ReplicaState.FAILED
        assert [f.shard_id for f in plan.failed] == [sid]
        others = [(n, s) for n, s in ranks if s != sid]
        assert [(s.node, s.shard_id) for s in plan.stop] == others
        # the next pass neither stops it again nor calls it "not needed"
        again = rec.reconcile(nodes.nodes, now=1000.5)
        assert again.stop == [] and not [n for n in again.notes if "stopping" in n.text]
        for n, s in others:
            status(rec, n, s, "stopped", 1001)
        assert rid not in rec.replicas or not rec.replicas[rid].shards
        assert rec.allocations().gpus == {} or all(not g for g in rec.allocations().gpus.values())


def test_a_multi_node_replica_drains_through_rank_0_then_stops_the_workers() -> None:
    nodes = ray_fleet()
    rec = reconciler(catalog(RAY_CATALOG))
    rid, [(n0, s0), (n1, s1)] = ready_ray_replica(rec, nodes)
    rec.drain(n1)  # the worker's node: the replica moves, and nowhere else fits
    assert rec.reconcile(nodes.nodes, now=10).drain == []  # leaving: a replacement first
    plan = rec.reconcile(nodes.nodes, now=311)  # none fits; the drain grace is over
    # only rank 0 serves, so only rank 0 drains: its in-flight requests finish on the
    # workers, which must stay up until it has gone
    assert [(d.node, d.shard_id) for d in plan.drain] == [(n0, s0)]
    assert plan.stop == []
    plan = status(rec, n0, s0, "stopped", 312)
    assert [(s.node, s.shard_id) for s in plan.stop] == [(n1, s1)]
    # the worker ends with its head (it may say failed): no failure is recorded
    plan = status(rec, n1, s1, "failed", 313)
    assert plan.failed == [] and not [n for n in plan.notes if n.warning]
    assert rid not in rec.replicas or not rec.replicas[rid].shards


def test_a_restarted_shards_startup_timeout_counts_from_its_restart() -> None:
    """A shard of a long-Ready replica reported starting again (a Ray worker adopted by a
    restarted agent, an engine restarted) gets its startup timeout from then."""
    nodes = ray_fleet()
    rec = reconciler(catalog(RAY_CATALOG), Timing(settle_s=0, startup_margin_s=30))
    rid, [_, (n1, s1)] = ready_ray_replica(rec, nodes)
    status(rec, n1, s1, "starting", 1000)  # long after it was placed
    assert rec.replicas[rid].state is ReplicaState.STARTING
    rec.reconcile(nodes.nodes, now=1001)
    assert rec.replicas[rid].state is ReplicaState.STARTING  # not failed at once
    rec.reconcile(nodes.nodes, now=1091)
    assert rec.replicas[rid].state is ReplicaState.FAILED
    assert rec.replicas[rid].why == "not ready 90 s after a shard restarted"


def test_the_startup_timeout_covers_the_whole_group() -> None:
    """Rank 0 runs but a worker never comes up: the replica fails once the startup
    timeout, counted from its placement, is over, and every rank is stopped."""
    nodes = ray_fleet()
    rec = reconciler(catalog(RAY_CATALOG), Timing(settle_s=0, startup_margin_s=30))
    [head] = rec.reconcile(nodes.nodes, now=0).start
    [worker] = status(rec, head.node, head.spec.shard_id, "starting", 1).start
    status(rec, head.node, head.spec.shard_id, "ready", 20)  # rank 0 alone: not Ready
    [replica] = rec.replicas.values()
    assert replica.state is ReplicaState.STARTING
    assert rec.reconcile(nodes.nodes, now=89).stop == []
    plan = rec.reconcile(nodes.nodes, now=91)
    assert replica.state is ReplicaState.FAILED
    assert replica.why == "not ready 90 s after it was placed"
    assert sorted(s.shard_id for s in plan.stop) == sorted(
        [head.spec.shard_id, worker.spec.shard_id]
    )


def test_a_replica_held_wedged_past_the_grace_fails_and_is_replaced() -> None:
    """Routers say a Ready replica has work and makes no progress: once they have said
    so for the wedged grace, it fails (its shards stopped) and a new one is placed;
    words that stop before that forget it."""
    nodes = fleet("n1", "n2", gpus=1)
    rec = reconciler(catalog(), Timing(settle_s=0, wedged_grace_s=60))
    plan = rec.reconcile(nodes.nodes, now=0)
    ready_all(rec, plan, now=1)
    [big] = [r for r in rec.replicas.values() if r.model == "big"]
    assert not rec.wedged({big.replica_id}, now=10)
    assert not rec.wedged(set(), now=40)  # it moved again: forgotten
    assert not rec.wedged({big.replica_id}, now=50)  # the grace starts again here
    assert not rec.wedged({big.replica_id}, now=109)
    failed = rec.wedged({big.replica_id}, now=110)
    assert [s.shard_id for s in failed.stop] == [big.shards[0].shard_id]
    assert big.state is ReplicaState.FAILED
    assert failed.failed[0].why.startswith("wedged: its router saw requests in flight")
    replaced = rec.reconcile(nodes.nodes, now=111)
    assert [s.spec.model for s in replaced.start] == ["big"]
    assert not rec.wedged({big.replica_id}, now=200)  # no longer Ready: nothing more


def test_a_port_the_node_says_something_else_holds_is_not_placed_on() -> None:
    """An engine no record describes holds the range's first port: a new replica
    goes to the next one (placing on it failed, and was placed there again, for ever)."""
    nodes = fleet("n1", gpus=1)
    node = nodes.nodes["n1"]
    node.inventory = msgspec.structs.replace(
        node.inventory, port_range=[20000, 20002], busy_ports=[20000]
    )
    rec = reconciler(catalog())
    plan = rec.reconcile(nodes.nodes, now=0)
    assert sorted(s.spec.port for s in plan.start) == [20001, 20002]
    explained = rec.explain("tiny", nodes.nodes, now=0)
    assert explained is not None and explained.profile is None  # every port is taken
    assert "no free engine port" in explained.summary, explained.summary


def test_the_servers_reconcile_section_sets_every_clock_it_names() -> None:
    """[reconcile] is defined once (ReconcileConfig) and the reconciler's clocks are
    those keys and the ones no operator sets: each key the config names arrives."""
    import msgspec

    from llmgw.config.schema import ReconcileConfig

    names = [f.name for f in msgspec.structs.fields(ReconcileConfig)]
    config = ReconcileConfig(**{n: 1000.0 + i for i, n in enumerate(names)})
    timing = Timing.of(config)
    assert [getattr(timing, n) for n in names] == [1000.0 + i for i in range(len(names))]
    assert timing.stop_timeout_s == Timing().stop_timeout_s  # not an operator's

"""Replicas that sleep instead of stopping (``controlplane/sleep.py``), through the
reconciler as a pure function of reports, nodes, the catalog, demand and a clock."""

from __future__ import annotations

import pytest

from llmgw.config.errors import ConfigError
from llmgw.controlplane.catalog import Catalog, Model, parse_catalog
from llmgw.controlplane.nodes import NodeTable
from llmgw.controlplane.plan import Plan
from llmgw.controlplane.reconciler import Reconciler, ReplicaIds, Timing
from llmgw.controlplane.replicas import Replica, ReplicaState
from llmgw.controlplane.routing import build_snapshot
from llmgw.controlplane.scaling import Scaling
from llmgw.protocol.messages import SLEEP, ShardReport, ShardStatus
from tests.controlplane.parts import fleet

SLEEPY = """
[models.big]
replicas = {{ min = 0, max = 2 }}
[[models.big.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
startup_timeout_s = 60
sleep_s = {sleep_s}
"""
OTHER = """
[models.other]
replicas = 1
[[models.other.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
startup_timeout_s = 60
"""


def catalog(sleep_s: float = 300, more: str = "") -> Catalog:
    return parse_catalog(SLEEPY.format(sleep_s=sleep_s) + more, "catalog.toml")


def nodes(*names: str, can: bool = True) -> NodeTable:
    table = fleet(*names, gpus=1)
    for node in table.nodes.values():
        node.can = frozenset({SLEEP}) if can else frozenset()
    return table


class Demand:
    """What demand wants of each model (the fleet manager's ``Scaling.wanted``)."""

    def __init__(self, **counts: int) -> None:
        self.counts = counts

    def __call__(self, model: Model) -> int:
        return self.counts.get(model.name, model.replicas)


def reconciler(cat: Catalog, demand: Demand) -> Reconciler:
    rec = Reconciler(cat, Timing(settle_s=0), ids=ReplicaIds("t"))
    rec.wanted = demand
    return rec


def say(rec: Reconciler, plan_or_node: Plan | str, state: str, now: float) -> None:
    """Every shard the plan started (or every shard on a node) reports ``state``."""
    if isinstance(plan_or_node, Plan):
        targets = [(s.node, s.spec.shard_id) for s in plan_or_node.start]
    else:
        targets = [
            (s.node_id, s.shard_id)
            for r in rec.replicas.values()
            for s in r.shards
            if s.node_id == plan_or_node
        ]
    for node, shard_id in targets:
        rec.shard_status(node, ShardStatus(shard_id=shard_id, state=state), now)  # type: ignore[arg-type]


def only(rec: Reconciler, model: str = "big") -> Replica:
    (replica,) = [r for r in rec.replicas.values() if r.model == model]
    return replica


def asleep(table: NodeTable, sleep_s: float = 300) -> tuple[Reconciler, Demand]:
    """One replica of ``big`` placed, Ready, let go by demand and asleep at t=12."""
    demand = Demand(big=1)
    rec = reconciler(catalog(sleep_s), demand)
    plan = rec.reconcile(table.nodes, now=0)
    assert [s.spec.sleep for s in plan.start] == [True]  # started able to sleep
    say(rec, plan, "starting", 1)
    say(rec, plan, "ready", 2)
    demand.counts["big"] = 0
    down = rec.reconcile(table.nodes, now=10)
    replica = only(rec)
    assert down.drain == [] and [s.shard_id for s in down.sleep] == [replica.shards[0].shard_id]
    assert replica.state is ReplicaState.DRAINING and replica.dozing
    say(rec, replica.nodes[0], "draining", 11)
    say(rec, replica.nodes[0], "sleeping", 12)
    assert replica.state is ReplicaState.SLEEPING
    return rec, demand


def test_a_replica_let_go_sleeps_routes_nothing_counts_nothing_and_keeps_its_gpu() -> None:
    table = nodes("n1")
    rec, _ = asleep(table)
    replica = only(rec)
    assert not replica.counts and replica.leaving is None
    snap = build_snapshot(rec.catalog, rec.replicas.values(), table.nodes)
    assert not any(r.ready for r in snap.routes if r.model == "big")
    # its GPU stays in placement's books: a wake never finds it taken
    assert rec.allocations(nodes=table.nodes).free_gpus("n1", [0]) == []
    again = rec.reconcile(table.nodes, now=20)
    assert not again and replica.state is ReplicaState.SLEEPING


def test_demand_wakes_a_sleeping_replica_instead_of_placing_one_and_its_wake_is_timed() -> None:
    table = nodes("n1", "n2")
    rec, demand = asleep(table)
    replica = only(rec)
    demand.counts["big"] = 1
    plan = rec.reconcile(table.nodes, now=30)
    assert plan.start == [] and [w.shard_id for w in plan.wake] == [replica.shards[0].shard_id]
    assert replica.state is ReplicaState.STARTING and replica.counts
    say(rec, "n1", "starting", 30.5)
    say(rec, "n1", "ready", 31.5)
    assert replica.state is ReplicaState.READY
    scaling = Scaling()
    scaling.saw(rec.replicas.values())
    assert scaling.new_wakes == [("big", "gpu", 1.5)] and scaling.new_starts == []
    assert scaling.wake_s("big", ["gpu"]) == 1.5


def test_a_wake_that_never_answers_fails_after_the_startup_timeout_counted_from_it() -> None:
    table = nodes("n1")
    rec, demand = asleep(table)
    demand.counts["big"] = 1
    rec.reconcile(table.nodes, now=200)  # long after it was placed (60 s + the margin)
    replica = only(rec)
    assert replica.state is ReplicaState.STARTING
    rec.reconcile(table.nodes, now=250)
    assert replica.state is ReplicaState.STARTING  # 50 s since the wake: within 60 + margin
    plan = rec.reconcile(table.nodes, now=200 + 60 + rec.timing.startup_margin_s + 1)
    assert replica.state is ReplicaState.FAILED
    assert "after it was woken" in plan.failed[0].why


def test_a_sleeping_replica_stops_after_its_profiles_sleep_s() -> None:
    table = nodes("n1")
    rec, _ = asleep(table, sleep_s=100)
    replica = only(rec)
    assert not rec.reconcile(table.nodes, now=111).stop
    plan = rec.reconcile(table.nodes, now=112)
    assert [s.shard_id for s in plan.stop] == [replica.shards[0].shard_id]
    assert replica.state is ReplicaState.STOPPING and "asleep for 100 s" in replica.why


def test_another_model_short_of_room_takes_a_sleeping_replicas_gpu() -> None:
    table = nodes("n1")
    rec, _ = asleep(table)
    sleeper = only(rec)
    rec.set_catalog(catalog(more=OTHER))
    plan = rec.reconcile(table.nodes, now=20)
    assert plan.placement_failures["other"].kind == "gpus"
    assert [s.shard_id for s in plan.stop] == [sleeper.shards[0].shard_id]
    assert "its room is wanted: other" in sleeper.why
    # one at a time: nothing else is stopped while it goes
    assert not rec.reconcile(table.nodes, now=21).stop
    say(rec, "n1", "stopped", 22)
    assert "big" not in {r.model for r in rec.replicas.values() if r.shards}
    # placed into what it held once its placement's retry comes (a failure backs off)
    starts = [s.spec.model for t in range(23, 23 + 60) for s in rec.reconcile(table.nodes, t).start]
    assert starts == ["other"]


@pytest.mark.parametrize(("sleep_s", "can"), [(0, True), (300, False)])
def test_a_replica_that_may_not_sleep_drains_to_a_stop(sleep_s: float, can: bool) -> None:
    table = nodes("n1", can=can)
    demand = Demand(big=1)
    rec = reconciler(catalog(sleep_s), demand)
    plan = rec.reconcile(table.nodes, now=0)
    say(rec, plan, "ready", 2)
    demand.counts["big"] = 0
    down = rec.reconcile(table.nodes, now=10)
    assert down.sleep == [] and len(down.drain) == 1


def test_an_engine_that_would_not_sleep_is_gone_as_a_drained_one() -> None:
    table = nodes("n1")
    demand = Demand(big=1)
    rec = reconciler(catalog(), demand)
    plan = rec.reconcile(table.nodes, now=0)
    say(rec, plan, "ready", 2)
    demand.counts["big"] = 0
    rec.reconcile(table.nodes, now=10)
    replica = only(rec)
    say(rec, "n1", "stopped", 11)  # the agent stopped it instead, and said why
    assert replica.state is ReplicaState.STOPPING and replica.why == "drained"


def test_an_agent_that_comes_back_with_a_sleeping_engine_has_it_adopted_asleep() -> None:
    table = nodes("n1")
    rec, _ = asleep(table)
    spec = only(rec).shards[0].spec
    fresh = reconciler(catalog(), Demand(big=0))
    fresh.registered("n1", [ShardReport(spec=spec, state="sleeping", pid=7)], now=0)  # type: ignore[arg-type]
    replica = only(fresh)
    assert replica.state is ReplicaState.SLEEPING and replica.adopted
    assert not fresh.reconcile(table.nodes, now=5).stop  # and sleeps on


def test_a_profile_that_cannot_sleep_says_so() -> None:
    text = SLEEPY.format(sleep_s=60).replace('engine = "vllm"', 'engine = "llama.cpp"')
    text = text.replace("gpus = 1", 'model_path = "/m.gguf"')
    with pytest.raises(ConfigError, match=r"sleep_s.*llama\.cpp cannot sleep"):
        parse_catalog(text, "catalog.toml")

"""What a node may report, checked against what was placed: the reconciler with
``claims``, as pure code. The process tests (tests/cluster/test_claims_processes.py)
show the same through a real server, agents and a lying agent."""

from __future__ import annotations

import msgspec

from llmgw.controlplane import claims
from llmgw.controlplane.catalog import parse_catalog
from llmgw.controlplane.nodes import NodeTable
from llmgw.controlplane.plan import Plan
from llmgw.controlplane.reconciler import Reconciler, ReplicaIds, Timing
from llmgw.controlplane.replicas import ReplicaState
from llmgw.controlplane.routing import build_snapshot
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardStatus
from llmgw.router.table import RoutingTable
from tests.controlplane.parts import TINY, fleet

KEY = b"k" * 32


def reconciler(run: str = "a") -> Reconciler:
    rec = Reconciler(parse_catalog(TINY, "c.toml"), Timing(settle_s=0), ids=ReplicaIds(run))
    rec.sealer = claims.Sealer(KEY)  # as the fleet's key outlives a restart
    return rec


def serving(rec: Reconciler, table: NodeTable, only: str = "n1") -> ShardSpec:
    """A replica placed on ``only``, started and serving: its spec."""
    on = {only: table.nodes[only]}
    [start] = rec.reconcile(on, now=0).start
    for state in ("starting", "ready"):
        rec.shard_status(
            start.node,
            ShardStatus(shard_id=start.spec.shard_id, state=state, pid=100, engine_key="k1"),  # type: ignore[arg-type]
            1,
        )
    return start.spec


def routed(rec: Reconciler, table: NodeTable) -> list[tuple[str, bool]]:
    snap = build_snapshot(rec.catalog, rec.replicas.values(), table.nodes)
    return [(r.url, r.ready) for r in snap.routes]


def test_a_placement_names_its_node_and_is_sealed_for_it_only() -> None:
    rec, table = reconciler(), fleet("n1", "n2")
    spec = serving(rec, table)
    assert spec.node_id == "n1" and spec.seal
    assert rec.sealer.placed(spec, "n1")
    assert not rec.sealer.placed(spec, "n2")
    assert not rec.sealer.placed(msgspec.structs.replace(spec, node_id="n2"), "n2")
    assert not rec.sealer.placed(msgspec.structs.replace(spec, shard_id="x-0"), "n1")
    assert not claims.Sealer(b"other" * 8).placed(spec, "n1")  # another key's seal


def test_another_nodes_shard_reported_is_refused_and_moves_nothing() -> None:
    rec, table = reconciler(), fleet("n1", "n2", "n3")
    spec = serving(rec, table)
    before = routed(rec, table)
    assert before == [(f"http://10.0.0.1:{spec.port}", True)]
    for lie in (
        spec,  # as stolen: its spec names n1
        msgspec.structs.replace(spec, node_id="", seal="", port=29999),  # names nobody
        msgspec.structs.replace(spec, node_id="n3", seal="forged", port=29999),
    ):
        plan = rec.registered(
            "n3", [ShardReport(spec=lie, state="ready", pid=4242, engine_key="kx")], now=2
        )
        [refusal] = plan.refused
        assert (refusal.node_id, refusal.shard_id, refusal.owner) == ("n3", spec.shard_id, "n1")
        assert refusal.stopped
        assert [(s.node, s.shard_id) for s in plan.stop] == [("n3", spec.shard_id)]  # n3's only
        assert routed(rec, table) == before
        [replica] = rec.replicas.values()
        assert [(s.node_id, s.spec.port, s.engine_key) for s in replica.shards] == [
            ("n1", spec.port, "k1")
        ]
    words = claims.refusal_words(refusal)
    assert words == (
        f"node n3 reported shard {spec.shard_id}, which is node n1's: it runs on n1 (placed "
        "there and seen serving); n3's claim is refused and n3 is told to stop its copy"
    )
    # and its status reports about the shard change nothing either
    rec.shard_status("n3", ShardStatus(shard_id=spec.shard_id, state="failed"), 3)
    assert routed(rec, table) == before


def test_a_refused_copy_with_the_same_pid_is_left_alone() -> None:
    """Two agents given one state directory both see the same engine under its id:
    stopping "the liar's copy" would stop the engine that serves."""
    rec, table = reconciler(), fleet("n1", "n2")
    spec = serving(rec, table)
    plan = rec.registered("n2", [ShardReport(spec=spec, state="ready", pid=100)], now=2)
    [refusal] = plan.refused
    assert not refusal.stopped and plan.stop == []
    assert "its copy on n2 is left alone" in claims.refusal_words(refusal)


def test_after_a_restart_what_was_placed_beats_a_claim_told_first() -> None:
    first, table = reconciler("a"), fleet("n1", "n2")
    spec = serving(first, table)
    restarted = reconciler("b")
    # the liar registers first, its copy unsealed and naming itself
    lie = msgspec.structs.replace(spec, node_id="n2", seal="", port=29999)
    assert not restarted.registered("n2", [ShardReport(spec=lie, state="ready", pid=7)], 10).refused
    real = ShardReport(spec=spec, state="ready", pid=100, engine_key="k1")
    plan = restarted.registered("n1", [real], now=11)
    [refusal] = plan.refused
    assert (refusal.node_id, refusal.owner) == ("n2", "n1")
    assert [(s.node, s.shard_id) for s in plan.stop] == [("n2", spec.shard_id)]
    [replica] = restarted.replicas.values()
    assert [(s.node_id, s.spec.port) for s in replica.shards] == [("n1", spec.port)]


def test_an_adopted_engine_is_routed_once_probed_and_failed_if_it_never_answers() -> None:
    first, table = reconciler("a"), fleet("n1")
    spec = serving(first, table)
    restarted = reconciler("b")
    report = ShardReport(spec=spec, state="ready", pid=100, engine_key="k1")
    restarted.registered("n1", [report], now=10)
    url = f"http://10.0.0.1:{spec.port}"
    assert routed(restarted, table) == [(url, False)]  # adopted: not routed until probed
    [claim] = claims.due(restarted.replicas.values())
    assert (claim.node_id, claim.port, claim.engine_key, claim.names) == (
        "n1",
        spec.port,
        "k1",
        frozenset({"tiny"}),
    )
    plan = claims.checked(restarted.replicas.values(), claim, "", 10.1)
    assert plan.notes == []  # a probe that passes at once says nothing
    assert routed(restarted, table) == [(url, True)]
    assert claims.due(restarted.replicas.values()) == []
    # an agent that reconnects with the same engine is not probed again
    restarted.registered("n1", [report], now=20)
    assert routed(restarted, table) == [(url, True)]
    # the same shard now reported on another port: probed again, and it fails
    moved = ShardReport(
        spec=msgspec.structs.replace(spec, port=spec.port + 1), state="ready", engine_key="k1"
    )
    restarted.registered("n1", [moved], now=30)
    [claim] = claims.due(restarted.replicas.values())
    failing = Plan()
    for t in (30.0, 31.0, 33.0):
        failing = claims.checked(restarted.replicas.values(), claim, "refuses its key (401)", t)
    assert failing.notes == []  # said once, at the first failure
    [replica] = restarted.replicas.values()
    assert replica.state is ReplicaState.READY and not replica.verified
    assert not restarted.reconcile(table.nodes, now=89).failed
    plan = restarted.reconcile(table.nodes, now=91)
    [failed] = plan.failed
    assert "refuses its key (401), for 61 s: it is not the engine its node reported" in failed.why
    assert [(s.node, s.shard_id) for s in plan.stop] == [("n1", spec.shard_id)]


def test_a_made_up_replica_is_the_extra_not_the_one_that_serves() -> None:
    rec, table = reconciler(), fleet("n1", "n2")
    spec = serving(rec, table)
    made_up = ShardSpec(
        shard_id="tiny-x-1-0",
        replica_id="tiny-x-1",
        model="tiny",
        profile="cpu",
        engine="llama.cpp",
        port=20007,
        model_path="/models/tiny.gguf",  # as its profile says: no rollout replaces it
        node_id="n2",
    )
    rec.registered("n2", [ShardReport(spec=made_up, state="ready", pid=5)], now=5)
    # which one is the extra waits for the probe of the one learned from a report
    waiting = rec.reconcile(table.nodes, now=6)
    assert waiting.drain == [] and waiting.stop == []
    [claim] = claims.due(rec.replicas.values())
    claims.checked(rec.replicas.values(), claim, "serves other, not tiny", 6.5)
    plan = rec.reconcile(table.nodes, now=7)
    assert [(d.node, d.shard_id) for d in plan.drain] == [("n2", "tiny-x-1-0")]
    assert rec.replicas[spec.replica_id].state is ReplicaState.READY


def test_a_router_that_routes_to_an_adopted_engine_goes_on_while_it_is_probed() -> None:
    """A restarted control plane adopts what an agent reports and probes it before
    routing to it: to a router that already routes there (the same engine, at the same
    address with the same key) that is no news, and it goes on; a router that never did
    waits for the probe; one that fails takes it out everywhere."""
    first, table = reconciler("a"), fleet("n1")
    spec = serving(first, table)
    before = build_snapshot(first.catalog, first.replicas.values(), table.nodes)
    holding, fresh = RoutingTable(initial=before), RoutingTable()
    assert [e.ready for e in holding.endpoints["tiny"]] == [True]
    restarted = reconciler("b")
    report = ShardReport(spec=spec, state="ready", pid=100, engine_key="k1")
    restarted.registered("n1", [report], now=10)
    probing = build_snapshot(restarted.catalog, restarted.replicas.values(), table.nodes)
    [route] = probing.routes
    assert route.verifying and not route.ready
    holding.apply(probing)
    fresh.apply(probing)
    assert [e.ready for e in holding.endpoints["tiny"]] == [True]  # no news: it goes on
    assert [e.ready for e in fresh.endpoints["tiny"]] == [False]  # never routed: waits
    [claim] = claims.due(restarted.replicas.values())
    claims.checked(restarted.replicas.values(), claim, "refuses its key (401)", 10.1)
    failed = build_snapshot(restarted.catalog, restarted.replicas.values(), table.nodes)
    assert not failed.routes[0].verifying
    holding.apply(failed)
    assert [e.ready for e in holding.endpoints["tiny"]] == [False]
    claims.checked(restarted.replicas.values(), claim, "", 11)
    holding.apply(build_snapshot(restarted.catalog, restarted.replicas.values(), table.nodes))
    assert [e.ready for e in holding.endpoints["tiny"]] == [True]
    # the same replica id at another address is another engine: it waits for its probe
    moved = ShardReport(
        spec=msgspec.structs.replace(spec, port=spec.port + 1), state="ready", engine_key="k1"
    )
    restarted.registered("n1", [moved], now=30)
    holding.apply(build_snapshot(restarted.catalog, restarted.replicas.values(), table.nodes))
    assert [e.ready for e in holding.endpoints["tiny"]] == [False]

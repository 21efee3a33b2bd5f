"""The nodes a control plane knows, kept across its restarts: what a restarted one
awaits, what routers are told while it does, and what it forgets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from llmgw.controlplane.catalog import parse_catalog
from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.known import KnownNodes
from llmgw.controlplane.nodes import LivenessPolicy, NodeState
from llmgw.controlplane.reconciler import Timing
from llmgw.controlplane.service import ControlPlane
from llmgw.protocol.messages import Engine, Inventory
from tests.controlplane.parts import TINY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fleet(
    state: Path,
    clock: Clock,
    *,
    heartbeat: float = 5,
    unreachable_after: float = 15,
    lost_after: float = 60,
    settle_s: float = 5,
) -> FleetManager:
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=unreachable_after, lost_after=lost_after),
        heartbeat_interval=heartbeat,
        clock=clock,
        wall=clock,
    )
    catalog = parse_catalog(TINY, "catalog.toml")
    return FleetManager(
        control, catalog, state_dir=state, timing=Timing(settle_s=settle_s), clock=clock
    )


def _register(fleet: FleetManager, node: str, now: float) -> None:
    inventory = Inventory(engines=[Engine(name="llama.cpp", version="b1")])
    fleet.control.nodes.register(node, inventory, peer="p", connection=1, now=now, wall=now)


def test_a_restarted_control_plane_awaits_the_nodes_it_knew_and_forgets_the_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    first = _fleet(tmp_path, clock)
    assert first.routing.snapshot.settled is False  # just started itself
    for node in ("n1", "n2"):
        _register(first, node, clock.now)
    first.reconcile_once()
    assert json.loads((tmp_path / "nodes.json").read_text()) == {"nodes": ["n1", "n2"]}
    clock.now += 60
    first.reconcile_once()
    assert first.routing.snapshot.settled and first.routing.snapshot.heard == []

    # the control plane restarts: both nodes are awaited, Unreachable, in ctl nodes
    clock.now += 5
    second = _fleet(tmp_path, clock)
    nodes = second.control.nodes.nodes
    assert {n: (nodes[n].state, nodes[n].awaited) for n in nodes} == {
        "n1": (NodeState.UNREACHABLE, True),
        "n2": (NodeState.UNREACHABLE, True),
    }
    assert "expecting 2 nodes from before this start (n1, n2)" in caplog.text
    snap = second.routing.snapshot
    assert not snap.settled and snap.heard == []
    _register(second, "n2", clock.now + 1)
    clock.now += 30  # past the settle time: n1 still awaited
    second.reconcile_once()
    assert second.routing.snapshot.heard == ["n2"]
    assert second.reconciler.replicas == {}  # nothing placed while n1 may come back
    assert second.settling_s() == pytest.approx(30)  # what an older router is told
    clock.now += 30  # 60 s from the start: n1 is Lost, and forgotten
    _register(second, "n2", clock.now)  # (n2 heartbeats meanwhile)
    second.control.sweep()
    second.reconcile_once()
    assert nodes["n1"].state is NodeState.LOST
    assert "every node from before this start is back or Lost (n1): placement goes on" in (
        caplog.text
    )
    assert [r.model for r in second.reconciler.replicas.values()] == ["tiny"]
    assert second.routing.snapshot.settled
    assert json.loads((tmp_path / "nodes.json").read_text()) == {"nodes": ["n2"]}


def test_a_list_that_cannot_be_read_is_said_and_nothing_is_awaited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "nodes.json").write_text("{not json")
    assert KnownNodes(tmp_path).load() == []
    assert "cannot read" in caplog.text and "placed a second time" in caplog.text
    assert KnownNodes(None).load() == []  # no state dir: nothing kept
    KnownNodes(None).save(["n1"])


def test_routers_keep_their_routes_for_the_settle_time_when_it_is_the_longer(
    tmp_path: Path,
) -> None:
    """Routers once kept their whole table for the settle time (the control plane
    answered them 503): a control plane whose settle time outlasts its lost-node
    timeout still tells them to keep the routes of nodes not back until it is over."""
    clock = Clock()
    fleet = _fleet(tmp_path, clock, heartbeat=0.5, unreachable_after=2, lost_after=6, settle_s=15)
    clock.now += 14.9
    fleet.reconcile_once()
    assert not fleet.routing.snapshot.settled
    clock.now += 0.1
    fleet.reconcile_once()
    assert fleet.routing.snapshot.settled

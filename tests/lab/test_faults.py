"""Faults in the lab, with routed traffic going: the invariants, not the times (the
times are ``tools/bench_faults.py``'s).

- No request lost that could have been saved. The agent and the control plane are
  not in a request's path, so through their kill -9 every request succeeds. With a
  second replica, a request that meets a dead engine before its first byte is
  retried there, so only a stream already flowing from the killed engine may be cut.
  A partitioned replica stays routed until its node is Lost (a node that is only
  Unreachable may come back with its engines serving); once the routing table the
  control plane serves no longer lists it, and the router has had a moment to take
  that table, every request succeeds.
- Nothing orphaned: after each fault, every process in a node's namespace is its
  agent, or an engine its agent has a record of, or theirs.
- Nothing allocated twice: no node's port or GPU is held by two live replicas, at
  any moment we look, faults included.

The tiny model runs two replicas here (one on each node), so that a fault to one
leaves another to save requests with. Root only; it fails, never skips, where
namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.lab.test_lab import _base36
from tests.realparts import needs_server
from tools.support import fleetapi
from tools.support.faults import (
    MODEL,
    Outcome,
    Traffic,
    admin,
    double_held,
    not_whole,
    orphans,
    wait_whole,
)
from tools.support.lab import Lab, LabError, preflight

REPLICAS = 2
SETTLE_S = 15.0  # the control plane test's
ROUTER_ASKS_WITHIN_S = 9.0  # the standalone router's backoff, once the control plane answers
LOST_AFTER_S = 6.0
# how long a router may take to act on a routing table the control plane serves: the
# router long-polls it, so a change reaches it within milliseconds; this is margin
TABLE_REACHES_ROUTER_S = 1.0


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    try:
        preflight()
    except LabError as e:
        pytest.fail(f"the lab cannot run here: {e}")
    # a name of this run's own, apart from test_lab's and test_ray's
    lab = Lab(
        tmp_path_factory.mktemp("faults"),
        name="f" + _base36(os.getpid())[-4:],
        nodes=2,
        small_disk=("n2",),
        lost_after_s=LOST_AFTER_S,
    )
    try:
        lab.up(timeout=90)
        lab.set_replicas(REPLICAS)
        _whole(lab)
        assert sorted(_replica_nodes(lab).values()) == ["n1", "n2"]
        yield lab
    finally:
        lab.down()


def _whole(lab: Lab, timeout: float = 60) -> None:
    if wait_whole(lab, timeout) is None:
        pytest.fail(f"the fleet is not whole {timeout:g} s on: {not_whole(lab)}")


def _wait_healthy(lab: Lab, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not fleetapi.up(lab.admin_url):
        if time.monotonic() > deadline:
            pytest.fail(f"the control plane does not answer {timeout:g} s on")
        time.sleep(0.1)


def _replica_nodes(lab: Lab) -> dict[str, str]:
    """Ready replica of the model -> its node."""
    return {
        r["replica_id"]: r["shards"][0]["node_id"]
        for r in lab.replicas()
        if r["model"] == MODEL and r["state"] == "Ready"
    }


def _clean(lab: Lab) -> None:
    """The fleet whole again, nothing orphaned, nothing held twice."""
    _whole(lab)
    assert orphans(lab) == []
    assert double_held(lab.replicas()) == []
    engines = sum(len(lab.engine_pids(node, MODEL)) for node in lab.state["nodes"])
    assert engines == REPLICAS, "an engine runs that no replica counts"


def _failed(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


class Watch:
    """Samples /v1/replicas for what two live replicas hold at once, and /v1/routing for
    when a replica leaves the table routers follow, while a fault goes on."""

    def __init__(self, lab: Lab, track: set[str] | None = None) -> None:
        self.lab = lab
        self.track = track or set()  # the replicas to see leave the table
        self.twice: set[str] = set()
        self.unrouted: dict[str, float] = {}  # replica -> when first not routed (monotonic)

    def sample(self) -> None:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            self.twice.update(double_held(self.lab.replicas()))
            routes = admin(self.lab, "/v1/routing")["routes"]
            routed = {r["key"] for r in routes if r["ready"]}
            for replica in self.track:
                if replica not in routed:
                    self.unrouted.setdefault(replica, time.monotonic())

    def for_(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(0.1)


@needs_server
def test_every_request_succeeds_through_an_agent_killed_and_restarted(lab: Lab) -> None:
    node = "n1"
    watch = Watch(lab)
    with Traffic(lab, clients=3) as traffic:
        watch.for_(1)
        lab.kill(node, "KILL")
        watch.for_(2)
        lab.restart(node)
        lab.wait_node(node, "Ready", timeout=30)
        watch.for_(1)
    outcomes = traffic.snapshot()
    assert len(outcomes) > 20
    assert _failed(outcomes) == []
    assert watch.twice == set()
    _clean(lab)


@needs_server
def test_every_request_succeeds_through_the_control_plane_killed_and_restarted(
    lab: Lab,
) -> None:
    """The standalone router routes on while the control plane is away, and the
    control plane that comes back does not make it drop its table while the agents
    come back (within its settle time). The agents are held (SIGSTOP) until well
    after the router has asked the new control plane, so the race is not left to
    chance; the engines serve throughout."""
    config = lab.dir / "server.toml"
    before = config.read_text()
    line = re.search(r"^settle_s = .*\n", before, re.MULTILINE)
    assert line is not None, before
    config.write_text(before.replace(line.group(0), f"settle_s = {SETTLE_S}\n"))
    try:
        with Traffic(lab, clients=3) as traffic:
            time.sleep(1)
            for node in lab.state["nodes"]:
                lab.kill(node, "STOP")
            try:
                lab.kill("cp", "KILL")
                lab.restart("cp")
                _wait_healthy(lab)
                # the router asks again after 0.5, 1, 2, 4 s... (its backoff, at most
                # 10 s): it has asked the new control plane meanwhile
                time.sleep(ROUTER_ASKS_WITHIN_S)
            finally:
                for node in lab.state["nodes"]:
                    lab.kill(node, "CONT")
            _whole(lab)
            time.sleep(2)
    finally:
        config.write_text(before)
    outcomes = traffic.snapshot()
    assert len(outcomes) > 20
    assert _failed(outcomes) == []
    _clean(lab)


@needs_server
def test_an_engine_killed_cuts_only_the_streams_it_was_sending(lab: Lab) -> None:
    node = "n2"
    watch = Watch(lab)
    with Traffic(lab, clients=3) as traffic:
        watch.for_(1)
        lab.kill(node, "KILL", engine=True, shard=MODEL)
        killed = time.monotonic()
        _whole(lab)
        watch.for_(1)
    outcomes = traffic.snapshot()
    assert len(outcomes) > 20
    for o in _failed(outcomes):
        # only a stream already flowing when its engine died: no first byte, no loss
        assert o.stream and o.cut and o.t0 <= killed <= o.t1, o
    assert watch.twice == set()
    _clean(lab)


@needs_server
def test_a_partitioned_node_loses_no_request_once_its_replica_is_unrouted(lab: Lab) -> None:
    """n1 is cut off until it is Lost and its replica is replaced; then healed, its old
    engine is adopted back or stopped. Requests sent once the routing table no longer
    lists its replica all succeed; nothing is held twice meanwhile."""
    node = "n1"
    before = {r for r, n in _replica_nodes(lab).items() if n == node}
    assert before
    watch = Watch(lab, track=before)
    with Traffic(lab, clients=3, timeout=20) as traffic:
        watch.for_(1)
        lab.partition(node)
        cut = time.monotonic()
        try:
            lab.wait_node(node, "Lost", timeout=LOST_AFTER_S + 10)
            watch.for_(3)  # replaced on the other node meanwhile
        finally:
            lab.heal(node)
        lab.wait_node(node, "Ready", timeout=30)
        deadline = time.monotonic() + 60
        while not_whole(lab) and time.monotonic() < deadline:
            watch.sample()
            time.sleep(0.1)
        watch.for_(1)
    outcomes = traffic.snapshot()
    unrouted = [watch.unrouted[r] for r in before if r in watch.unrouted]
    assert unrouted, f"{before} stayed in the routing table through the partition"
    # once the table routers follow has dropped it, nothing may fail
    unroutable = [o for o in outcomes if o.t0 >= max(unrouted) + TABLE_REACHES_ROUTER_S]
    assert len(unroutable) > 20
    assert _failed(unroutable) == []
    # before that too: a request that meets the cut-off replica before its first byte
    # is retried on the other (the router's connect timeout); only one already sent
    # there when the cut came may be lost
    assert [o for o in _failed(outcomes) if not o.t0 <= cut <= o.t1] == []
    assert watch.twice == set()
    _clean(lab)


@needs_server
def test_an_engine_stopped_loses_no_request(lab: Lab) -> None:
    """SIGSTOP: the engine takes connections and answers nothing. Its replica turns
    unhealthy and is not routed; what it had already been sent is answered after
    SIGCONT, within the clients' timeout."""
    node = "n2"
    watch = Watch(lab)
    with Traffic(lab, clients=3, timeout=30) as traffic:
        watch.for_(1)
        pids = lab.kill(node, "STOP", engine=True, shard=MODEL)
        try:
            watch.for_(8)
        finally:
            lab.kill(node, "CONT", engine=True, shard=MODEL)
        _whole(lab)
        watch.for_(1)
    assert pids
    outcomes = traffic.snapshot()
    assert len(outcomes) > 20
    assert _failed(outcomes) == []
    assert watch.twice == set()
    _clean(lab)


@needs_server
def test_a_full_state_dir_is_said_and_the_node_serves_on(lab: Lab) -> None:
    """Its agent says so, in its log and to the control plane (``/v1/nodes``), and
    what runs there serves on; once there is room, the problem is gone."""
    node = "n2"
    assert node in _replica_nodes(lab).values()
    log = lab.dir / f"{node}.log"
    size = log.stat().st_size
    full = f"state dir {lab.dir / ('agent-' + node)} is full"
    with Traffic(lab, clients=3) as traffic:
        lab.fill_disk(node)
        try:
            problems = _wait_problems(lab, node, lambda p: any(full in x for x in p))
            assert lab.node_state(node) == "Ready"
            time.sleep(2)  # traffic on a full node
        finally:
            lab.fill_disk(node, free=True)
        assert _wait_problems(lab, node, lambda p: not p) == []
    said = log.read_bytes()[size:].decode(errors="replace")
    assert full in said, said[-2000:]
    assert any(full in p for p in problems)
    outcomes = traffic.snapshot()
    assert len(outcomes) > 20
    assert _failed(outcomes) == []
    _clean(lab)


def _wait_problems(
    lab: Lab, node: str, done: Callable[[list[str]], bool], timeout: float = 10
) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        view = next(n for n in lab.nodes() if n["node_id"] == node)
        problems: list[str] = view.get("problems", [])
        if done(problems) or time.monotonic() > deadline:
            return problems
        time.sleep(0.2)


@needs_server
def test_the_checks_see_an_orphan_and_a_port_held_twice(lab: Lab) -> None:
    """What the tests above assert can fail: a process no agent knows, started in a
    node's namespace, is an orphan; two live replicas on one node's port are seen."""
    ns = lab.state["nodes"]["n1"]["ns"]
    stray = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not (found := orphans(lab)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(f"pid {stray.pid} " in o or "sleep 60" in o for o in found), found
    finally:
        stray.kill()
        stray.wait(10)
    assert orphans(lab) == []
    replicas = lab.replicas()
    assert double_held(replicas) == []
    twin = copy.deepcopy(next(r for r in replicas if r["state"] == "Ready"))
    twin["replica_id"] += "-twin"
    assert len(double_held([*replicas, twin])) == 1

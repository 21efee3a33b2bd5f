"""Replicas that sleep instead of stopping: let go by demand, woken in seconds.

Theory of operation
-------------------
A profile with ``sleep_s`` (an engine that can sleep, vLLM's sleep mode: its
engines start with ``--enable-sleep-mode``) lets its replicas sleep when its
model's demand lets one go (``moves``' surplus): instead of draining to a stop,
the replica drains to sleep (``SleepShard``: what it answers finishes, then its
engine moves its weights to host memory and frees its GPUs' memory) and is
Sleeping. A sleeping replica serves nothing and counts towards nothing, and
keeps its GPUs and port in placement's books, so a wake never finds them taken.

When its model wants a replica again (a request held at zero, a rise), the pass
wakes sleeping ones before it places anything (``WakeShard``): the replica is
Starting from then, its startup timeout counted from the wake, and Ready once
its engine answers its health check again. The wake's time is measured apart
from a load's (``scaling.Scaling.saw``).

A sleeping replica stops (``why_stop``, ``to_make_room``):

- after its profile's ``sleep_s``: nothing sleeps for ever on GPUs;
- when its profile changed (or no longer sleeps, or left), its model left, or
  its node drains or is cordoned: it would not be woken there;
- when another model is short of room (placement found no GPUs, memory or port
  for it): the one asleep longest goes first, one a pass, and the next pass
  places into what it held. A model's demand never keeps GPUs another needs.

Only a replica of one shard (one node) on an agent that says it can
(``Register.can``) sleeps, and only when its engine was started able to
(``spec.sleep``); any other is let go as before. An agent whose engine will not
sleep stops it instead, and says why: the replica is then gone, as a drained one.

Pure: no I/O, no clock (``now`` comes in).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from llmgw.controlplane.catalog import Profile
from llmgw.controlplane.nodes import Node, NodeState
from llmgw.controlplane.replicas import MoveKind, Replica, ReplicaState
from llmgw.protocol.messages import SLEEP

# the engine's own sleep (weights to host memory) after its drain: the agent bounds
# it too; a replica draining to sleep is stopped only past drain grace plus this
SLEEP_CALL_S = 120.0


def may_sleep(
    replica: Replica, kind: MoveKind | None, profile: Profile | None, nodes: Mapping[str, Node]
) -> bool:
    """Whether a replica leaving for ``kind`` sleeps instead of stopping: one its model's
    demand lets go (a surplus), of a profile that sleeps, on an agent that can."""
    if (
        profile is None
        or profile.sleep_s <= 0
        or kind is not MoveKind.SURPLUS
        or replica.state is not ReplicaState.READY
        or replica.outdated
        or replica.world_size != 1
        or len(replica.shards) != 1
    ):
        return False
    shard = replica.shards[0]
    node = nodes.get(shard.node_id)
    return shard.spec.sleep and node is not None and node.connected and SLEEP in node.can


def to_wake(
    sleeping: Iterable[Replica], n: int, nodes: Mapping[str, Node], closed: Collection[str]
) -> list[Replica]:
    """Up to ``n`` sleeping replicas to wake (not outdated, on a Ready node that is
    neither cordoned nor draining, ``closed``), the one asleep least long first: the
    rest keep their order of going."""
    if n <= 0:
        return []
    ready = [
        r
        for r in sleeping
        if r.state is ReplicaState.SLEEPING
        and not r.outdated
        and all(_open(nodes.get(s.node_id), closed) for s in r.shards)
    ]
    ready.sort(key=lambda r: -r.state_since)
    return ready[:n]


def why_stop(
    replica: Replica, profile: Profile | None, now: float, closed: Collection[str]
) -> str | None:
    """Why a sleeping replica stops now, in words; None: it sleeps on."""
    if replica.state is not ReplicaState.SLEEPING:
        return None
    if profile is None:
        return "its model or profile left the catalog"
    if replica.outdated or profile.sleep_s <= 0:
        return f"profile {profile.name} changed; it would not be woken as it runs"
    if now - replica.state_since >= profile.sleep_s:
        return f"asleep for {profile.sleep_s:g} s (its profile's sleep_s)"
    for node in replica.nodes:
        if node in closed:
            return f"its node {node} is cordoned or draining"
    return None


def to_make_room(replicas: Iterable[Replica], short: Collection[str]) -> Replica | None:
    """The sleeping replica to stop for models placement found no room for (``short``):
    one of another model, the one asleep longest; None when none is short, or none
    sleeps but theirs."""
    if not short:
        return None
    others = [r for r in replicas if r.state is ReplicaState.SLEEPING and r.model not in short]
    return min(others, key=lambda r: r.state_since, default=None)


def _open(node: Node | None, closed: Collection[str]) -> bool:
    return (
        node is not None
        and node.connected
        and node.state is NodeState.READY
        and node.node_id not in closed
    )

"""Replicas and their shards as the control plane sees them, and every legal move.

A replica is one serving copy of a model: one shard per node it spans. The
control plane keeps no database of replicas: it rebuilds them from what
agents report at every registration, and from status reports as they come.

All the moves a replica can make are in ``TRANSITIONS``; ``move`` refuses
anything else, so an illegal move is a bug that shows up in tests (the
reconciler is property-tested against this table), never a silent state.
"""

from __future__ import annotations

from enum import StrEnum

import attrs

from llmgw.protocol.messages import FetchProgress, ShardSpec, ShardState


class ReplicaState(StrEnum):
    PENDING = "Pending"  # placed; no shard has reported yet
    STARTING = "Starting"  # a shard reported starting
    READY = "Ready"  # every shard ready: the router may send it traffic
    DRAINING = "Draining"  # no new traffic; in-flight work finishes, then it stops
    STOPPING = "Stopping"  # told to stop; waiting for every shard to be gone
    FAILED = "Failed"  # a shard failed, timed out, was lost or let go; being cleaned up
    # let go by its model's demand, its engine sleeps (``sleep.py``): no traffic, its
    # GPUs' memory free, its process kept; woken when its model wants one again
    SLEEPING = "Sleeping"


class MoveKind(StrEnum):
    """Why a replica leaves (every rule of each in ``moves.TABLE``); the value is the
    word the admin API gives as ``leaving_why``."""

    DRAIN = "drain"  # its node drains
    ROLLOUT = "outdated"  # its profile changed: replaced by one of the new version
    SPREAD = "spread"  # its model crowds its node: moved where placement would put it now
    SURPLUS = "surplus"  # its model has more than its count
    REMOVED = "removed"  # its model left the catalog
    FAILED = "failed"  # a shard failed, timed out, was lost or let go; or it was wedged
    STOPPED = "stopped"  # told to stop (not needed any more, or drained)


# (from, to) -> why such a move happens. Nothing else is legal. Every state has
# a bounded way out: Pending/Starting time out, Draining and Stopping are forced
# after their grace, Failed is removed once its shards are stopped or gone,
# Sleeping is stopped after its profile's sleep_s.
TRANSITIONS: dict[tuple[ReplicaState, ReplicaState], str] = {
    (ReplicaState.PENDING, ReplicaState.STARTING): "a shard reported starting",
    (ReplicaState.PENDING, ReplicaState.READY): "every shard reported ready",
    (ReplicaState.PENDING, ReplicaState.FAILED): "a shard failed, timed out or was let go",
    (ReplicaState.PENDING, ReplicaState.STOPPING): "no longer wanted",
    (ReplicaState.STARTING, ReplicaState.READY): "every shard reported ready",
    (ReplicaState.STARTING, ReplicaState.FAILED): "a shard failed, timed out or was let go",
    (ReplicaState.STARTING, ReplicaState.STOPPING): "no longer wanted",
    (ReplicaState.READY, ReplicaState.STARTING): "a shard restarted",
    (ReplicaState.READY, ReplicaState.DRAINING): "scaled down or moved off a draining node",
    (ReplicaState.READY, ReplicaState.STOPPING): "its model or profile left the catalog",
    (ReplicaState.READY, ReplicaState.FAILED): "a shard failed, was lost or let go",
    (ReplicaState.DRAINING, ReplicaState.STOPPING): "drain grace over",
    (ReplicaState.DRAINING, ReplicaState.FAILED): "a shard failed, was lost or let go",
    (ReplicaState.STOPPING, ReplicaState.FAILED): "a shard failed while stopping",
    (ReplicaState.FAILED, ReplicaState.STOPPING): "cleaning up what is left",
    (ReplicaState.DRAINING, ReplicaState.SLEEPING): "drained for a scale-down; its engine sleeps",
    (ReplicaState.PENDING, ReplicaState.SLEEPING): "adopted asleep",
    (ReplicaState.SLEEPING, ReplicaState.STARTING): "woken: its model wants it again",
    (ReplicaState.SLEEPING, ReplicaState.STOPPING): "slept long enough, or its room is wanted",
    (ReplicaState.SLEEPING, ReplicaState.FAILED): "a shard failed, was lost or let go",
}

SERVING = frozenset({ReplicaState.READY})
COUNTS = frozenset({ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY})


class IllegalMove(AssertionError):
    pass


@attrs.define(eq=False)
class Shard:
    spec: ShardSpec
    node_id: str
    state: ShardState | None = None  # None until its agent reports it (``state_word``)
    detail: str = ""
    output_tail: list[str] = attrs.Factory(list)
    came_up: bool = False  # reported ready at least once
    # False: ready, but its engine stopped answering its agent's health checks
    healthy: bool = True
    # what its engine wants as a bearer token, as its agent reported it (never shown)
    engine_key: str = attrs.field(default="", repr=False)
    # its Start was sent (a multi-node replica's other ranks wait for rank 0's head)
    sent: bool = True
    pid: int | None = None  # its engine's, as its agent said
    # False: learned from a report, and its engine not yet found to be what the report
    # says (``claims``): not routed. Why the last probe failed ("": not probed yet), and
    # since when probes have failed
    verified: bool = True
    unverified_why: str = ""
    unverified_since: float | None = None
    # its weights are being fetched: how far, as its agent last said; None when not
    fetching: FetchProgress | None = None

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def state_word(self) -> str:
        """Its state as shown: its agent's word, or "pending" before its agent said."""
        return "pending" if self.state is None else self.state.value

    @property
    def rank(self) -> int:
        return self.spec.rank


@attrs.define(eq=False)
class Replica:
    replica_id: str
    model: str
    profile: str
    world_size: int
    shards: list[Shard]
    state: ReplicaState
    created_at: float
    state_since: float
    # why it is leaving (``moves.TABLE``), from ``leaving_since``; None: it stays. A
    # leaving replica does not count towards its model
    leaving: MoveKind | None = None
    leaving_since: float = 0.0
    # its shards run something other than its profile says now (the catalog changed)
    outdated: bool = False
    adopted: bool = False  # rebuilt from an agent's report
    # when it went back to Starting from Ready (a shard restarted): its startup timeout
    # counts from then, not from when it was placed
    restarted_at: float | None = None
    why: str = ""  # the last move's reason
    # draining to sleep, not to stop (``sleep.py``); True from then until it is woken
    dozing: bool = False
    woken_at: float | None = None  # when it was last woken (its wake time is measured)
    # the last report of a shard's weights fetch (``FetchProgress``), or of its end: its
    # startup timeout, and its measured start, count from then, never the fetch
    fetched_at: float | None = None

    def move(self, to: ReplicaState, now: float, why: str = "") -> None:
        if to is self.state:
            return
        if (self.state, to) not in TRANSITIONS:
            raise IllegalMove(
                f"replica {self.replica_id}: {self.state} -> {to} is not a legal move"
            )
        self.why = why or TRANSITIONS[(self.state, to)]
        self.state = to
        self.state_since = now

    def shard_on(self, node_id: str) -> list[Shard]:
        return [s for s in self.shards if s.node_id == node_id]

    @property
    def nodes(self) -> list[str]:
        return [s.node_id for s in self.shards]

    @property
    def healthy(self) -> bool:
        """No shard's engine has stopped answering its health checks."""
        return all(s.healthy for s in self.shards)

    @property
    def verified(self) -> bool:
        """Every shard learned from a report was found to be what its report says."""
        return all(s.verified for s in self.shards)

    @property
    def verifying(self) -> bool:
        """Not verified only because a shard learned from a report is not probed yet."""
        unverified = [s for s in self.shards if not s.verified]
        return bool(unverified) and not any(s.unverified_why for s in unverified)

    @property
    def counts(self) -> bool:
        """Counts towards the model's desired replicas."""
        return self.state in COUNTS and self.leaving is None

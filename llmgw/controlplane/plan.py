"""What the reconciler hands the fleet manager: commands to send and words to log.

Plain records, no I/O. The fleet manager sends each plan's stops first (what
is being replaced lets go of its resources soonest), then its drains and
sleeps, then its wakes and starts, and logs its notes; the reconciler itself logs nothing.
"""

from __future__ import annotations

import attrs

from llmgw.protocol.messages import ShardSpec, WeightsPeer


@attrs.frozen
class Start:
    node: str
    spec: ShardSpec


@attrs.frozen
class Stop:
    node: str
    shard_id: str
    grace_s: float  # SIGTERM -> SIGKILL on the agent


@attrs.frozen
class Drain:
    node: str
    shard_id: str
    grace_s: float  # stopped after this, finished or not


@attrs.frozen
class Sleep:
    """Drain, then the engine sleeps (``sleeping``: its process stays, its GPUs are free)."""

    node: str
    shard_id: str
    grace_s: float  # in-flight work this long at most, then it sleeps


@attrs.frozen
class Wake:
    node: str
    shard_id: str


@attrs.frozen
class Fetch:
    """Fetch a profile's weights to a node now, for no shard yet (``prefetch``)."""

    node: str
    source: str
    path: str
    sha256: str
    stall_s: float
    peers: list[WeightsPeer] = attrs.Factory(list)  # to take it from, before its source


Command = Start | Stop | Drain | Sleep | Wake | Fetch


@attrs.frozen
class Note:
    """One line for the log: a step of the plan, or (``warning``) something that failed."""

    text: str
    warning: bool = False


@attrs.frozen
class PlacementFailure:
    """A model below its count that could not be placed in this pass."""

    why: str  # the decision's summary, in words
    kind: str  # a bounded reason, for metrics (``placement.failure_kind``)


@attrs.frozen
class ReplicaFailed:
    """A replica failed in this pass, and why: kept for ``ctl models`` after it is gone."""

    model: str
    replica_id: str
    shard_id: str  # the shard that failed, or the first one (a timeout fails them all)
    node_id: str
    why: str  # the agent's words for a shard that failed, else the reconciler's
    output_tail: tuple[str, ...] = ()
    # how its engine ended, as the agent's report that failed it says (``protocol.exits``);
    # None from a report that does not (an older agent's: its words say it)
    exit_code: int | None = None
    signal: int | None = None


@attrs.frozen
class Refusal:
    """A node's report of a shard refused: the shard is another node's."""

    node_id: str  # the node whose claim lost
    shard_id: str
    owner: str  # the node that keeps it
    why: str  # in words: "it runs on n1 (placed there and seen serving)"
    stopped: bool  # the losing node was told to stop its copy


@attrs.define
class Plan:
    start: list[Start] = attrs.Factory(list)
    stop: list[Stop] = attrs.Factory(list)
    drain: list[Drain] = attrs.Factory(list)
    sleep: list[Sleep] = attrs.Factory(list)
    wake: list[Wake] = attrs.Factory(list)
    fetch: list[Fetch] = attrs.Factory(list)
    placement_failures: dict[str, PlacementFailure] = attrs.Factory(dict)  # by model
    failed: list[ReplicaFailed] = attrs.Factory(list)
    notes: list[Note] = attrs.Factory(list)
    # reports refused because the shard is another node's (``claims.admit``)
    refused: list[Refusal] = attrs.Factory(list)

    def commands(self) -> list[Command]:
        """In the order they are sent: stops, drains and sleeps, wakes, starts, fetches."""
        return [*self.stop, *self.drain, *self.sleep, *self.wake, *self.start, *self.fetch]

    def __bool__(self) -> bool:
        return bool(self.start or self.stop or self.drain or self.sleep or self.wake or self.fetch)

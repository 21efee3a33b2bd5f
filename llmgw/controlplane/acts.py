"""A replica's acts: each change of its state, with the commands and words it sends.

Theory of operation
-------------------
The reconciler decides what happens to a replica (the pass, adoption,
``moves.propose`` and ``moves.advance``); an act carries one decision out:
it moves the replica's state (``Replica.move``, which refuses what
``replicas.TRANSITIONS`` does not hold), puts in the plan the commands its
agents must hear, and says what it did in a note. Every act is safe to ask
twice: a replica already Failed is not failed again, one Stopping is not
stopped again.

- ``fail``: the failure is kept for ``ctl models`` (the plan's ``failed``),
  its shards are told to stop, and a replica that never served counts
  towards its model's crash-loop backoff (``backoff.py``).
- ``stop``: its shards are told to stop (a rank never started is nowhere to
  stop); it is forgotten once they are gone.
- ``drain``: a serving replica finishes what it answers, through rank 0, the
  only shard that serves; one that does not serve yet is stopped instead. One
  that may sleep (``sleep.may_sleep``) drains to sleep instead of a stop.
- ``wake``: a sleeping replica's engine wakes; it is Starting until it answers.
- ``begin``: a move (``moves.Move``) starts, or is called off; a move whose
  row waits for no replacement drains at once.
- ``settle``: the replica follows its shards (every one ready: Ready; every one
  asleep: Sleeping).
- ``send_starts``: what is due to start (``starts.due``: the head first).

This module is pure: ``now`` comes in with every call.
"""

from __future__ import annotations

from llmgw.controlplane import moves, starts
from llmgw.controlplane.backoff import CrashLoops
from llmgw.controlplane.plan import Drain, Note, Plan, ReplicaFailed, Sleep, Start, Stop, Wake
from llmgw.controlplane.replicas import MoveKind, Replica, ReplicaState, Shard
from llmgw.protocol.messages import ShardState

R = ReplicaState


class Acts:
    def __init__(self, *, drain_timeout_s: float, stop_grace_s: float, crash_loops: CrashLoops):
        self.drain_timeout_s = drain_timeout_s  # a drain's grace on the agent
        self.stop_grace_s = stop_grace_s  # SIGTERM -> SIGKILL on the agent
        self.crash_loops = crash_loops

    def begin(self, move: moves.Move, now: float, plan: Plan, *, sleep: bool = False) -> None:
        """A move starts (one that waits for no replacement drains at once, or drains to
        sleep: ``sleep``), or is off."""
        replica = move.replica
        if move.kind is None:
            replica.leaving = None
        else:
            replica.leaving, replica.leaving_since = move.kind, now
        plan.notes.append(Note(f"replica {replica.replica_id} {move.words}"))
        if move.kind is not None and not moves.TABLE[move.kind].replacement_first:
            self.drain(replica, now, plan, sleep=sleep)

    def remove(self, replica: Replica, now: float, plan: Plan) -> None:
        """Its model left the catalog: a serving replica drains (what it is answering
        finishes), one still loading stops."""
        if replica.state is not R.READY:
            self.stop(replica, now, plan, "its model left the catalog")
            return
        move = moves.Move(replica, MoveKind.REMOVED, "drains: its model left the catalog")
        self.begin(move, now, plan)

    def send_starts(self, replica: Replica, plan: Plan) -> None:
        """Start what is due to start (``starts.due``: the head first), while it comes."""
        if replica.state is not R.PENDING and replica.state is not R.STARTING:
            return
        started = starts.due(replica)
        if started:
            plan.start.extend(Start(s.node_id, s.spec) for s in started)
            if note := starts.joining(replica, started):
                plan.notes.append(Note(note))

    def settle(self, replica: Replica, now: float) -> None:
        """Follow the shards: all ready -> Ready; one starting -> Starting; all asleep
        (drained to sleep, or adopted so) -> Sleeping."""
        states = [s.state for s in replica.shards]
        if (
            replica.state in (R.PENDING, R.DRAINING)
            and len(states) == replica.world_size
            and all(s == ShardState.SLEEPING for s in states)
        ):
            replica.move(R.SLEEPING, now)
            replica.leaving, replica.dozing = None, True
            return
        if replica.state not in (R.PENDING, R.STARTING, R.READY):
            return
        if len(states) == replica.world_size and all(s == ShardState.READY for s in states):
            replica.move(R.READY, now)
            self.crash_loops.served(replica.model)
        elif any(s == ShardState.STARTING for s in states) and replica.state is not R.STARTING:
            if replica.state is R.READY:
                replica.restarted_at = now
            replica.move(R.STARTING, now)

    def fail(
        self,
        replica: Replica,
        now: float,
        plan: Plan,
        why: str,
        *,
        shard: Shard | None = None,
        reason: str = "",
    ) -> None:
        """Failed: its shards are stopped, and the failure is kept for ``ctl models``
        (``reason``: the agent's words for a failed ``shard``, else ``why``)."""
        if replica.state is R.FAILED:
            return
        was_serving = replica.state is R.READY
        where = shard or (replica.shards[0] if replica.shards else None)
        plan.failed.append(
            ReplicaFailed(
                model=replica.model,
                replica_id=replica.replica_id,
                shard_id=where.shard_id if where else "",
                node_id=where.node_id if where else "",
                why=reason or why,
                output_tail=tuple(where.output_tail) if where else (),
            )
        )
        replica.move(R.FAILED, now, why)
        replica.leaving = MoveKind.FAILED
        plan.notes.append(Note(f"replica {replica.replica_id} failed: {why}", warning=True))
        if not was_serving:
            self.crash_loops.failed(replica.model, now)
        self._stop_shards(replica, plan)

    def stop(self, replica: Replica, now: float, plan: Plan, why: str) -> None:
        if replica.state is R.STOPPING:
            return
        replica.move(R.STOPPING, now, why)
        replica.leaving = replica.leaving or MoveKind.STOPPED
        plan.notes.append(Note(f"replica {replica.replica_id} stopping: {why}"))
        self._stop_shards(replica, plan)

    def drain(self, replica: Replica, now: float, plan: Plan, *, sleep: bool = False) -> None:
        """What it answers finishes, then it stops (``sleep``: its engine sleeps)."""
        if replica.state is not R.READY:
            self.stop(replica, now, plan, "not needed any more")
            return
        replica.move(R.DRAINING, now, "drains, then its engine sleeps" if sleep else "")
        replica.dozing = sleep
        if sleep:  # one shard (``sleep.may_sleep``)
            for shard in replica.shards:
                plan.sleep.append(Sleep(shard.node_id, shard.shard_id, self.drain_timeout_s))
            plan.notes.append(Note(f"replica {replica.replica_id} drains, then sleeps"))
            return
        # only rank 0 serves: the other ranks are stopped once it has drained and gone
        for shard in replica.shards:
            if shard.rank == 0:
                plan.drain.append(Drain(shard.node_id, shard.shard_id, self.drain_timeout_s))

    def wake(self, replica: Replica, now: float, plan: Plan, why: str) -> None:
        """A sleeping replica wakes: Starting (its startup timeout from now) until every
        shard is ready again."""
        if replica.state is not R.SLEEPING:
            return
        replica.move(R.STARTING, now, f"woken: {why}")
        replica.restarted_at = replica.woken_at = now
        replica.leaving, replica.dozing = None, False
        plan.wake.extend(Wake(s.node_id, s.shard_id) for s in replica.shards)
        plan.notes.append(Note(f"replica {replica.replica_id} woken: {why}"))

    def _stop_shards(self, replica: Replica, plan: Plan) -> None:
        for shard in replica.shards:
            if shard.sent:  # a rank never started is nowhere to stop
                plan.stop.append(Stop(shard.node_id, shard.shard_id, self.stop_grace_s))


def follow_health(replica: Replica, shard: Shard, healthy: bool, plan: Plan) -> None:
    """Only a ready shard can be unhealthy; a change is noted once, as it happens."""
    healthy = healthy or shard.state != ShardState.READY
    if healthy == shard.healthy:
        return
    shard.healthy = healthy
    where = f"replica {replica.replica_id}: shard {shard.shard_id} on {shard.node_id}"
    if healthy:
        plan.notes.append(Note(f"{where} answers its health check again; routed again"))
    else:
        plan.notes.append(Note(f"{where} is unhealthy ({shard.detail}); not routed", warning=True))

"""The move table: every row consistent, and what ``propose`` and ``advance`` make of
any model's replicas keeps the promises the table makes.

The reconciler machine (test_reconciler_machine.py) drives the moves through a
simulated fleet; these drive the pure functions directly, over any mix of
replica states and moves a fleet can reach, and check each promise on its own:
no move takes another over unless its row says so, one move of a model at a
time, a move called off only while its replica serves and only for its row's
reason, extras trimmed to the count and never a serving one first, and a
serving replica waiting for its replacement drained only once the model has its
count of Ready replicas without it, or the grace is over where its row lets the
grace force it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.controlplane import moves
from llmgw.controlplane.acts import Acts
from llmgw.controlplane.backoff import CrashLoops
from llmgw.controlplane.moves import TABLE, Action, Cancel, Force, Pace, Phase, Relocation, Scene
from llmgw.controlplane.plan import Plan
from llmgw.controlplane.replicas import COUNTS, MoveKind, Replica, ReplicaState, Shard
from llmgw.protocol.messages import ShardSpec

R = ReplicaState
NODES = ("n1", "n2", "n3", "n4")
GRACE_S = 60.0
WAITING = [k for k, row in TABLE.items() if row.replacement_first]


# --- the table on its own ---------------------------------------------------------------


def test_every_kind_has_one_row_and_its_value_is_the_admin_api_word() -> None:
    assert list(TABLE) == list(MoveKind)
    # what scripts read as ``leaving_why``: these words, unchanged
    assert {k.value for k in MoveKind} == {
        "drain",
        "surplus",
        "outdated",
        "spread",
        "removed",
        "failed",
        "stopped",
    }


def test_every_row_is_consistent() -> None:
    for kind, row in TABLE.items():
        assert row.starts, kind
        # the pass starts it by a rule, or an event does and no rule exists
        assert (row.find is None) == (row.pace is Pace.EVENT), kind
        # a move that waits for no replacement drains as it starts: nothing to force
        # after a grace, nothing to call off while it serves
        if not row.replacement_first:
            assert row.force is Force.NO_WAIT and row.cancel is Cancel.NOTHING, kind
        else:
            assert row.force is not Force.NO_WAIT, kind
        if row.pace is not Pace.EVENT and kind not in (MoveKind.FAILED, MoveKind.STOPPED):
            assert row.words, f"{kind}: ctl has nothing to say why it leaves"
        for other in row.takes_over:
            taken = TABLE[other]
            # taking a move over never makes it wait longer, nor come back on its own
            assert taken.replacement_first, (kind, other)
            assert row.force is Force.ALWAYS or row.force is taken.force, (kind, other)
            assert kind not in taken.takes_over, (kind, other)
            assert other is not kind


def test_ctl_words_come_from_the_table() -> None:
    for kind, row in TABLE.items():
        assert moves.words(kind.value) == row.words
    assert moves.words("") == ""
    assert moves.words("a word from a newer server") == ""


# --- any model's replicas -----------------------------------------------------------------

# which moves a replica in each state can be leaving for: a move that waits for no
# replacement drains (or stops) as it starts, a failed replica is leaving as failed
REACHABLE: dict[ReplicaState, list[MoveKind | None]] = {
    R.PENDING: [None, *WAITING],
    R.STARTING: [None, *WAITING],
    R.READY: [None, *WAITING],
    R.DRAINING: [k for k in MoveKind if k not in (MoveKind.FAILED, MoveKind.STOPPED)],
    R.STOPPING: list(MoveKind),
    R.FAILED: [MoveKind.FAILED],
    R.SLEEPING: [None],  # asleep, it leaves nothing: it counts towards nothing
}


def make(
    i: int,
    state: ReplicaState,
    leaving: MoveKind | None = None,
    *,
    node: str = "n1",
    leaving_since: float = 0.0,
    created_at: float = 0.0,
    outdated: bool = False,
    adopted: bool = False,
    verified: bool = True,
) -> Replica:
    rid = f"m-t-{i}"
    shard = Shard(
        spec=ShardSpec(shard_id=f"{rid}-0", replica_id=rid, model="m", profile="p", engine="x"),
        node_id=node,
        verified=verified,
    )
    return Replica(
        replica_id=rid,
        model="m",
        profile="p",
        world_size=1,
        shards=[shard],
        state=state,
        created_at=created_at,
        state_since=0.0,
        leaving=leaving,
        leaving_since=leaving_since,
        outdated=outdated,
        adopted=adopted,
    )


@st.composite
def replica(draw: st.DrawFn, i: int) -> Replica:
    state = draw(st.sampled_from(list(ReplicaState)))
    reachable = st.sampled_from(REACHABLE[state])
    return make(
        i,
        state,
        # most replicas stay: a model with every replica moving has little to decide
        None if None in REACHABLE[state] and draw(st.booleans()) else draw(reachable),
        node=draw(st.sampled_from(NODES)),
        leaving_since=draw(st.sampled_from([0.0, 50.0, 100.0])),
        created_at=draw(st.integers(0, 5)),
        outdated=draw(st.booleans()),
        adopted=draw(st.booleans()),
        # one learned from a report, its probe not answered yet
        verified=state is not R.READY or draw(st.integers(0, 9)) > 0,
    )


@st.composite
def scenes(draw: st.DrawFn) -> Scene:
    n = draw(st.integers(0, 6))
    replicas = [draw(replica(i)) for i in range(n)]
    pick = draw(st.integers(-1, 6))

    def where_to(counting: list[Replica]) -> Relocation | None:
        # placement's answer: one of the counting replicas would go elsewhere, or none
        ready = [r for r in counting if r.state is R.READY]
        if pick < 0 or not ready:
            return None
        return Relocation(ready[pick % len(ready)], "n9", 2)

    return Scene(
        model="m",
        wanted=draw(st.integers(0, 4)),
        replicas=replicas,
        draining=frozenset(draw(st.sets(st.sampled_from(NODES), max_size=2))),
        crash_looping=draw(st.booleans()),
        known=[r.replica_id for r in replicas],
        where_to=where_to,
    )


@settings(max_examples=400, deadline=None)
@given(scenes())
def test_proposed_moves_keep_the_tables_promises(scene: Scene) -> None:
    replicas = list(scene.replicas)
    first = {r.replica_id: (r.leaving, r.state) for r in replicas}
    # each phase's moves applied before the next phase is asked, as the reconciler does
    acts = Acts(drain_timeout_s=1, stop_grace_s=1, crash_loops=CrashLoops(5, 300))
    one_at_a_time = 0
    extras: list[tuple[Replica, bool]] = []  # and whether each served
    for phase in Phase:
        seen = {r.replica_id: (r.leaving, r.state) for r in replicas}
        proposed = moves.propose(scene, phase)
        # pure: nothing of the replicas changed; the reconciler applies what it returns
        assert {r.replica_id: (r.leaving, r.state) for r in replicas} == seen
        assert len({m.replica.replica_id for m in proposed}) == len(proposed)
        for move in proposed:
            rid, (was, state) = move.replica.replica_id, seen[move.replica.replica_id]
            if move.kind is None:
                # called off only while it serves, and only for its row's reason
                assert phase is Phase.CALL_OFF
                assert was is not None and state is R.READY
                cancel = TABLE[was].cancel
                assert cancel is not Cancel.NOTHING, f"{rid}: {was} called off"
                if cancel is Cancel.PROFILE_BACK:
                    assert not move.replica.outdated
                else:
                    assert scene.crash_looping
            else:
                row = TABLE[move.kind]
                assert row.pace is not Pace.EVENT, f"the pass started {move.kind}, an event's"
                assert phase.name == row.pace.name
                assert was is None or was in row.takes_over, f"{rid}: {move.kind} took {was}"
                assert state in COUNTS, f"{rid} is {state}"
                if row.pace is Pace.ONE:
                    # one move at a time: nothing else of the model was leaving
                    assert all(k is None for k, _ in seen.values()), f"{rid}: {seen}"
                    one_at_a_time += 1
                if move.kind is MoveKind.DRAIN:
                    assert any(n in scene.draining for n in move.replica.nodes)
                if move.kind is MoveKind.SURPLUS:
                    extras.append((move.replica, state is R.READY and move.replica.verified))
            acts.begin(move, 0.0, Plan())
    assert one_at_a_time <= 1

    # every replica on a draining node that serves or comes leaves because its node
    # drains, unless it leaves already for a move that the drain does not take over
    for r in replicas:
        was, state = first[r.replica_id]
        if state in COUNTS and any(n in scene.draining for n in r.nodes):
            assert r.leaving is MoveKind.DRAIN or (
                was not in (None, *TABLE[MoveKind.DRAIN].takes_over)
            ), f"{r.replica_id} stays on a draining node"

    # extras: trimmed to the count exactly, never one that serves while one that does
    # not still counts
    if extras:
        kept = [r for r in replicas if r.counts]
        assert len(kept) == scene.wanted
        if any(served for _, served in extras):
            assert all(r.state is R.READY and r.verified for r in kept), (extras, kept)


@settings(max_examples=400, deadline=None)
@given(scenes(), st.sampled_from([50.0, 100.0, 200.0]), st.booleans())
def test_a_serving_replica_waits_for_its_replacement_unless_its_row_lets_the_grace_force_it(
    scene: Scene, now: float, room_short: bool
) -> None:
    replicas = list(scene.replicas)
    steps = moves.advance(scene.wanted, replicas, now, GRACE_S, room_short)
    assert len({s.replica.replica_id for s in steps}) == len(steps)
    ready_staying = sum(1 for r in replicas if r.state is R.READY and r.leaving is None)
    for step in steps:
        r, kind = step.replica, step.replica.leaving
        assert kind is not None, f"{r.replica_id} does not leave"
        assert r.state in (R.PENDING, R.STARTING, R.READY), f"{r.replica_id} is {r.state}"
        if step.action is Action.STOP:
            assert r.state is not R.READY, f"{r.replica_id} serves: drained, never stopped"
            continue
        row = TABLE[kind]
        if not row.replacement_first or ready_staying >= scene.wanted:
            continue
        # the model is short of Ready replicas without it: only the grace forces it
        assert now - r.leaving_since >= GRACE_S, f"{r.replica_id} ({kind}) drained early"
        assert row.force is Force.ALWAYS or (row.force is Force.ROOM_SHORT and room_short), (
            f"{r.replica_id} ({kind}) forced, its replacement not Ready"
        )
    # and the other way: whatever leaves and can go does
    stepped = {s.replica.replica_id for s in steps}
    for r in replicas:
        if r.leaving is not None and r.state in (R.PENDING, R.STARTING):
            assert r.replica_id in stepped, f"{r.replica_id} leaves, not serving, not stopped"
        if r.leaving is not None and r.state is R.READY and ready_staying >= scene.wanted:
            assert r.replica_id in stepped, f"{r.replica_id} leaves, replaced, not drained"


def test_the_last_serving_replica_of_a_rollout_waits_for_its_replacement() -> None:
    """The table's promise in the case that matters most: a model of one replica whose
    profile changed keeps serving while its replacement fails, however long."""
    old = make(0, R.READY, MoveKind.ROLLOUT)
    assert moves.advance(1, [old], now=10_000, grace_s=GRACE_S, room_short=False) == []
    # with no room for the new one but what the old one holds, the grace gives way
    [step] = moves.advance(1, [old], now=10_000, grace_s=GRACE_S, room_short=True)
    assert step.action is Action.DRAIN
    # a draining node must end, room or not
    gone = make(0, R.READY, MoveKind.DRAIN)
    [step] = moves.advance(1, [gone], now=GRACE_S, grace_s=GRACE_S, room_short=False)
    assert step.action is Action.DRAIN

"""A replica's moves: why it leaves, and every rule of its leaving, in one table.

Theory of operation
-------------------
A replica that is going away is *leaving*: ``Replica.leaving`` holds the
``MoveKind`` (``replicas.py``) that started it (None while it stays), and
``leaving_since`` when. A leaving replica no longer counts towards its model, so the pass places its
replacement; its shards hold their GPUs, ports and memory until they are gone.
``TABLE`` says for each kind:

- what starts it (``starts``, in words; for the kinds a pass proposes, ``find``
  is the rule that picks the replicas, and ``pace`` how many at a time; the
  others begin with an event: a failure, a stop, the model leaving the catalog);
- whether its replacement must be Ready before it drains (``replacement_first``);
  a kind that does not wait drains (or, not serving yet, stops) as it starts;
- whether the drain grace forces it, its replacement Ready or not (``force``);
- what calls it off while the replica still serves (``cancel``);
- which moves it takes over (``takes_over``: a replica rolled out or spread
  whose node drains now leaves because its node drains, which the grace forces);
- the words ``ctl replicas`` shows for it (``words``); its value is the word
  the admin API gives (``leaving_why``), which scripts read.

Each pass, for each model in the catalog, ``propose`` reads a ``Scene`` (the
model's replicas, the draining nodes, whether its replicas keep failing, and
placement's answer to where a crowded replica would go) and returns the moves
to make in each ``Phase``, in this order:

1. ``EACH``: the rows paced ``EACH`` start for every replica they find (its
   node drains), taking over the moves they name;
2. ``CALL_OFF``: moves whose ``cancel`` holds are called off, while the
   replica serves;
3. ``ONE``: the rows paced ``ONE`` (a rollout, then a spread), in table order,
   start for one replica, and only while nothing of the model is leaving:
   one move at a time;
4. ``EXTRA``: the rows paced ``EXTRA`` start for what counts above the model's
   count (never a serving replica while one that does not serve yet counts:
   ``surplus``).

The reconciler applies each phase's moves before it asks for the next phase's
(placement, asked where a crowded replica would go, sees who still counts),
places what the model is missing, then asks ``advance`` what each leaving
replica does now: one that does not serve yet stops; a serving one drains once
its model has its count of Ready replicas without it, or once the grace is
over where ``force`` allows.

Scaling on demand is one more row: a kind, the rule that finds its replicas,
and its columns; ``propose`` and ``advance`` read it as they read the others.

Not kinds: a wedged replica, one past its startup timeout and one on a lost
node fail (``FAILED``, its own row); crash-loop backoff (``backoff.py``) holds
placement back and calls a spread off; a multi-node replica's head-first start
(``starts.py``) is how a replica comes, not how it leaves.

This module is pure: no I/O, no clock (``now`` comes in), no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from enum import Enum

import attrs

from llmgw.controlplane import claims
from llmgw.controlplane.catalog import Profile
from llmgw.controlplane.replicas import COUNTS, MoveKind, Replica, ReplicaState
from llmgw.protocol.messages import ShardSpec

R = ReplicaState


class Pace(Enum):
    """How a pass starts a kind: for which of a model's replicas, and when."""

    EACH = "every replica its rule finds, in every pass"
    ONE = "one replica of the model at a time, while nothing of the model is leaving"
    EXTRA = "what counts above the model's count, once none waits for its probe"
    EVENT = "not by the pass: an event starts it"


class Force(Enum):
    """Whether a replica waiting for its replacement drains once the drain grace is over."""

    ALWAYS = "always: the move must end"
    ROOM_SHORT = "only when its replacement has no room but what the moving replicas hold"
    NO_WAIT = "it never waits for a replacement"


class Cancel(Enum):
    """What calls a move off while the replica still serves (the words say why it stays)."""

    NOTHING = ""
    PROFILE_BACK = "its profile is as it runs again"
    REPLACEMENT_FAILS = "its replacement failed; the move is off"


@attrs.frozen
class Relocation:
    """Placement's answer for a crowded model: this replica would go to ``target``,
    off a node where ``crowding`` of its replicas run."""

    replica: Replica
    target: str
    crowding: int


# a kind's rule: given the scene and the replicas that count now, the replicas it starts
# for, each with the words of its note
Finder = Callable[["Scene", list[Replica]], list[tuple[Replica, str]]]


@attrs.frozen
class Scene:
    """One model as a pass sees it: everything ``propose`` reads."""

    model: str
    wanted: int  # the model's count
    replicas: Sequence[Replica]  # the model's
    draining: Collection[str] = frozenset()  # nodes being drained
    crash_looping: bool = False  # a replica failed since one last became Ready
    known: Collection[str] = ()  # every replica id, in the order they became known
    # the prompt blocks routers believe each replica holds cached (a model that scales);
    # a replica not in it: none known
    cached: Mapping[str, int] = attrs.field(factory=dict)
    # placement's answer to where one of these counting replicas would go, asked only
    # when a spread is looked for
    where_to: Callable[[list[Replica]], Relocation | None] = lambda counting: None


@attrs.frozen
class Row:
    """Every rule of one kind of move (the module's docstring says how each is read)."""

    starts: str  # what starts it, in words
    pace: Pace
    replacement_first: bool  # its replacement is Ready before it drains
    force: Force
    cancel: Cancel
    words: str  # as ``ctl replicas`` says why it is leaving
    takes_over: frozenset[MoveKind] = frozenset()
    find: Finder | None = None  # the pass's rule (None: an event starts it)


@attrs.frozen
class Move:
    """A replica starts leaving for ``kind`` (None: its move is called off)."""

    replica: Replica
    kind: MoveKind | None
    words: str  # the note, after "replica <id> "


class Phase(Enum):
    """The order a pass looks for a model's moves in (``propose``)."""

    EACH = "the rows paced EACH start, taking over the moves they name"
    CALL_OFF = "moves whose cancel holds are called off, while the replica serves"
    ONE = "the rows paced ONE start, in table order: one move, while nothing of it leaves"
    EXTRA = "the rows paced EXTRA start, for what counts above the model's count"


class Action(Enum):
    STOP = "stop"  # it does not serve yet: stopped
    DRAIN = "drain"  # it serves: what it answers finishes, then it stops


@attrs.frozen
class Step:
    replica: Replica
    action: Action


def _on_draining_nodes(scene: Scene, counting: list[Replica]) -> list[tuple[Replica, str]]:
    if not scene.draining:
        return []
    return [
        (r, "moves off a draining node")
        for r in scene.replicas
        if r.state in COUNTS and any(n in scene.draining for n in r.nodes)
    ]


def _outdated(scene: Scene, counting: list[Replica]) -> list[tuple[Replica, str]]:
    stale = [r for r in counting if r.outdated]
    if not stale:
        return []
    # what does not serve yet goes first, then the oldest
    r = min(stale, key=lambda r: (r.state is R.READY, r.created_at))
    return [
        (
            r,
            f"runs an earlier version of profile {r.profile}; replacing it "
            "(the new one is Ready before this one drains)",
        )
    ]


def _crowded(scene: Scene, counting: list[Replica]) -> list[tuple[Replica, str]]:
    found = scene.where_to(counting)
    if found is None:
        return []
    return [
        (
            found.replica,
            f"moves to {found.target} to spread {scene.model} over nodes "
            f"({found.crowding} of its replicas run on {found.replica.nodes[0]})",
        )
    ]


def _extras(scene: Scene, counting: list[Replica]) -> list[tuple[Replica, str]]:
    over = len(counting) - scene.wanted
    if over <= 0 or any(claims.pending(r) for r in counting):  # probed first
        return []
    return [
        (r, f"is an extra{_cache_words(r, counting, scene.cached)}; draining it")
        for r in surplus(counting, over, scene.known, scene.cached)
    ]


def _cache_words(r: Replica, counting: list[Replica], cached: Mapping[str, int]) -> str:
    """Why this one, where what routers believe cached decided it."""
    if not cached or len({cached.get(c.replica_id, 0) for c in counting}) < 2:
        return ""
    return f" (the least cached: {cached.get(r.replica_id, 0)} prompt blocks)"


K = MoveKind

# kind -> its row. The order is the order a pass starts them in, within each pace.
TABLE: dict[MoveKind, Row] = {
    K.DRAIN: Row(
        starts="the operator drains a node it runs on",
        pace=Pace.EACH,
        replacement_first=True,
        force=Force.ALWAYS,  # draining the only node that can host a model still finishes
        cancel=Cancel.NOTHING,
        words="its node drains",
        takes_over=frozenset({K.ROLLOUT, K.SPREAD}),
        find=_on_draining_nodes,
    ),
    K.ROLLOUT: Row(
        starts="its shards run something other than its profile now says",
        pace=Pace.ONE,
        replacement_first=True,
        force=Force.ROOM_SHORT,  # one GPU, one replica: replaced in place
        cancel=Cancel.PROFILE_BACK,
        words="replaced by the new profile",
        find=_outdated,
    ),
    K.SPREAD: Row(
        starts="its model crowds one node, and placement would now put one elsewhere",
        pace=Pace.ONE,
        replacement_first=True,
        force=Force.ROOM_SHORT,
        cancel=Cancel.REPLACEMENT_FAILS,
        words="moves to spread",
        find=_crowded,
    ),
    K.SURPLUS: Row(
        starts="its model has more replicas that count than it wants",
        pace=Pace.EXTRA,
        replacement_first=False,
        force=Force.NO_WAIT,
        cancel=Cancel.NOTHING,
        words="an extra",
        find=_extras,
    ),
    K.REMOVED: Row(
        starts="its model left the catalog while it served",
        pace=Pace.EVENT,
        replacement_first=False,
        force=Force.NO_WAIT,
        cancel=Cancel.NOTHING,
        words="model left the catalog",
    ),
    K.FAILED: Row(
        starts="a shard failed, timed out, was lost or let go, or it stayed wedged",
        pace=Pace.EVENT,
        replacement_first=False,
        force=Force.NO_WAIT,
        cancel=Cancel.NOTHING,
        words="",  # shown by its state, Failed
    ),
    K.STOPPED: Row(
        starts="it is stopped: not needed any more, or drained",
        pace=Pace.EVENT,
        replacement_first=False,
        force=Force.NO_WAIT,
        cancel=Cancel.NOTHING,
        words="",  # shown by its state, Stopping
    ),
}

del K


def words(leaving_why: str) -> str:
    """What ``ctl`` shows for the admin API's ``leaving_why`` ("": nothing to add, or a
    word from a newer server)."""
    try:
        return TABLE[MoveKind(leaving_why)].words
    except ValueError:
        return ""


def propose(scene: Scene, phase: Phase) -> list[Move]:
    """The moves a pass makes for one model in ``phase``, in the order to apply them.
    The reconciler applies each phase's moves before it asks for the next phase's: a
    later phase sees what an earlier one started (and placement, who still counts)."""
    out: list[Move] = []
    if phase is Phase.CALL_OFF:
        for replica in scene.replicas:
            kind = replica.leaving
            if kind is not None and replica.state is R.READY and _called_off(replica, kind, scene):
                out.append(Move(replica, None, f"stays: {TABLE[kind].cancel.value}"))
        return out
    pace = _PACE[phase]
    if pace is Pace.ONE and any(r.leaving is not None for r in scene.replicas):
        return out  # one move of the model at a time
    counting = [r for r in scene.replicas if r.counts]
    taken: set[str] = set()
    for kind, row in TABLE.items():
        if row.pace is not pace or row.find is None:
            continue
        if pace is Pace.ONE and out:
            break  # one move of the model at a time
        for replica, words in row.find(scene, counting):
            if replica.replica_id in taken:
                continue
            if replica.leaving is None or replica.leaving in row.takes_over:
                taken.add(replica.replica_id)
                out.append(Move(replica, kind, words))
                if pace is Pace.ONE:
                    break
    return out


_PACE = {Phase.EACH: Pace.EACH, Phase.ONE: Pace.ONE, Phase.EXTRA: Pace.EXTRA}


def _called_off(replica: Replica, kind: MoveKind, scene: Scene) -> bool:
    cancel = TABLE[kind].cancel
    if cancel is Cancel.PROFILE_BACK:
        return not replica.outdated
    if cancel is Cancel.REPLACEMENT_FAILS:
        return scene.crash_looping
    return False


def may_force(kind: MoveKind, room_short: bool) -> bool:
    """Whether a leaving replica drains once the drain grace is over, its replacement
    Ready or not. A draining node must end; a rollout or a spread gives way only when
    its replacement cannot be placed for want of what the moving replicas hold (one
    GPU, one replica): a replacement that fails to start never takes the serving
    replica down with it."""
    force = TABLE[kind].force
    return force is not Force.ROOM_SHORT or room_short


def advance(
    wanted: int, replicas: Sequence[Replica], now: float, grace_s: float, room_short: bool
) -> list[Step]:
    """What each leaving replica of one model does in this pass (after placement)."""
    ready = sum(1 for r in replicas if r.state is R.READY and r.leaving is None)
    steps = []
    for replica in replicas:
        kind = replica.leaving
        if kind is None or replica.state in (R.DRAINING, R.FAILED, R.STOPPING):
            continue
        if replica.state in (R.PENDING, R.STARTING):
            steps.append(Step(replica, Action.STOP))
        elif (
            not TABLE[kind].replacement_first
            or ready >= wanted
            or (now - replica.leaving_since >= grace_s and may_force(kind, room_short))
        ):
            steps.append(Step(replica, Action.DRAIN))
    return steps


def forcible_by_room(replicas: Mapping[str, Replica], model: str) -> set[str]:
    """The model's replicas leaving for a move that the grace forces only when their
    replacement has no room but what they hold: asked whether it would fit without them."""
    return {
        rid
        for rid, r in replicas.items()
        if r.model == model and r.leaving is not None and TABLE[r.leaving].force is Force.ROOM_SHORT
    }


def surplus(
    counting: list[Replica], n: int, known: Collection[str], cached: Mapping[str, int] = {}
) -> list[Replica]:
    """The ``n`` replicas of one model to let go when more count than are wanted.

    The ones not serving go first: a Ready replica is never drained while one
    that is still loading is kept. Then those running an earlier version of
    their profile. Among those that serve, the one the routers believe holds the
    least cached (``cached``: prompt blocks by replica id; its conversations
    lose least, and the routers' affinity sends them elsewhere). Then an adopted
    one ran before this control plane started, so it is older than anything placed
    since (its ``created_at`` is only when it was adopted): the replacement a
    restarted control plane placed before a late agent came back goes, and the
    engine that was serving all along stays. Then the newest go first
    (``known``: replica ids in the order they became known, for ties).
    """
    order = {rid: i for i, rid in enumerate(known)}
    return sorted(
        counting,
        key=lambda r: (
            r.state is R.READY and r.verified,
            not r.outdated,
            cached.get(r.replica_id, 0),
            r.adopted,
            -r.created_at,
            -order.get(r.replica_id, len(order)),
        ),
    )[:n]


def _other_weights(spec: ShardSpec, profile: Profile) -> bool:
    """Whether a shard runs other weights than its profile names: another source, pin
    or path. A fetched file's path is where its node lands it, not the profile's."""
    if spec.weights_source != profile.source or spec.weights_sha256 != profile.sha256.lower():
        return True
    return bool(profile.model_path or not profile.source) and spec.model_path != profile.model_path


def outdated(replica: Replica, profile: Profile | None) -> bool:
    """Whether a replica's shards run something other than its profile now says
    (its profile left the model, or the engine, the weights, the arguments, the
    settings, the environment, the GPUs or whether it may sleep changed). A changed placement rule
    (selector, memory) or startup timeout does not restart a serving engine."""
    if profile is None:
        return True
    if replica.world_size != profile.nodes:
        return True
    return any(
        s.spec.engine != profile.engine
        or _other_weights(s.spec, profile)
        or s.spec.engine_args != profile.engine_args
        or s.spec.settings != profile.settings
        or s.spec.sleep != (profile.sleep_s > 0)
        or s.spec.env != profile.env
        or len(s.spec.gpus) != profile.gpus
        for s in replica.shards
    )

"""Reconciliation: what should run against what does, as pure code over a clock.

Theory of operation
-------------------
The reconciler holds the replicas (rebuilt from the fleet, never from a
database) and the operator's intent (cordoned and draining nodes). Three
inputs change it, each returning a ``Plan`` of commands for the daemon to
send through the dispatcher:

``registered(node, reports, now)``
    The fleet is authoritative. A registration follows a fresh connection,
    so whatever the control plane believed the node runs and the node did not
    report is not running: it is let go. Every shard the node may report
    (``claims``: not another node's) is adopted, and probed before it is
    routed: a replica we never heard of is rebuilt from the report; a replica we merely
    placed loses to what the agent reports, unless our copy has a shard that
    actually came up, in which case two really run and the stray (the one we
    did not ask for) is stopped. A reconnecting agent is never told to stop
    the replica that is serving.

``shard_status(node, status, now)``
    A shard moved; the replica follows (``TRANSITIONS`` in replicas.py). A
    ready shard may also be reported unhealthy (its engine stopped answering
    its agent's health checks): the replica stays Ready, it is only not
    routed (``Replica.healthy``) until the engine answers again.

``reconcile(nodes, now)``
    One pass: drain what left the catalog (stop it if it does not serve yet);
    mark replicas whose shards run something other than their profile says
    (``outdated``); fail what is stuck starting past
    its startup timeout (its GPUs released, it stops counting); fail what
    sits on a Lost node; clean up failed replicas. Then, for each model, the
    moves ``moves.propose`` finds (off a draining node, a rollout, a spread,
    the extras above its count) are made, what it is missing is placed
    (retrying failures with backoff, ``backoff.py``, not in a tight loop),
    and each leaving replica does what ``moves.advance`` says: a rolling
    move drains the old replica only once its replacement is Ready, or once
    the drain grace is over where the move's row lets the grace force it.

A multi-node replica (vLLM over Ray) starts its head first (``starts.py``). It
is Ready when every rank is, which for rank 0 means it serves (its agent's
health check). Any rank failing fails the replica and stops every rank. It
drains through rank 0, the only one that serves; the others are stopped once
rank 0 is gone, and their ending then (Ray workers exit with their head) is no
failure.

Every replica failure (an agent's report, a startup timeout, a lost node) is
in the plan's ``failed``, for the fleet manager to keep.

Everything it needs from outside comes in as arguments: ``now`` with every
call, the replica ids from a ``ReplicaIds`` it is given. It does no I/O and
logs nothing: what it did is in the plan's notes, which the fleet manager logs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping

import msgspec

from llmgw.config.schema import ReconcileConfig
from llmgw.controlplane import acts, claims, moves, sleep, starts
from llmgw.controlplane.acts import Acts
from llmgw.controlplane.allocations import Allocations
from llmgw.controlplane.backoff import CrashLoops
from llmgw.controlplane.catalog import Catalog, Model, Profile
from llmgw.controlplane.filters import ROOM, PlacementCache
from llmgw.controlplane.memory import Needs
from llmgw.controlplane.nodes import Node, NodeState, awaited
from llmgw.controlplane.peers import same_source, weights_peers
from llmgw.controlplane.placement import Decision, failure_kind
from llmgw.controlplane.placing import PassPlacement, allocated
from llmgw.controlplane.plan import (
    Note,
    PlacementFailure,
    Plan,
    Stop,
)
from llmgw.controlplane.replicas import MoveKind, Replica, ReplicaState, Shard
from llmgw.controlplane.spread import Spreads
from llmgw.protocol.messages import (
    FetchProgress,
    ShardReport,
    ShardState,
    ShardStatus,
    WeightsPeer,
)

R = ReplicaState
S = ShardState
SERVING_OR_COMING = frozenset({R.PENDING, R.STARTING, R.READY})


class Timing(ReconcileConfig, kw_only=True):
    """The reconciler's clocks: the ``[reconcile]`` section's (``ReconcileConfig``,
    defined there once, with their words), and the ones no operator sets."""

    stop_timeout_s: float = 60.0  # a stopping replica is forgotten after this
    stop_grace_s: float = 10.0  # SIGTERM -> SIGKILL on the agent
    # placing costs a few ms per replica at 1,000 nodes: a pass stays short, and
    # the next pass (a second later) places more
    max_placements_per_pass: int = 8
    # an adopted engine that fails every probe this long (not what its node reported) fails
    verify_grace_s: float = 60.0

    @classmethod
    def of(cls, config: ReconcileConfig) -> Timing:
        """The clocks a server's ``[reconcile]`` section sets, the others as they are."""
        return cls(**msgspec.structs.asdict(config))

    def drain_bound_s(self) -> float:
        """The longest a node's drain takes when nothing fails: the grace for a
        replacement, then in-flight work's timeout, then the stop's."""
        return self.drain_grace_s + self.drain_timeout_s + self.stop_timeout_s


class ReplicaIds:
    """Replica ids: the model, a tag for this run of the control plane, a counter.

    The caller picks the tag (the fleet manager a random one, so that ids never
    repeat across control plane restarts; tests a fixed one).
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self._count = itertools.count(1)

    def new(self, model: str) -> str:
        return f"{model}-{self.run}-{next(self._count)}"


class Reconciler:
    def __init__(self, catalog: Catalog, timing: Timing | None = None, *, ids: ReplicaIds) -> None:
        self.catalog = catalog
        self.sealer = claims.Sealer.ephemeral()  # seals what it places (the fleet's key)
        self.timing = timing or Timing()
        self.replicas: dict[str, Replica] = {}
        self.cordoned: set[str] = set()
        self.draining: set[str] = set()
        # a model whose new replicas keep failing is retried ever later
        self.crash_loops = CrashLoops(self.timing.retry_base_s, self.timing.retry_cap_s)
        self.acts = Acts(
            drain_timeout_s=self.timing.drain_timeout_s,
            stop_grace_s=self.timing.stop_grace_s,
            crash_loops=self.crash_loops,
        )
        self.ids = ids
        self.started_at: float | None = None
        # what placement read from each inventory, kept from pass to pass (derived data,
        # never stale): a pass reads only the inventories that changed since the last
        self.placement_cache = PlacementCache()
        # models whose last placement failed, but would fit in what their moving replicas
        # hold: a rollout or spread of one gives way after the drain grace (``moves.may_force``)
        self.room_short: set[str] = set()
        # replicas the routers say are wedged -> since when they have said so
        self._wedged_since: dict[str, float] = {}
        self.spreads = Spreads()
        # how many replicas a model should run now: its count, or what demand says of a
        # range (``scaling.Scaling.wanted``, set by the fleet manager)
        self.wanted: Callable[[Model], int] = lambda model: model.replicas
        self._making_room: str | None = None  # a sleeping replica stopped for another's room
        # the prompt blocks routers believe each replica holds cached (set by the fleet
        # manager): a ranged model's scale-down lets the least cached go (``moves.surplus``)
        self.cached: Callable[[], Mapping[str, int]] = dict

    # --- inputs from the fleet ----------------------------------------------

    def registered(self, node_id: str, reports: list[ShardReport], now: float) -> Plan:
        plan = Plan()
        reported = {r.spec.shard_id: r for r in reports}
        # what we believed ran there and the node did not report is not running
        for replica in list(self.replicas.values()):
            for shard in replica.shard_on(node_id):
                if shard.shard_id not in reported and shard.sent:
                    self._let_go(replica, shard, now, plan, "the agent does not report it")
        for report in reports:
            self._adopt(node_id, report, now, plan)
        return plan

    def shard_status(self, node_id: str, status: ShardStatus, now: float) -> Plan:
        plan = Plan()
        found = self._find(status.shard_id)
        if found is None or found[1].node_id != node_id:
            return plan
        replica, shard = found
        shard.state, shard.detail = status.state, status.detail
        _follow_fetch(replica, shard, status.fetching, now)
        shard.engine_key = status.engine_key or shard.engine_key
        shard.pid = status.pid or shard.pid
        acts.follow_health(replica, shard, status.healthy, plan)
        if status.output_tail:
            shard.output_tail = list(status.output_tail)
        if status.state == S.READY:
            shard.came_up = True
        if status.state in (S.FAILED, S.STOPPED):
            replica.shards.remove(shard)
            if _follows_its_head(replica, shard):
                pass  # a Ray worker ends with the head it joined: that is how a replica stops
            elif status.state == S.FAILED or replica.state not in (
                R.STOPPING,
                R.DRAINING,
                R.FAILED,
            ):
                self.acts.fail(
                    replica,
                    now,
                    plan,
                    f"shard {shard.shard_id} on {node_id} {status.state}: {status.detail}",
                    shard=shard,
                    reason=status.detail or str(status.state),
                )
            if replica.state is R.DRAINING and not _has_head(replica):
                self.acts.stop(replica, now, plan, "drained")  # forgotten in the next pass
        self.acts.settle(replica, now)
        self.acts.send_starts(replica, plan)
        return plan

    # --- one pass ------------------------------------------------------------------

    def reconcile(self, nodes: Mapping[str, Node], now: float) -> Plan:
        plan = Plan()
        t = self.timing
        if self.started_at is None:
            self.started_at = now
        for replica in list(self.replicas.values()):
            model = self.catalog.models.get(replica.model)
            profile = self.catalog.profile(replica.model, replica.profile)
            replica.outdated = model is not None and moves.outdated(replica, profile)
            if (model is None or not model.profiles) and replica.state in SERVING_OR_COMING:
                self.acts.remove(replica, now, plan)
            if replica.state in (R.PENDING, R.STARTING):
                limit = _startup_timeout(replica, profile) + t.startup_margin_s
                since = replica.restarted_at
                start = replica.created_at if since is None else since
                fetched = replica.fetched_at
                if fetched is not None and fetched > start:
                    since = start = fetched
                if now - start > limit:
                    when = (
                        "it was placed"
                        if since is None
                        else "its weights were fetched"
                        if since == fetched
                        else "it was woken"
                        if since == replica.woken_at
                        else "a shard restarted"
                    )
                    self.acts.fail(replica, now, plan, f"not ready {limit:g} s after {when}")
                    continue
            if replica.state is R.READY and (why := claims.overdue(replica, now, t.verify_grace_s)):
                self.acts.fail(replica, now, plan, why)
            lost = [s.node_id for s in replica.shards if _gone(nodes.get(s.node_id))]
            if lost and replica.state is not R.FAILED:
                self.acts.fail(replica, now, plan, f"node {lost[0]} is lost")
            if replica.state is R.DRAINING and not _has_head(replica):
                self.acts.stop(replica, now, plan, "drained")  # nothing of it serves
            elif replica.state is R.DRAINING and now - replica.state_since > t.drain_timeout_s + (
                sleep.SLEEP_CALL_S if replica.dozing else 0.0
            ):
                self.acts.stop(replica, now, plan, "drain grace over")
            if why := sleep.why_stop(replica, profile, now, self.draining):
                self.acts.stop(replica, now, plan, why)
            if replica.state in (R.FAILED, R.STOPPING):
                self._clean_up(replica, nodes, now, plan)
            self.acts.send_starts(replica, plan)
        if now - self.started_at < t.settle_s or awaited(nodes.values()):
            return plan  # agents are still coming back: they say what runs first
        by_model: dict[str, list[Replica]] = {}
        for replica in self.replicas.values():
            by_model.setdefault(replica.model, []).append(replica)
        shared = self._pass(nodes)  # facts and allocations, built once a pass
        # models below their floor (a count, or a range's min) are placed first, before
        # what a range's demand wants beyond it (``scaling``)
        for model in sorted(
            self.catalog.models.values(),
            key=lambda m: sum(r.counts for r in by_model.get(m.name, ())) >= m.replicas,
        ):
            self._scale(model, by_model.get(model.name, []), shared, now, plan)
        self._make_room(plan, now)
        return plan

    def _make_room(self, plan: Plan, now: float) -> None:
        """A model found no room this pass: a sleeping replica of another model stops
        (one at a time: the next is chosen once the last is gone)."""
        if self._making_room in self.replicas:
            return
        self._making_room = None
        short = sorted(m for m, f in plan.placement_failures.items() if f.kind in ROOM)
        victim = sleep.to_make_room(self.replicas.values(), short)
        if victim is not None:
            self._making_room = victim.replica_id
            self.acts.stop(victim, now, plan, f"its room is wanted: {', '.join(short)} found none")

    def wedged(self, replica_ids: Collection[str], now: float) -> Plan:
        """The routers' word that these replicas have requests in flight and make no
        progress (their health checks may pass). One that stays so for the wedged grace
        fails: its shards are stopped (the agent is told) and a new one is placed, as
        for any failure. Words that stop, or a replica that is no longer Ready, forget."""
        plan = Plan()
        for rid in [r for r in self._wedged_since if r not in replica_ids]:
            del self._wedged_since[rid]
        for rid in replica_ids:
            replica = self.replicas.get(rid)
            if replica is None or replica.state is not R.READY:
                self._wedged_since.pop(rid, None)
                continue
            since = self._wedged_since.setdefault(rid, now)
            if now - since >= self.timing.wedged_grace_s:
                del self._wedged_since[rid]
                self.acts.fail(
                    replica,
                    now,
                    plan,
                    f"wedged: its router saw requests in flight and no progress, "
                    f"for {now - since:.0f} s past its wedged limit; restarting it",
                )
        return plan

    def set_catalog(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.room_short.intersection_update(catalog.models)
        self.spreads.forget_all_but(catalog.models)

    # --- the operator's intent -------------------------------------------------------

    def cordon(self, node_id: str) -> None:
        """Nothing new is placed there; what runs stays."""
        self.cordoned.add(node_id)

    def uncordon(self, node_id: str) -> None:
        """Placement may use the node again (a drain ends too)."""
        self.cordoned.discard(node_id)
        self.draining.discard(node_id)

    def drain(self, node_id: str) -> None:
        """Cordoned, and each replica there moves elsewhere (a rolling move)."""
        self.cordoned.add(node_id)
        self.draining.add(node_id)

    def is_drained(self, node_id: str) -> bool:
        """Draining, and no shard of any replica is left there."""
        return node_id in self.draining and not any(
            s.node_id == node_id for r in self.replicas.values() for s in r.shards
        )

    # --- placement and scaling ------------------------------------------------------

    def allocations(
        self,
        *,
        without: Collection[str] = (),
        nodes: Mapping[str, Node] | None = None,
        needs: Needs | None = None,
    ) -> Allocations:
        """What is handed out (``placing.allocated``)."""
        return allocated(self.replicas, self.catalog, without=without, nodes=nodes, needs=needs)

    def placement_pass(self, nodes: Mapping[str, Node]) -> PassPlacement:
        """What placements over ``nodes`` share (facts, allocations), built on first use."""
        return self._pass(nodes)

    def _pass(self, nodes: Mapping[str, Node]) -> PassPlacement:
        return PassPlacement(
            nodes,
            self.replicas,
            self.catalog,
            cordoned=self.cordoned,
            draining=self.draining,
            cache=self.placement_cache,
        )

    def explain(
        self,
        model: str,
        nodes: Mapping[str, Node],
        now: float,
        shared: PassPlacement | None = None,
    ) -> Decision | None:
        """Where the next replica of ``model`` would go now, and why; None: no such model.
        ``shared``: a ``placement_pass`` of the fleet as it stands, kept by the caller."""
        m = self.catalog.models.get(model)
        if m is None:
            return None
        return (shared or self._pass(nodes)).place(m, now)

    def _scale(
        self, model: Model, mine: list[Replica], shared: PassPlacement, now: float, plan: Plan
    ) -> None:
        """The model's moves (``moves.propose``), then what it is missing placed, then
        each leaving replica's next step (``moves.advance``)."""
        if not model.profiles:
            return
        wanted = self.wanted(model)
        scene = moves.Scene(
            model=model.name,
            wanted=wanted,
            replicas=mine,
            draining=self.draining,
            crash_looping=self.crash_loops.looping(model.name),
            known=self.replicas.keys(),
            cached=self.cached() if model.scaling is not None else {},
            where_to=lambda counting: self._where_to(model, counting, shared, now),
        )
        for phase in moves.Phase:  # each phase sees the moves the one before made
            for move in moves.propose(scene, phase):
                self.acts.begin(
                    move, now, plan, sleep=self._sleeps(move.replica, move.kind, shared)
                )
        missing = wanted - sum(1 for r in mine if r.counts)
        if missing > 0:  # a sleeping replica is woken before anything is placed
            closed = self.cordoned | self.draining
            for replica in sleep.to_wake(mine, missing, shared.nodes, closed):
                self.acts.wake(replica, now, plan, f"{model.name} wants {wanted}")
                missing -= 1
        if missing > 0:
            self._place(model, missing, shared, now, plan)
        room_short = model.name in self.room_short
        for step in moves.advance(wanted, mine, now, self.timing.drain_grace_s, room_short):
            if step.action is moves.Action.STOP:
                self.acts.stop(step.replica, now, plan, "not needed any more")
            else:
                dozes = self._sleeps(step.replica, step.replica.leaving, shared)
                self.acts.drain(step.replica, now, plan, sleep=dozes)

    def _sleeps(self, replica: Replica, kind: MoveKind | None, shared: PassPlacement) -> bool:
        """Whether a replica leaving for ``kind`` sleeps instead of stopping (``sleep``)."""
        if kind is not MoveKind.SURPLUS:  # only demand's let-go sleeps: no profile lookup
            return False
        profile = self.catalog.profile(replica.model, replica.profile)
        return sleep.may_sleep(replica, kind, profile, shared.nodes)

    def _where_to(
        self, model: Model, counting: list[Replica], shared: PassPlacement, now: float
    ) -> moves.Relocation | None:
        """Placement's answer for a spread; not asked while this pass placed its fill or
        while the model is being placed or keeps failing."""
        if shared.placed >= self.timing.max_placements_per_pass or self.crash_loops.watched(
            model.name
        ):
            return None
        return self.spreads.relocation(
            model.name,
            self.wanted(model),
            counting,
            shared.open_nodes,
            lambda without: shared.place(model, now, without=without),
        )

    def _place(
        self, model: Model, missing: int, shared: PassPlacement, now: float, plan: Plan
    ) -> None:
        if (
            not self.crash_loops.may_try(model.name, now)
            or shared.placed >= self.timing.max_placements_per_pass
        ):
            return
        allocations, nodes = shared.allocations(), shared.nodes
        for _ in range(min(missing, self.timing.max_placements_per_pass - shared.placed)):
            decision = shared.place(model, now)
            if decision.profile is None:
                kind = failure_kind(decision)
                plan.placement_failures[model.name] = PlacementFailure(decision.summary, kind)
                if shared.fits_in_place(model, now):
                    self.room_short.add(model.name)
                else:
                    self.room_short.discard(model.name)
                self.crash_loops.failed(model.name, now)
                return
            self.room_short.discard(model.name)
            profile = self.catalog.profile(model.name, decision.profile)
            assert profile is not None
            head = nodes.get(decision.shards[0].node_id)
            replica = starts.new_replica(
                self.ids.new(model.name),
                model,
                profile,
                decision.shards,
                head.address if head is not None else decision.shards[0].node_id,
                self.sealer,
                now,
                {
                    s.node_id: n.inventory.weights_dir
                    for s in decision.shards
                    if (n := nodes.get(s.node_id)) is not None
                },
                self._weights_peers(model, profile, [s.node_id for s in decision.shards], nodes),
            )
            self.replicas[replica.replica_id] = replica
            shared.placed += 1
            for s in replica.shards:
                allocations.take(
                    s.node_id, model.name, s.spec.gpus, s.spec.port, memory=decision.memory
                )
            self.acts.send_starts(replica, plan)
            plan.notes.append(Note(f"placed {replica.replica_id}: {decision.summary}"))

    def _weights_peers(
        self, model: Model, profile: Profile, takers: list[str], nodes: Mapping[str, Node]
    ) -> dict[str, list[WeightsPeer]]:
        """Whom each node of a new replica may take its weights from: agents of its
        fabric that hold them or fetch them, or whose replicas starting now will."""
        source = model.weights_source(profile)
        if not source or profile.model_path:  # peers serve only where sources land
            return {}
        starting = [
            s.node_id
            for r in self.replicas.values()
            if r.state in (R.PENDING, R.STARTING)
            for s in r.shards
            if s.spec.weights_source and same_source(s.spec.weights_source, source)
        ]
        return {n: weights_peers(source, n, nodes, also=starting) for n in takers}

    # --- moves -------------------------------------------------------------------------

    def _clean_up(
        self, replica: Replica, nodes: Mapping[str, Node], now: float, plan: Plan
    ) -> None:
        """Forget a failed or stopping replica once nothing of it can still run."""
        replica.shards = [s for s in replica.shards if not _gone(nodes.get(s.node_id))]
        if not replica.shards or now - replica.state_since > self.timing.stop_timeout_s:
            del self.replicas[replica.replica_id]

    def _let_go(self, replica: Replica, shard: Shard, now: float, plan: Plan, why: str) -> None:
        replica.shards.remove(shard)
        plan.notes.append(Note(f"let go of shard {shard.shard_id} on {shard.node_id}: {why}"))
        if replica.state not in (R.FAILED, R.STOPPING):
            self.acts.fail(replica, now, plan, f"shard {shard.shard_id} on {shard.node_id}: {why}")
        if not replica.shards:
            self.replicas.pop(replica.replica_id, None)

    # --- adoption ------------------------------------------------------------------------

    def _adopt(self, node_id: str, report: ShardReport, now: float, plan: Plan) -> None:
        # adopted even when its model or profile left the catalog: the next pass drains
        # it (the model left) or replaces it (the profile changed), as for any replica
        spec = report.spec
        if not claims.admit(
            node_id, report, self.replicas, self.sealer, plan, self.timing.stop_grace_s
        ):
            return  # another node's shard: it moves nothing
        replica = self.replicas.get(spec.replica_id)
        if replica is None:
            replica = Replica(
                replica_id=spec.replica_id,
                model=spec.model,
                profile=spec.profile,
                world_size=spec.world_size,
                shards=[],
                state=R.PENDING,
                created_at=now,
                state_since=now,
                adopted=True,
            )
            self.replicas[spec.replica_id] = replica
            plan.notes.append(Note(f"adopted replica {spec.replica_id} from {node_id}"))
        same = next((s for s in replica.shards if s.shard_id == spec.shard_id), None)
        rival = next((s for s in replica.shards if s.rank == spec.rank and s is not same), None)
        if rival is not None:
            if rival.came_up or not claims.may_displace(rival, node_id, spec, self.sealer):
                # two really run; the one we did not ask for goes
                plan.stop.append(Stop(node_id, spec.shard_id, self.timing.stop_grace_s))
                plan.notes.append(Note(f"stopping stray shard {spec.shard_id} on {node_id}"))
                return
            # what we merely placed loses to what the agent reports
            replica.shards.remove(rival)
            plan.stop.append(Stop(rival.node_id, rival.shard_id, self.timing.stop_grace_s))
        before = claims.where(same)
        if same is None:
            same = Shard(spec=spec, node_id=node_id)
            replica.shards.append(same)
        same.node_id = node_id
        same.spec = spec
        same.engine_key = report.engine_key or same.engine_key
        same.pid = report.pid or same.pid
        claims.follow(same, before)  # learned from a report: probed before it is routed
        same.state = report.state
        same.detail = report.detail
        _follow_fetch(replica, same, report.fetching, now)
        acts.follow_health(replica, same, report.healthy, plan)
        if report.state == S.READY:
            same.came_up = True
        if replica.state in (R.FAILED, R.STOPPING):
            # we wanted it gone; the stop may have been dropped while the node was away
            plan.stop.append(Stop(node_id, spec.shard_id, self.timing.stop_grace_s))
            return
        self._resolve_conflicts(replica, same, now, plan)
        self.acts.settle(replica, now)

    def _resolve_conflicts(self, replica: Replica, shard: Shard, now: float, plan: Plan) -> None:
        """A reported shard's GPUs or port held by a replica we merely placed: ours loses."""
        for other in list(self.replicas.values()):
            if other is replica:
                continue
            for mine in other.shard_on(shard.node_id):
                clash = set(mine.spec.gpus) & set(shard.spec.gpus) or (
                    mine.spec.port == shard.spec.port and mine.spec.port != 0
                )
                if clash and not mine.came_up:
                    self.acts.fail(
                        other,
                        now,
                        plan,
                        f"its {shard.node_id} resources are held by {replica.replica_id}, which the agent reports running",
                    )

    # --- lookups ---------------------------------------------------------------------------

    def _find(self, shard_id: str) -> tuple[Replica, Shard] | None:
        for replica in self.replicas.values():
            for shard in replica.shards:
                if shard.shard_id == shard_id:
                    return replica, shard
        return None


def _has_head(replica: Replica) -> bool:
    """Whether rank 0 (the shard that serves; a single-node replica's only one) is left."""
    return any(s.rank == 0 for s in replica.shards)


def _follows_its_head(replica: Replica, shard: Shard) -> bool:
    """A multi-node replica's worker rank that ended after rank 0 left, while the replica
    was going anyway: Ray workers exit when their head does, which is no failure."""
    return (
        shard.rank > 0
        and replica.state in (R.DRAINING, R.STOPPING, R.FAILED)
        and not _has_head(replica)
    )


def _follow_fetch(
    replica: Replica, shard: Shard, fetching: FetchProgress | None, now: float
) -> None:
    """A shard fetching its weights, or done with it: its replica's startup clock
    starts again (it counts the engine's start, never the fetch; the agent bounds a
    fetch by its progress)."""
    if fetching is not None or shard.fetching is not None:
        replica.fetched_at = now
    shard.fetching = fetching


def _gone(node: Node | None) -> bool:
    """Nothing of ours can be running there (or nobody could tell us to stop it): the
    node left the table or is Lost."""
    return node is None or node.state is NodeState.LOST


def _startup_timeout(replica: Replica, profile: Profile | None) -> float:
    """The profile's startup timeout, or (its profile gone) the one it was started with."""
    if profile is not None:
        return profile.startup_timeout_s
    return max((s.spec.startup_timeout_s for s in replica.shards), default=0.0)

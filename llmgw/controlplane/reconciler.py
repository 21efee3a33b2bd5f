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
    sits on a Lost node; clean up failed replicas; place replicas for models
    below their count (retrying failures with backoff, not in a tight loop);
    drain the extras above it (``surplus``: never one that serves while one that
    does not could go, and never an adopted one for a replacement); and move replicas off draining nodes as
    a rolling move: a replacement first, the original drained only once the
    replacement is Ready or the drain grace is over, so draining the only
    node that can host a model still finishes. Two more moves work the same
    way, one per model at a time and only while nothing of the model is
    leaving: an outdated replica is replaced (a rollout), and a model crowded
    on one node has a replica moved where placement, asked afresh, would put
    it (a spread; looked at only when the open nodes or the replicas change).
    Neither drains a serving replica whose replacement failed; only a
    replacement with no room beside the old one lets the grace force it.

A multi-node replica (vLLM over Ray) starts its head first: rank 0's Start goes
out when it is placed, the other ranks' once rank 0 runs (reported starting),
since they join the Ray head it starts. It is Ready when every rank is, which
for rank 0 means it serves (its agent's health check). Any rank failing fails
the replica and stops every rank. It drains through rank 0, the only one that
serves; the others are stopped once rank 0 is gone, and their ending then (Ray
workers exit with their head) is no failure.

Every replica failure (an agent's report, a startup timeout, a lost node) is
in the plan's ``failed``, for the fleet manager to keep.

Everything it needs from outside comes in as arguments: ``now`` with every
call, the replica ids from a ``ReplicaIds`` it is given. It does no I/O and
logs nothing: what it did is in the plan's notes, which the fleet manager logs.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping

import attrs

from llmgw.controlplane import claims
from llmgw.controlplane.allocations import Allocations
from llmgw.controlplane.catalog import Catalog, Model, Profile
from llmgw.controlplane.memory import Needs
from llmgw.controlplane.nodes import Node, NodeState, awaited
from llmgw.controlplane.placement import (
    Decision,
    NodeFacts,
    PlacementCache,
    ShardPlacement,
    failure_kind,
    place,
)
from llmgw.controlplane.plan import (
    Drain,
    Note,
    PlacementFailure,
    Plan,
    ReplicaFailed,
    Start,
    Stop,
)
from llmgw.controlplane.replicas import Replica, ReplicaState, Shard
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardStatus

R = ReplicaState
SERVING_OR_COMING = frozenset({R.PENDING, R.STARTING, R.READY})


@attrs.frozen
class Timing:
    startup_margin_s: float = 30.0  # on top of the profile's startup timeout (agent's own bound)
    drain_grace_s: float = 300.0  # a leaving replica is drained at the latest this long after
    drain_timeout_s: float = 120.0  # a draining replica is stopped after this
    stop_timeout_s: float = 60.0  # a stopping replica is forgotten after this
    stop_grace_s: float = 10.0  # SIGTERM -> SIGKILL on the agent
    retry_base_s: float = 5.0
    retry_cap_s: float = 300.0
    # placing costs a few ms per replica at 1,000 nodes: a pass stays short, and
    # the next pass (a second later) places more
    max_placements_per_pass: int = 8
    # after a (re)start, agents get this long to re-register before anything is placed
    # (and nodes known from before, until they are back or Lost): a replica placed in
    # the meantime would double one that is already serving
    settle_s: float = 15.0
    # a replica the routers hold wedged (work, no progress) this long is failed and
    # replaced: its engine is restarted
    wedged_grace_s: float = 60.0
    # an adopted engine that fails every probe this long (not what its node reported) fails
    verify_grace_s: float = 60.0

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


class _PassState:
    """What every model's placement in one pass shares, built on first use only."""

    def __init__(self, rec: Reconciler, nodes: Mapping[str, Node]) -> None:
        self._rec = rec
        self.nodes = nodes
        self.placed = 0
        self.cache = rec.placement_cache
        self._facts: list[NodeFacts] | None = None
        self._allocations: Allocations | None = None
        self._open: frozenset[str] | None = None
        self.needs = Needs(lambda: [n.inventory for n in nodes.values()])

    def facts(self) -> list[NodeFacts]:
        if self._facts is None:
            self._facts = self._rec.facts(self.nodes)
        return self._facts

    def open_nodes(self) -> frozenset[str]:
        """Nodes placement may use: Ready, neither cordoned nor draining."""
        if self._open is None:
            rec = self._rec
            self._open = frozenset(
                n
                for n, node in self.nodes.items()
                if node.state is NodeState.READY and n not in rec.cordoned
            )
        return self._open

    def allocations(self) -> Allocations:
        if self._allocations is None:
            self._allocations = self._rec.allocations(nodes=self.nodes, needs=self.needs)
        return self._allocations

    def place(self, model: Model, now: float, without: Collection[str] = ()) -> Decision:
        """Placement over this pass's nodes, allocations (less ``without``) and needs."""
        rec = self._rec
        a = (
            rec.allocations(without=without, nodes=self.nodes, needs=self.needs)
            if without
            else self.allocations()
        )
        draining = frozenset(rec.draining)
        return place(
            model, self.facts(), a, now, avoid=draining, cache=self.cache, needs=self.needs
        )


@attrs.define
class _Backoff:
    failures: int = 0
    next_attempt: float = 0.0


class Reconciler:
    def __init__(self, catalog: Catalog, timing: Timing | None = None, *, ids: ReplicaIds) -> None:
        self.catalog = catalog
        self.sealer = claims.Sealer.ephemeral()  # seals what it places (the fleet's key)
        self.timing = timing or Timing()
        self.replicas: dict[str, Replica] = {}
        self.cordoned: set[str] = set()
        self.draining: set[str] = set()
        self.backoff: dict[str, _Backoff] = {}
        self.ids = ids
        self.started_at: float | None = None
        # what placement read from each inventory, kept from pass to pass (derived data,
        # never stale): a pass reads only the inventories that changed since the last
        self.placement_cache = PlacementCache()
        # a model whose last placement failed, but would fit in what its moving replicas
        # hold: a rollout or spread of it gives way after the drain grace (``_may_force``)
        self.room_short: dict[str, bool] = {}
        # replicas the routers say are wedged -> since when they have said so
        self._wedged_since: dict[str, float] = {}
        # per model, the open nodes and its replicas when a spread was last looked at
        self._spread_seen: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

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
        shard.engine_key = status.engine_key or shard.engine_key
        shard.pid = status.pid or shard.pid
        self._follow_health(replica, shard, status.healthy, plan)
        if status.output_tail:
            shard.output_tail = list(status.output_tail)
        if status.state == "ready":
            shard.came_up = True
        if status.state in ("failed", "stopped"):
            replica.shards.remove(shard)
            if _follows_its_head(replica, shard):
                pass  # a Ray worker ends with the head it joined: that is how a replica stops
            elif status.state == "failed" or replica.state not in (
                R.STOPPING,
                R.DRAINING,
                R.FAILED,
            ):
                self._fail(
                    replica,
                    now,
                    plan,
                    f"shard {shard.shard_id} on {node_id} {status.state}: {status.detail}",
                    shard=shard,
                    reason=status.detail or status.state,
                )
            if replica.state is R.DRAINING and not _has_head(replica):
                self._stop(replica, now, plan, "drained")  # forgotten in the next pass
        self._settle(replica, now)
        self._send_starts(replica, plan)
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
            replica.outdated = model is not None and _outdated(replica, profile)
            if (model is None or not model.profiles) and replica.state in SERVING_OR_COMING:
                self._remove(replica, now, plan)
            if replica.state in (R.PENDING, R.STARTING):
                limit = _startup_timeout(replica, profile) + t.startup_margin_s
                since = replica.restarted_at
                if now - (replica.created_at if since is None else since) > limit:
                    when = "it was placed" if since is None else "a shard restarted"
                    self._fail(replica, now, plan, f"not ready {limit:g} s after {when}")
                    continue
            if replica.state is R.READY and (why := claims.overdue(replica, now, t.verify_grace_s)):
                self._fail(replica, now, plan, why)
            lost = [s.node_id for s in replica.shards if _gone(nodes.get(s.node_id))]
            if lost and replica.state is not R.FAILED:
                self._fail(replica, now, plan, f"node {lost[0]} is lost")
            if replica.state is R.DRAINING and not _has_head(replica):
                self._stop(replica, now, plan, "drained")  # nothing of it serves
            elif replica.state is R.DRAINING and now - replica.state_since > t.drain_timeout_s:
                self._stop(replica, now, plan, "drain grace over")
            if replica.state in (R.FAILED, R.STOPPING):
                self._clean_up(replica, nodes, now, plan)
            self._send_starts(replica, plan)
        if now - self.started_at < t.settle_s or awaited(nodes.values()):
            return plan  # agents are still coming back: they say what runs first
        by_model: dict[str, list[Replica]] = {}
        for replica in self.replicas.values():
            by_model.setdefault(replica.model, []).append(replica)
        shared = _PassState(self, nodes)  # facts and allocations, built once a pass
        for model in self.catalog.models.values():
            self._scale(model, by_model.get(model.name, []), shared, now, plan)
        return plan

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
                self._fail(
                    replica,
                    now,
                    plan,
                    f"wedged: its router saw requests in flight and no progress, "
                    f"for {now - since:.0f} s past its wedged limit; restarting it",
                )
        return plan

    def set_catalog(self, catalog: Catalog) -> None:
        self.catalog = catalog
        for kept in (self.room_short, self._spread_seen):
            for model in [m for m in kept if m not in catalog.models]:
                del kept[model]

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
        """What is handed out. A failed replica stops counting towards its model at once,
        but its shards hold their GPUs, ports and memory until they report stopped (or
        their node is lost, or the stop timeout is over): a new engine started on a GPU
        the dying one still holds would fail to load. ``without``: replica ids left out,
        to ask where a replica would go if they held nothing. ``needs``: the pass's."""
        needs = needs or Needs()
        a = Allocations()
        for replica in self.replicas.values():
            if replica.replica_id in without:
                continue
            for shard in replica.shards:
                a.take(
                    shard.node_id,
                    replica.model,
                    shard.spec.gpus,
                    shard.spec.port,
                    counts=not replica.leaving,
                    memory=needs.of_shard(self.catalog, shard.spec),
                )
        for node in (nodes or {}).values():  # what else holds engine ports there
            a.hold(node.node_id, node.inventory.busy_ports)
        return a

    def facts(self, nodes: Mapping[str, Node]) -> list[NodeFacts]:
        return [
            NodeFacts(
                node=n, cordoned=n.node_id in self.cordoned, draining=n.node_id in self.draining
            )
            for n in nodes.values()
        ]

    def explain(self, model: str, nodes: Mapping[str, Node], now: float) -> Decision | None:
        """Where the next replica of ``model`` would go now, and why; None: no such model."""
        m = self.catalog.models.get(model)
        if m is None:
            return None
        return _PassState(self, nodes).place(m, now)

    def _scale(
        self, model: Model, mine: list[Replica], shared: _PassState, now: float, plan: Plan
    ) -> None:
        if not model.profiles:
            return
        # rolling move off draining nodes: a replacement first
        for replica in mine:
            on_draining_node = any(n in self.draining for n in replica.nodes)
            if (
                on_draining_node
                and replica.state in SERVING_OR_COMING
                and (not replica.leaving or replica.leaving_why in ("outdated", "spread"))
            ):
                self._leave(replica, now, "drain", plan, "moves off a draining node")
        for replica in mine:
            if self._cancel_move(replica, model):
                replica.leaving, replica.leaving_why = False, ""
                plan.notes.append(
                    Note(
                        f"replica {replica.replica_id} stays: "
                        + (
                            "its profile is as it runs again"
                            if not replica.outdated
                            else "its replacement failed; the move is off"
                        )
                    )
                )
        # one move at a time: a changed profile rolls out, then a crowded model spreads
        if not any(r.leaving for r in mine):
            self._start_move(model, mine, shared, now, plan)
        counting = [r for r in mine if r.counts]
        missing = model.replicas - len(counting)
        if missing > 0:
            self._place(model, missing, shared, now, plan)
        elif missing < 0 and not any(claims.pending(r) for r in counting):  # probed first
            for replica in surplus(counting, -missing, list(self.replicas)):
                self._leave(replica, now, "surplus", plan, "is an extra; draining it")
                self._drain(replica, now, plan)
        ready = sum(1 for r in mine if r.state is R.READY and not r.leaving)
        for replica in mine:
            if not replica.leaving or replica.state in (R.DRAINING, R.FAILED, R.STOPPING):
                continue
            if replica.state in (R.PENDING, R.STARTING):
                self._stop(replica, now, plan, "not needed any more")
            elif ready >= model.replicas or (
                now - replica.leaving_since >= self.timing.drain_grace_s
                and self._may_force(replica)
            ):
                self._drain(replica, now, plan)

    def _leave(self, replica: Replica, now: float, why: str, plan: Plan, words: str) -> None:
        replica.leaving, replica.leaving_since, replica.leaving_why = True, now, why
        plan.notes.append(Note(f"replica {replica.replica_id} {words}"))

    def _may_force(self, replica: Replica) -> bool:
        """Whether a leaving replica drains once the drain grace is over, its replacement
        Ready or not. A draining node and a surplus must end; a rollout or a spread gives
        way only when its replacement cannot be placed for want of the GPUs or ports the
        old one holds (one GPU, one replica: replaced in place). A replacement that fails
        to start never takes the serving replica down with it."""
        if replica.leaving_why not in ("outdated", "spread"):
            return True
        return self.room_short.get(replica.model, False)

    def _fits_in_place(self, model: Model, shared: _PassState, now: float) -> bool:
        """Whether a replacement that cannot be placed would fit in what the model's
        moving replicas (a rollout, a spread) hold. Asked of placement itself, not read
        off the failure's most common reason: with two nodes cordoned and one short of
        a GPU, the reason most nodes gave is "cordoned", yet the old replica's GPU is
        all the new one needs."""
        moving = {
            r.replica_id
            for r in self.replicas.values()
            if r.model == model.name and r.leaving and r.leaving_why in ("outdated", "spread")
        }
        if not moving:
            return False
        return shared.place(model, now, without=moving).profile is not None

    def _cancel_move(self, replica: Replica, model: Model) -> bool:
        """A rollout whose profile was changed back, or a spread whose replacement
        failed, is called off while the replica still serves."""
        if not replica.leaving or replica.state is not R.READY:
            return False
        if replica.leaving_why == "outdated":
            return not replica.outdated
        if replica.leaving_why == "spread":
            backoff = self.backoff.get(model.name)
            return backoff is not None and backoff.failures > 0
        return False

    def _start_move(
        self, model: Model, mine: list[Replica], shared: _PassState, now: float, plan: Plan
    ) -> None:
        counting = [r for r in mine if r.counts]
        stale = [r for r in counting if r.outdated]
        if stale:
            # what does not serve yet goes first, then the oldest
            replica = min(stale, key=lambda r: (r.state is R.READY, r.created_at))
            self._leave(
                replica,
                now,
                "outdated",
                plan,
                f"runs an earlier version of profile {replica.profile}; replacing it "
                "(the new one is Ready before this one drains)",
            )
            return
        move = self._spread(model, counting, shared, now)
        if move is not None:
            replica, target, count = move
            self._leave(
                replica,
                now,
                "spread",
                plan,
                f"moves to {target} to spread {model.name} over nodes "
                f"({count} of its replicas run on {replica.nodes[0]})",
            )

    def _spread(
        self, model: Model, counting: list[Replica], shared: _PassState, now: float
    ) -> tuple[Replica, str, int] | None:
        """A replica to move, where to and how crowded its node is, when a model's
        replicas crowd one node and placement, asked afresh, would now put one
        elsewhere with at least two fewer of them.

        Looked at only when all of the model's replicas serve and the nodes that
        could take one or the replicas changed since the last look (an uncordon,
        a node back): placement costs O(nodes), and a model that cannot spread
        would otherwise be asked again every pass.
        """
        if (
            model.replicas < 2
            or len(counting) < 2
            or any(r.state is not R.READY or r.world_size != 1 for r in counting)
            or shared.placed >= self.timing.max_placements_per_pass
            or model.name in self.backoff
        ):
            return None
        seen = (shared.open_nodes(), frozenset(r.replica_id for r in counting))
        if self._spread_seen.get(model.name) == seen:
            return None
        self._spread_seen[model.name] = seen
        per_node: dict[str, int] = {}
        for r in counting:
            per_node[r.nodes[0]] = per_node.get(r.nodes[0], 0) + 1
        crowded, most = max(per_node.items(), key=lambda kv: (kv[1], kv[0]))
        if most < 2:
            return None
        # the newest there goes: an adopted one has served longest
        replica = max(
            (r for r in counting if r.nodes[0] == crowded),
            key=lambda r: (not r.adopted, r.created_at, r.replica_id),
        )
        decision = shared.place(model, now, without={replica.replica_id})
        if decision.profile is None or len(decision.shards) != 1:
            return None
        target = decision.shards[0].node_id
        if per_node.get(target, 0) + 2 > most:
            return None
        return replica, target, most

    def _place(
        self, model: Model, missing: int, shared: _PassState, now: float, plan: Plan
    ) -> None:
        backoff = self.backoff.setdefault(model.name, _Backoff())
        if now < backoff.next_attempt or shared.placed >= self.timing.max_placements_per_pass:
            return
        allocations, nodes = shared.allocations(), shared.nodes
        for _ in range(min(missing, self.timing.max_placements_per_pass - shared.placed)):
            decision = shared.place(model, now)
            if decision.profile is None:
                kind = failure_kind(decision)
                plan.placement_failures[model.name] = PlacementFailure(decision.summary, kind)
                self.room_short[model.name] = self._fits_in_place(model, shared, now)
                self._back_off(model.name, now)
                return
            self.room_short.pop(model.name, None)
            profile = self.catalog.profile(model.name, decision.profile)
            assert profile is not None
            replica = self._new_replica(model, profile, decision.shards, nodes, now)
            shared.placed += 1
            for s in replica.shards:
                allocations.take(
                    s.node_id, model.name, s.spec.gpus, s.spec.port, memory=decision.memory
                )
            self._send_starts(replica, plan)
            plan.notes.append(Note(f"placed {replica.replica_id}: {decision.summary}"))

    def _new_replica(
        self,
        model: Model,
        profile: Profile,
        placements: list[ShardPlacement],
        nodes: Mapping[str, Node],
        now: float,
    ) -> Replica:
        rid = self.ids.new(model.name)
        shards = []
        head_node = nodes.get(placements[0].node_id)
        head_address = head_node.address if head_node is not None else placements[0].node_id
        for p in placements:
            spec = ShardSpec(
                shard_id=f"{rid}-{p.rank}",
                replica_id=rid,
                model=model.name,
                profile=profile.name,
                engine=profile.engine,
                rank=p.rank,
                world_size=len(placements),
                gpus=list(p.gpus),
                host="0.0.0.0",
                port=p.port,
                model_path=profile.model_path,
                engine_args=list(profile.engine_args),
                env=dict(profile.env),
                settings=dict(profile.settings),
                startup_timeout_s=profile.startup_timeout_s,
                stop_grace_s=profile.stop_grace_s,
                head_address=head_address if len(placements) > 1 else "",
                node_id=p.node_id,
            )
            spec = self.sealer.seal(spec)
            # sent by _send_starts: rank 0 (the Ray head) first, the ranks that join it after
            shards.append(Shard(spec=spec, node_id=p.node_id, sent=False))
        replica = Replica(
            replica_id=rid,
            model=model.name,
            profile=profile.name,
            world_size=len(placements),
            shards=shards,
            state=R.PENDING,
            created_at=now,
            state_since=now,
        )
        self.replicas[rid] = replica
        return replica

    def _send_starts(self, replica: Replica, plan: Plan) -> None:
        """Start what has not been started: rank 0 at once; a multi-node replica's other
        ranks once rank 0 runs (its Ray head is what they join), so the head is first."""
        if replica.state not in (R.PENDING, R.STARTING):
            return
        head = next((s for s in replica.shards if s.rank == 0), None)
        head_runs = head is not None and head.sent and head.state in ("starting", "ready")
        joining = []
        for shard in replica.shards:
            if shard.sent or not (shard.rank == 0 or head_runs):
                continue
            shard.sent = True
            plan.start.append(Start(shard.node_id, shard.spec))
            if shard.rank > 0:
                joining.append(f"{shard.rank} on {shard.node_id}")
        if joining:
            plan.notes.append(
                Note(
                    f"replica {replica.replica_id}: rank 0 runs on {head.node_id if head else '?'}; "
                    f"starting rank {', '.join(joining)} to join it"
                )
            )

    def _back_off(self, model: str, now: float) -> None:
        b = self.backoff.setdefault(model, _Backoff())
        b.failures += 1
        delay = min(self.timing.retry_cap_s, self.timing.retry_base_s * 2 ** (b.failures - 1))
        b.next_attempt = now + delay

    # --- moves -------------------------------------------------------------------------

    def _settle(self, replica: Replica, now: float) -> None:
        """Follow the shards: all ready -> Ready; one starting -> Starting."""
        if replica.state not in (R.PENDING, R.STARTING, R.READY):
            return
        states = [s.state for s in replica.shards]
        if len(states) == replica.world_size and all(s == "ready" for s in states):
            replica.move(R.READY, now)
            self.backoff.pop(replica.model, None)
        elif any(s == "starting" for s in states) and replica.state is not R.STARTING:
            if replica.state is R.READY:
                replica.restarted_at = now
            replica.move(R.STARTING, now)

    def _fail(
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
        replica.leaving, replica.leaving_why = True, "failed"
        plan.notes.append(Note(f"replica {replica.replica_id} failed: {why}", warning=True))
        if not was_serving:
            self._back_off(replica.model, now)
        self._stop_shards(replica, plan)

    def _stop(self, replica: Replica, now: float, plan: Plan, why: str) -> None:
        if replica.state is R.STOPPING:
            return
        replica.move(R.STOPPING, now, why)
        replica.leaving = True
        replica.leaving_why = replica.leaving_why or "stopped"
        plan.notes.append(Note(f"replica {replica.replica_id} stopping: {why}"))
        self._stop_shards(replica, plan)

    def _remove(self, replica: Replica, now: float, plan: Plan) -> None:
        """Its model left the catalog: a serving replica drains (what it is answering
        finishes), one still loading stops."""
        if replica.state is not R.READY:
            self._stop(replica, now, plan, "its model left the catalog")
            return
        self._leave(replica, now, "removed", plan, "drains: its model left the catalog")
        self._drain(replica, now, plan)

    def _drain(self, replica: Replica, now: float, plan: Plan) -> None:
        if replica.state is not R.READY:
            self._stop(replica, now, plan, "not needed any more")
            return
        replica.move(R.DRAINING, now)
        # only rank 0 serves: the other ranks are stopped once it has drained and gone
        for shard in replica.shards:
            if shard.rank == 0:
                plan.drain.append(Drain(shard.node_id, shard.shard_id, self.timing.drain_timeout_s))

    def _stop_shards(self, replica: Replica, plan: Plan) -> None:
        for shard in replica.shards:
            if shard.sent:  # a rank never started is nowhere to stop
                plan.stop.append(Stop(shard.node_id, shard.shard_id, self.timing.stop_grace_s))

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
            self._fail(replica, now, plan, f"shard {shard.shard_id} on {shard.node_id}: {why}")
        if not replica.shards:
            self.replicas.pop(replica.replica_id, None)

    def _follow_health(self, replica: Replica, shard: Shard, healthy: bool, plan: Plan) -> None:
        """Only a ready shard can be unhealthy; a change is noted once, as it happens."""
        healthy = healthy or shard.state != "ready"
        if healthy == shard.healthy:
            return
        shard.healthy = healthy
        where = f"replica {replica.replica_id}: shard {shard.shard_id} on {shard.node_id}"
        if healthy:
            plan.notes.append(Note(f"{where} answers its health check again; routed again"))
        else:
            plan.notes.append(
                Note(f"{where} is unhealthy ({shard.detail}); not routed", warning=True)
            )

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
        self._follow_health(replica, same, report.healthy, plan)
        if report.state == "ready":
            same.came_up = True
        if replica.state in (R.FAILED, R.STOPPING):
            # we wanted it gone; the stop may have been dropped while the node was away
            plan.stop.append(Stop(node_id, spec.shard_id, self.timing.stop_grace_s))
            return
        self._resolve_conflicts(replica, same, now, plan)
        self._settle(replica, now)

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
                    self._fail(
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


def surplus(counting: list[Replica], n: int, known: list[str]) -> list[Replica]:
    """The ``n`` replicas of one model to let go when more count than are wanted.

    The ones not serving go first: a Ready replica is never drained while one
    that is still loading is kept. Then those running an earlier version of
    their profile. Among those that serve, an adopted one ran
    before this control plane started, so it is older than anything placed
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
            r.adopted,
            -r.created_at,
            -order.get(r.replica_id, len(order)),
        ),
    )[:n]


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


def _gone(node: Node | None) -> bool:
    """Nothing of ours can be running there (or nobody could tell us to stop it): the
    node left the table or is Lost."""
    return node is None or node.state is NodeState.LOST


def _outdated(replica: Replica, profile: Profile | None) -> bool:
    """Whether a replica's shards run something other than its profile now says
    (its profile left the model, or the engine, the weights, the arguments, the
    settings, the environment or the GPUs changed). A changed placement rule
    (selector, memory) or startup timeout does not restart a serving engine."""
    if profile is None:
        return True
    if replica.world_size != profile.nodes:
        return True
    return any(
        s.spec.engine != profile.engine
        or s.spec.model_path != profile.model_path
        or s.spec.engine_args != profile.engine_args
        or s.spec.settings != profile.settings
        or s.spec.env != profile.env
        or len(s.spec.gpus) != profile.gpus
        for s in replica.shards
    )


def _startup_timeout(replica: Replica, profile: Profile | None) -> float:
    """The profile's startup timeout, or (its profile gone) the one it was started with."""
    if profile is not None:
        return profile.startup_timeout_s
    return max((s.spec.startup_timeout_s for s in replica.shards), default=0.0)

"""The fleet manager: the reconciler wired to the stream, the clock and the operator.

The reconciler decides; this applies its plans through the dispatcher. It
hears every registration and status report from the ``ControlPlane`` (under
no await), runs a pass on a short interval and right after anything
happened, logs what the reconciler noted, persists the operator's intent,
and reloads the catalog on demand. Everyone else reads the fleet and states
intent through its methods, never through the reconciler.

Commands go out through one outbox per node, each emptied by its own task
(started with the node's first command, gone once the outbox is empty): a
node keeps the order its commands were planned in, and an agent that stops
reading holds up only its own commands, for at most the stream's send
timeout, never another node's.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import trio

from llmgw.config import ConfigError
from llmgw.controlplane import claims
from llmgw.controlplane.catalog import Catalog, load_catalog
from llmgw.controlplane.dispatcher import NodeNotConnected
from llmgw.controlplane.fabrics import missing_weights
from llmgw.controlplane.failures import (
    TAIL_LINES,
    Failure,
    FailureLog,
    how_ended,
    reported_exit,
)
from llmgw.controlplane.filters import ROOM
from llmgw.controlplane.followers import RouterReports
from llmgw.controlplane.intent import IntentStore
from llmgw.controlplane.known import KnownNodes
from llmgw.controlplane.nodes import NodeState, awaited
from llmgw.controlplane.placement import Decision
from llmgw.controlplane.placing import PassPlacement
from llmgw.controlplane.plan import (
    Command,
    Drain,
    Fetch,
    Plan,
    Refusal,
    ReplicaFailed,
    Sleep,
    Start,
    Stop,
    Wake,
)
from llmgw.controlplane.prefetch import Prefetch, plan_prefetch
from llmgw.controlplane.probe import Prober, url_of
from llmgw.controlplane.reconciler import Reconciler, ReplicaIds, Timing
from llmgw.controlplane.replicas import Replica, ReplicaState
from llmgw.controlplane.routing import RoutingPublisher, build_snapshot
from llmgw.controlplane.scaling import Scaling
from llmgw.controlplane.service import ControlPlane
from llmgw.files import write_atomic
from llmgw.protocol.messages import (
    DownMessage,
    DrainShard,
    FetchWeights,
    Register,
    ShardState,
    ShardStatus,
    SleepShard,
    StartShard,
    StopShard,
    WakeShard,
)
from llmgw.routing import ModelLoad, summed

log = logging.getLogger("llmgw.controlplane.fleet")

PASS_INTERVAL_S = 1.0
EXPLAIN_REUSE_S = 1.0  # what placement knows of the nodes, kept between two explanations
REFUSALS_REMEMBERED = 10_000  # refused claims said once each; forgotten past this many
SEAL_KEY_FILE = "placement-key"


def seal_key(state_dir: Path | None) -> bytes:
    """The key placements are sealed with (``claims``), kept in the state directory so
    that a restarted control plane still knows its own placements; a key of this run
    only where there is none to keep (seals then outlive no restart)."""
    if state_dir is None:
        return secrets.token_bytes(32)
    path = state_dir / SEAL_KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("cannot read %s (%s); sealing placements with a key of this run", path, exc)
        return secrets.token_bytes(32)
    key = secrets.token_bytes(32)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, key, 0o600)
    except OSError as exc:
        log.error("cannot write %s (%s); sealing placements with a key of this run", path, exc)
    return key


class FleetManager:
    def __init__(
        self,
        control: ControlPlane,
        catalog: Catalog,
        *,
        catalog_path: Path | None = None,
        state_dir: Path | None = None,
        timing: Timing | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.control = control
        self.catalog_path = catalog_path
        # ids never repeat across control plane restarts
        self.reconciler = Reconciler(catalog, timing, ids=ReplicaIds(secrets.token_hex(3)))
        # placements are sealed with a key that outlives a restart (``claims``)
        self.reconciler.sealer = claims.Sealer(seal_key(state_dir))
        self.intent = IntentStore(state_dir)
        saved = self.intent.load()
        self.reconciler.cordoned = set(saved.cordoned)
        self.reconciler.draining = set(saved.draining)
        self.drained: set[str] = set()  # draining nodes where nothing runs, as of the last pass
        self._clock = clock
        self._started = clock()
        # the nodes from before this start: awaited until they are back or Lost
        self.known = KnownNodes(state_dir)
        expected = control.nodes.expect(self.known.load(), now=self._started, wall=time.time())
        self._awaited = awaited(control.nodes.nodes.values())
        if expected:
            log.info(
                "expecting %d nodes from before this start (%s): nothing is placed until "
                "each is back or Lost (at most %g s), and routers keep their routes there",
                len(expected),
                _some(expected),
                control.policy.lost_after,
            )
        self._plans: list[Plan] = []
        self._outboxes: dict[str, deque[Command]] = {}  # node -> commands not yet sent
        self._wake = trio.Event()
        self.failures = FailureLog()  # the last few engine failures of each model
        self._seen = 0  # the replicas as the last pass left them (``_ring_on_change``)
        self._explaining: tuple[int, float, PassPlacement] | None = None  # (``explain``)
        # the last pass's words for a model placement could not place, and when (wall clock)
        self.cannot_place: dict[str, tuple[str, float]] = {}
        self._cannot_place_kind: dict[str, str] = {}  # placement's bounded reason, for metrics
        self.routing = RoutingPublisher()
        self.routers = RouterReports()  # what the routers that follow the routing report
        # ranged models' counts, from what routers see (the in-process router's load is
        # read through ``load_sources``; standalone routers' comes with their reports)
        self.scaling = Scaling(pinned=saved.pinned)
        self.reconciler.wanted = self.scaling.wanted
        control.metrics.watch_scaling(self.scaling)
        self.load_sources: list[Callable[[], Mapping[str, ModelLoad]]] = []
        # what the in-process router believes ranged models' replicas hold cached (read
        # each pass, with the standalone routers' reports): a scale-down's choice
        self.cache_sources: list[Callable[[], Mapping[str, int]]] = []
        self._cached: dict[str, int] = {}
        self.reconciler.cached = lambda: self._cached
        # engines learned from reports are probed before they are routed
        self.prober = Prober(self._claims, self._probed)
        self._refusals_said: set[tuple[str, str, str]] = set()
        self.publish_routing()
        control.on_register.append(self._registered)
        control.on_shard_status.append(self._status)
        control.metrics.watch_replicas(self._replica_counts)
        control.metrics.watch_model_problems(self.problems)

    # --- inputs ---------------------------------------------------------------

    def _registered(self, node_id: str, msg: Register) -> None:
        self._queue(self.reconciler.registered(node_id, msg.shards, self._clock()))
        self.prober.wake()

    def _status(self, node_id: str, status: ShardStatus) -> None:
        plan = self.reconciler.shard_status(node_id, status, self._clock())
        plan.failed = [reported_exit(failed, status) for failed in plan.failed]
        self._queue(plan)
        if status.state == ShardState.READY:
            self.prober.wake()

    def _claims(self) -> list[tuple[claims.Claim, str]]:
        """The engines waiting for a probe, and where each answers."""
        nodes = self.control.nodes.nodes
        out = []
        for claim in claims.due(self.reconciler.replicas.values()):
            url = url_of(claim, nodes)
            if url is not None:
                out.append((claim, url))
        return out

    def _probed(self, claim: claims.Claim, why: str) -> None:
        self._queue(claims.checked(self.reconciler.replicas.values(), claim, why, self._clock()))

    def _refused(self, refusal: Refusal) -> None:
        """A node's claim to another node's shard: counted each time, said once."""
        self.control.metrics.report_conflicts.labels(refusal.node_id).inc()
        said = (refusal.node_id, refusal.shard_id, refusal.owner)
        if said in self._refusals_said:
            return
        if len(self._refusals_said) >= REFUSALS_REMEMBERED:
            self._refusals_said.clear()
        self._refusals_said.add(said)
        log.warning("%s", claims.refusal_words(refusal))

    def _record(self, failed: ReplicaFailed) -> None:
        """Keep a replica's failure (the agent's words for a failed shard, else ours: a
        startup timeout, a lost node), its exit and its engine's last lines."""
        exit_code, sig = how_ended(failed)
        self.control.changes.ring("replicas")
        self.failures.record(
            Failure(
                model=failed.model,
                replica_id=failed.replica_id,
                shard_id=failed.shard_id,
                node_id=failed.node_id,
                reason=failed.why,
                exit_code=exit_code,
                signal=sig,
                output_tail=list(failed.output_tail[-TAIL_LINES:]),
                at=time.time(),
            )
        )
        self.control.metrics.replica_failures.labels(failed.model, failed.node_id).inc()

    def counting(self) -> dict[str, int]:
        """How many replicas count towards each model (placed, starting or serving, and
        not leaving)."""
        counting: dict[str, int] = {}
        for r in self.replicas():
            if r.counts:
                counting[r.model] = counting.get(r.model, 0) + 1
        return counting

    def below_count(self) -> list[str]:
        """Catalog models with profiles that fewer replicas count towards than wanted."""
        counting = self.counting()
        return [
            name
            for name, m in sorted(self.catalog.models.items())
            if m.profiles and counting.get(name, 0) < self.scaling.wanted(m)
        ]

    def settling_s(self) -> float:
        """How much longer agents have to come back after this control plane started
        (the reconciler's ``settle_s``, from its first pass, and while a node from
        before is awaited, at most until it is Lost); 0 once they have had it. Until
        then its fleet is what the agents back so far have said, not what runs."""
        r = self.reconciler
        now = self._clock()
        left = r.timing.settle_s if r.started_at is None else r.started_at + r.timing.settle_s - now
        if self._awaited and awaited(self.control.nodes.nodes.values()):
            left = max(left, self._started + self.control.policy.lost_after - now)
        return max(0.0, left)

    def unplaceable(self) -> dict[str, tuple[str, float]]:
        """Catalog models below their count whose last placement failed: placement's
        words and when (wall clock)."""
        return {m: self.cannot_place[m] for m in self.below_count() if m in self.cannot_place}

    def weights_missing(self) -> dict[str, str]:
        """Catalog models (that want replicas) whose weights no node reports where nodes
        look, each with a warning in words (``fabrics.missing_weights``)."""
        wanted = [
            (name, [(m.weights_name(p), m.weights_path(p)) for p in m.profiles])
            for name, m in sorted(self.catalog.models.items())
            if m.profiles and (m.replicas > 0 or m.scaling is not None)
        ]
        return missing_weights(self.control.nodes.nodes.values(), wanted)

    def problems(self) -> dict[tuple[str, str], int]:
        """1 for each (model, reason) that keeps a catalog model from running as wanted:
        placement's reason while it cannot be placed, ``weights`` while no node holds
        its weights, ``held_back`` while a range runs fewer than its demand wants because
        another model's floor waits for room (the ``llmgw_model_problems`` gauge)."""
        out = {(m, self._cannot_place_kind.get(m, "other")): 1 for m in self.unplaceable()}
        out.update({(m, "weights"): 1 for m in self.weights_missing()})
        out.update({(m, "held_back"): 1 for m in self.scaling.yielding})
        return out

    def crash_loop_wait(self, model: str) -> float | None:
        """Seconds until the next try at a model whose replicas keep failing, if waiting."""
        return self.reconciler.crash_loops.wait_s(model, self._clock())

    # --- what it reads -----------------------------------------------------------

    @property
    def catalog(self) -> Catalog:
        return self.reconciler.catalog

    def replicas(self) -> Collection[Replica]:
        """Every replica the control plane knows of (a live view: read it, don't keep it)."""
        return self.reconciler.replicas.values()

    def is_cordoned(self, node_id: str) -> bool:
        return node_id in self.reconciler.cordoned

    def is_draining(self, node_id: str) -> bool:
        return node_id in self.reconciler.draining

    def is_drained(self, node_id: str) -> bool:
        return node_id in self.drained

    # --- the operator's intent ----------------------------------------------------------

    def scale(self, model: str, n: int | None) -> str:
        """Pin a ranged model at ``n`` replicas (None: release it to demand); in words.

        Raises:
            ValueError: no such model, or one without a range, or ``n`` out of it.
        """
        m = self.catalog.models.get(model)
        if m is None:
            raise ValueError(f"no model {model!r} in the catalog")
        if m.scaling is None or self.scaling.demand(model) is None:
            raise ValueError(
                f"{model} runs a fixed count ({m.replicas}): give it a range in the catalog "
                "(replicas = { min = 0, max = 4 }) to scale it"
            )
        if n is not None and not 0 <= n <= m.scaling.max:
            raise ValueError(f"{model} may run 0 to {m.scaling.max} replicas (its max), not {n}")
        return self._intent_changed(self.scaling.pin(model, n, self._clock(), time.time()))

    def set_intent(self, node_id: str, intent: str) -> str:
        """cordon, uncordon or drain, by name (as the admin API takes it).

        Raises:
            ValueError: no such intent.
        """
        if intent == "cordon":
            return self.cordon(node_id)
        if intent == "uncordon":
            return self.uncordon(node_id)
        if intent == "drain":
            return self.drain(node_id)
        raise ValueError(f"unknown intent {intent!r} (cordon, uncordon or drain)")

    def cordon(self, node_id: str) -> str:
        self.reconciler.cordon(node_id)
        return self._intent_changed(
            f"node {node_id} cordoned: nothing new is placed there; what runs stays"
        )

    def uncordon(self, node_id: str) -> str:
        self.reconciler.uncordon(node_id)
        return self._intent_changed(f"node {node_id} uncordoned: placement may use it again")

    def drain(self, node_id: str) -> str:
        self.reconciler.drain(node_id)
        return self._intent_changed(
            f"node {node_id} draining: each replica gets a replacement elsewhere and is "
            "stopped once the replacement is Ready (or the drain grace is over)"
        )

    def prefetch(self, model: str, *, fabric: str = "", nodes: Sequence[str] = ()) -> Prefetch:
        """Send the fetches that warm ``model``'s weights (``prefetch.plan_prefetch``),
        and say so in one line.

        Raises:
            ValueError: no such model, it fetches nothing, or a node named is unknown.
        """
        m = self.catalog.models.get(model)
        if m is None:
            raise ValueError(f"no model {model!r} in the catalog: see llmgw ctl models")
        done = plan_prefetch(m, self.control.nodes.nodes, fabric=fabric, only=nodes)
        if done.fetches:
            self._queue(Plan(fetch=list(done.fetches)))
        log.info(
            "prefetching %s's weights (profile %s) on %s%s",
            model,
            done.profile,
            _some([f.node for f in done.fetches]) or "no node",
            "; " + "; ".join(f"not on {n}: {why}" for n, why in done.skipped[:5])
            if done.skipped
            else "",
        )
        return done

    def _intent_changed(self, what: str) -> str:
        """Persist the intent, say what it means, and run a pass soon."""
        self.intent.save(self.reconciler.cordoned, self.reconciler.draining, self.scaling.pins())
        log.info("%s", what)
        self.control.changes.ring("intent")
        self._wake.set()
        return what

    async def reload(self) -> str:
        """Read the catalog file again; a bad file changes nothing and says why.

        The file is read and parsed in a worker thread (a large catalog takes a
        second, during which agents' heartbeats must go on being heard); only
        swapping it in happens on the event loop."""
        path = self.catalog_path
        if path is None:
            raise ConfigError("", "catalog", "the server was started without a catalog file")
        catalog = await trio.to_thread.run_sync(load_catalog, path, abandon_on_cancel=True)
        self.reconciler.set_catalog(catalog)
        self.control.changes.ring("intent")
        self._wake.set()
        # said once, with the keys and the warnings, by whoever asked (admin.reload.Reloader)
        return f"catalog reloaded from {path}: {len(catalog.models)} models"

    def explain(self, model: str) -> Decision | None:
        """Where ``model``'s next replica would go. The facts and allocations of every
        node are kept from one explanation to the next while nothing changes (the bell),
        for at most ``EXPLAIN_REUSE_S``: a console going from model to model reads them
        once, not once per model."""
        now = self._clock()
        nodes = self.control.nodes.nodes
        kept = self._explaining
        count = self.control.changes.count
        if kept is None or kept[0] != count or now - kept[1] >= EXPLAIN_REUSE_S:
            kept = self._explaining = (count, now, self.reconciler.placement_pass(nodes))
        return self.reconciler.explain(model, nodes, now, kept[2])

    # --- the loop ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as senders:  # one task per node with commands to send
            await senders.start(self.prober.run)
            task_status.started()
            while True:
                with trio.move_on_after(PASS_INTERVAL_S):
                    await self._wake.wait()
                self._wake = trio.Event()
                self.reconcile_once()
                self._apply(senders)

    def held(self) -> None:
        """A router holds a request for a model with no replica: a pass now, not within
        the second."""
        self._wake.set()

    def loads(self) -> dict[str, ModelLoad]:
        """Each model's requests at every router now: the in-process router's and the
        standalone routers' heard from lately, summed."""
        standalone = self.routers.loads(self._clock())
        return summed([*(source() for source in self.load_sources), standalone])

    def _follow_demand(self, now: float) -> None:
        """Ranged models' counts from what the routers see now (``scaling``)."""
        self.scaling.follow(self.catalog, self.counting(), settled=self.settled())
        short = [m for m in self.cannot_place if self._cannot_place_kind.get(m) in ROOM]
        self.scaling.room_first(self.catalog, short)
        self.scaling.observe(self.loads(), now, time.time())
        cached = self.routers.cached(now)
        for source in self.cache_sources:
            for replica, blocks in source().items():
                cached[replica] = cached.get(replica, 0) + blocks
        self._cached = cached
        self.scaling.saw(self.replicas())
        for model, profile, took in self.scaling.new_starts:
            self.control.metrics.replica_start_seconds.labels(model, profile).observe(took)
        self.scaling.new_starts.clear()
        for model, profile, took in self.scaling.new_wakes:
            self.control.metrics.replica_wake_seconds.labels(model, profile).observe(took)
        self.scaling.new_wakes.clear()

    def reconcile_once(self) -> None:
        started = time.perf_counter()
        now = self._clock()
        self._follow_demand(now)
        self._plans.append(self.reconciler.wedged(self.routers.wedged(now), now))
        plan = self.reconciler.reconcile(self.control.nodes.nodes, now)
        self.control.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        wall = time.time()
        placed = {start.spec.model for start in plan.start}
        for model in list(self.cannot_place):
            if model in plan.placement_failures:
                continue
            # gone from the catalog, or placed since: what placement said once (before any
            # node registered, say) is no reason for a model waiting out a crash loop
            if model not in self.catalog.models or model in placed:
                del self.cannot_place[model]
        for model, failure in plan.placement_failures.items():
            self.cannot_place[model] = (failure.why, wall)
            self._cannot_place_kind[model] = failure.kind
            self.control.metrics.placement_failures.labels(model, failure.kind).inc()
            log.warning("cannot place %s: %s", model, failure.why)
        self._plans.append(plan)
        self._follow_drains()
        self._follow_known()
        self.publish_routing()
        self._ring_on_change()

    def _ring_on_change(self) -> None:
        """Ring the change bell when this pass moved a replica or changed what placement
        says: one look at every replica, no ring when nothing moved."""
        seen = hash(
            (
                tuple(
                    (r.replica_id, r.state, r.healthy, r.verified, r.leaving, len(r.shards))
                    for r in self.reconciler.replicas.values()
                ),
                tuple(sorted((m, why) for m, (why, _) in self.cannot_place.items())),
            )
        )
        if seen != self._seen:
            self._seen = seen
            self.control.changes.ring("replicas")

    def _follow_known(self) -> None:
        """Keep the list of nodes that are not Lost, and say once when the last node
        awaited since this start is back or Lost."""
        nodes = self.control.nodes.nodes
        self.known.save(n for n, node in nodes.items() if node.state is not NodeState.LOST)
        if not self._awaited:
            return
        self._awaited = awaited(nodes.values())
        if not self._awaited:
            lost = sorted(n for n, node in nodes.items() if node.awaited)
            log.info(
                "every node from before this start is back%s: placement goes on",
                f" or Lost ({_some(lost)})" if lost else "",
            )

    def settled(self) -> bool:
        """Whether this control plane has been up for its lost-node timeout (and its
        settle time, if that is longer): any node it has not heard from since it
        started is Lost by now, so a route it does not publish is gone
        (``llmgw.routing.carried``)."""
        wait = max(self.control.policy.lost_after, self.reconciler.timing.settle_s)
        return self._clock() - self._started >= wait

    def _follow_drains(self) -> None:
        """A draining node is drained once no shard is left there; one line when it becomes so."""
        nodes = self.control.nodes.nodes
        drained = {
            n
            for n in self.reconciler.draining
            if n in nodes and nodes[n].connected and self.reconciler.is_drained(n)
        }
        for node_id in sorted(drained - self.drained):
            log.info("node %s drained: nothing runs there; uncordon it to use it again", node_id)
        if drained != self.drained:
            self.control.changes.ring("intent")
        self.drained = drained

    def publish_routing(self) -> None:
        """Give routers the fleet as this pass left it; wakes them only on a change."""
        r = self.reconciler
        nodes = self.control.nodes.nodes
        asleep = {x.model for x in r.replicas.values() if x.state is ReplicaState.SLEEPING}
        published = self.routing.publish(
            build_snapshot(
                r.catalog,
                r.replicas.values(),
                nodes,
                start_s={
                    name: self.scaling.start_times(m, asleep=name in asleep)
                    for name, m in r.catalog.models.items()
                    if m.scaling is not None
                },
                settled=self.settled(),
                heard=[n for n, node in nodes.items() if not node.awaited],
                keys=self.routing.keys,
                tenant_keys=self.routing.tenant_keys,
                tenants=self.routing.tenants,
            )
        )
        if published:
            self.control.changes.ring("routing")

    def _queue(self, plan: Plan) -> None:
        self._plans.append(plan)
        self._wake.set()

    def _apply(self, senders: trio.Nursery) -> None:
        """Log each plan's notes and post its commands, under no await."""
        plans, self._plans = self._plans, []
        for plan in plans:
            for note in plan.notes:
                log.log(logging.WARNING if note.warning else logging.INFO, "%s", note.text)
            for failed in plan.failed:
                self._record(failed)
            for refusal in plan.refused:
                self._refused(refusal)
            # stops first: what is being replaced lets go of its resources soonest
            for command in plan.commands():
                box = self._outboxes.get(command.node)
                if box is None:
                    box = self._outboxes[command.node] = deque()
                    senders.start_soon(self._send_all, command.node, box)
                box.append(command)

    async def _send_all(self, node: str, box: deque[Command]) -> None:
        """Send a node's commands in order until its outbox is empty, then let it go."""
        try:
            while box:
                await self._send(node, _message(box.popleft()))
        finally:
            if self._outboxes.get(node) is box:
                del self._outboxes[node]

    async def _send(self, node: str, message: DownMessage) -> None:
        try:
            await self.control.dispatcher.send(node, message)
        except NodeNotConnected as exc:
            log.info("not sent: %s", exc)

    def _replica_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for r in self.replicas():
            # a Ready replica whose engine does not answer is not served from: counted apart
            unhealthy = r.state is ReplicaState.READY and not r.healthy
            # nor is one whose engine is not yet found to be what its node reported
            unverified = r.state is ReplicaState.READY and not r.verified
            state = "Unhealthy" if unhealthy else "Unverified" if unverified else r.state.value
            key = (r.model, state)
            counts[key] = counts.get(key, 0) + 1
        return counts


def _some(names: list[str], most: int = 10) -> str:
    """Names for a log line, the first ``most`` of them."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _message(command: Command) -> DownMessage:
    match command:
        case Start(spec=spec):
            return StartShard(spec=spec)
        case Stop(shard_id=shard_id, grace_s=grace):
            # the agent knows the shard's grace (its profile's, in the spec, or its own)
            return StopShard(shard_id=shard_id, grace_s=grace, agent_grace=True)
        case Drain(shard_id=shard_id, grace_s=grace):
            return DrainShard(shard_id=shard_id, grace_s=grace)
        case Sleep(shard_id=shard_id, grace_s=grace):
            return SleepShard(shard_id=shard_id, grace_s=grace)
        case Wake(shard_id=shard_id):
            return WakeShard(shard_id=shard_id)
        case Fetch(source=source, path=path, sha256=sha256, stall_s=stall_s, peers=peers):
            return FetchWeights(
                source=source, path=path, sha256=sha256, stall_s=stall_s, peers=list(peers)
            )

"""The fleet manager: the reconciler wired to the stream, the clock and the operator.

The reconciler decides; this applies its plans through the dispatcher. It
hears every registration and status report from the ``ControlPlane`` (under
no await), runs a pass on a short interval and right after anything
happened, persists the operator's intent, and reloads the catalog on demand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio

from llmgw.config import ConfigError
from llmgw.controlplane.catalog import Catalog, load_catalog
from llmgw.controlplane.dispatcher import NodeNotConnected
from llmgw.controlplane.intent import IntentStore
from llmgw.controlplane.placement import Decision, place
from llmgw.controlplane.reconciler import Plan, Reconciler, Timing
from llmgw.controlplane.routing import RoutingPublisher, build_snapshot
from llmgw.controlplane.service import ControlPlane
from llmgw.protocol.messages import DrainShard, Register, ShardStatus, StartShard, StopShard

log = logging.getLogger("llmgw.controlplane.fleet")

PASS_INTERVAL_S = 1.0


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
        self.reconciler = Reconciler(catalog, timing)
        self.intent = IntentStore(state_dir)
        saved = self.intent.load()
        self.reconciler.cordoned = set(saved.cordoned)
        self.reconciler.draining = set(saved.draining)
        self._clock = clock
        self._plans: list[Plan] = []
        self._wake = trio.Event()
        self.routing = RoutingPublisher()
        self.publish_routing()
        control.on_register.append(self._registered)
        control.on_shard_status.append(self._status)
        control.metrics.watch_replicas(self._replica_counts)

    # --- inputs ---------------------------------------------------------------

    def _registered(self, node_id: str, msg: Register) -> None:
        self._queue(self.reconciler.registered(node_id, msg.shards, self._clock()))

    def _status(self, node_id: str, status: ShardStatus) -> None:
        self._queue(self.reconciler.shard_status(node_id, status, self._clock()))

    def set_intent(self, node_id: str, intent: str) -> str:
        """cordon, uncordon or drain: one entry point, so the difference is explicit."""
        r = self.reconciler
        if intent == "cordon":
            r.cordoned.add(node_id)
            what = f"node {node_id} cordoned: nothing new is placed there; what runs stays"
        elif intent == "uncordon":
            r.cordoned.discard(node_id)
            r.draining.discard(node_id)
            what = f"node {node_id} uncordoned: placement may use it again"
        elif intent == "drain":
            r.cordoned.add(node_id)
            r.draining.add(node_id)
            what = (
                f"node {node_id} draining: each replica gets a replacement elsewhere and is "
                "stopped once the replacement is Ready (or the drain grace is over)"
            )
        else:
            raise ValueError(f"unknown intent {intent!r} (cordon, uncordon or drain)")
        self.intent.save(r.cordoned, r.draining)
        log.info("%s", what)
        self._wake.set()
        return what

    def reload(self) -> str:
        """Read the catalog file again; a bad file changes nothing and says why."""
        if self.catalog_path is None:
            raise ConfigError("", "catalog", "the server was started without a catalog file")
        catalog = load_catalog(self.catalog_path)
        self.reconciler.set_catalog(catalog)
        self._wake.set()
        what = f"catalog reloaded from {self.catalog_path}: {len(catalog.models)} models"
        log.info("%s", what)
        return what

    def explain(self, model: str) -> Decision | None:
        m = self.reconciler.catalog.models.get(model)
        if m is None:
            return None
        r = self.reconciler
        return place(
            m,
            r.facts(self.control.nodes.nodes),
            r.allocations(),
            self._clock(),
            avoid=frozenset(r.draining),
        )

    # --- the loop ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(PASS_INTERVAL_S):
                await self._wake.wait()
            self._wake = trio.Event()
            self.reconcile_once()
            await self._apply()

    def reconcile_once(self) -> None:
        started = time.perf_counter()
        plan = self.reconciler.reconcile(self.control.nodes.nodes, self._clock())
        self.control.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        for model, why in plan.placement_failures.items():
            kind = plan.failure_kinds.get(model, "other")
            self.control.metrics.placement_failures.labels(model, kind).inc()
            log.warning("cannot place %s: %s", model, why)
        self._plans.append(plan)
        self.publish_routing()

    def publish_routing(self) -> None:
        """Give routers the fleet as this pass left it; wakes them only on a change."""
        r = self.reconciler
        self.routing.publish(
            build_snapshot(r.catalog, r.replicas.values(), self.control.nodes.nodes)
        )

    def _queue(self, plan: Plan) -> None:
        self._plans.append(plan)
        self._wake.set()

    async def _apply(self) -> None:
        plans, self._plans = self._plans, []
        for plan in plans:
            for note in plan.notes:
                log.info("%s", note)
            # stops first: what is being replaced lets go of its resources soonest
            for node, shard, grace in plan.stop:
                await self._send(node, StopShard(shard_id=shard, grace_s=grace))
            for node, shard, grace in plan.drain:
                await self._send(node, DrainShard(shard_id=shard, grace_s=grace))
            for node, spec in plan.start:
                await self._send(node, StartShard(spec=spec))

    async def _send(self, node: str, message: StartShard | StopShard | DrainShard) -> None:
        try:
            await self.control.dispatcher.send(node, message)
        except NodeNotConnected as exc:
            log.info("not sent: %s", exc)

    def _replica_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for r in self.reconciler.replicas.values():
            key = (r.model, r.state.value)
            counts[key] = counts.get(key, 0) + 1
        return counts

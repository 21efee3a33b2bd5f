"""The control plane's side of routing: build the snapshot, publish it on change.

``build_snapshot`` is a function of the catalog, the replicas and the nodes.
``RoutingPublisher`` holds the current snapshot; ``publish`` replaces it only
when its version differs and then wakes everyone waiting in ``next``: the
in-process router's table and every ``GET /v1/routing`` watcher. Nobody polls,
so a change reaches a waiting router as soon as the pass that made it ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
import trio

from llmgw.addr import url_host
from llmgw.controlplane.catalog import Catalog, routing_for
from llmgw.controlplane.memory import Needs
from llmgw.controlplane.nodes import Node
from llmgw.controlplane.replicas import Replica, ReplicaState
from llmgw.routing import ModelRouting, Route, RouterKey, Snapshot, TenantRouting, versioned

_ROUTED = (ReplicaState.READY, ReplicaState.DRAINING)


def build_snapshot(
    catalog: Catalog,
    replicas: Iterable[Replica],
    nodes: Mapping[str, Node],
    *,
    settled: bool = True,
    heard: Iterable[str] = (),
    keys: Iterable[RouterKey] = (),
    tenant_keys: Iterable[RouterKey] = (),
    tenants: Iterable[TenantRouting] = (),
    start_s: Mapping[str, float] = {},
) -> Snapshot:
    """What a router needs to know: every catalog model, the static endpoints, and
    each Ready or Draining replica at its head shard's node address (a Ready one
    that is unhealthy, or not yet verified, as not ready); ``settled`` and ``heard``:
    whether the control plane has been up for its lost-node timeout, and if not, the
    nodes it has heard from since it started (``llmgw.routing.carried``); ``keys``:
    the API keys of the control plane's config, for standalone routers;
    ``tenant_keys`` and ``tenants``: its tenants' keys and limits; ``start_s``: each
    model with a range, how long one of its replicas takes to start."""
    models: dict[str, ModelRouting] = {}
    routes: list[Route] = []
    needs = Needs(lambda: [n.inventory for n in nodes.values()])
    for name, entry in catalog.models.items():
        models[name] = ModelRouting(
            target_waiting=entry.routing.target_waiting,
            kv_ceiling=entry.routing.kv_ceiling,
            scales=entry.scaling is not None,
            start_s=round(start_s.get(name, 0.0), 1) if entry.scaling is not None else 0.0,
        )
        routes.extend(
            Route(
                key=url,
                model=name,
                url=url.rstrip("/"),
                engine=entry.static_engine,
                affinity=entry.routing.affinity,
                affinity_bound=entry.routing.affinity_bound,
            )
            for url in entry.static_endpoints
        )
    for replica in replicas:
        if replica.state not in _ROUTED:
            continue
        head = next((s for s in replica.shards if s.rank == 0), None)
        node = nodes.get(head.node_id) if head is not None else None
        if head is None or node is None:
            continue
        model = catalog.models.get(replica.model)
        own = routing_for(model, replica.profile) if model is not None else None
        profile = model.profile(replica.profile) if model is not None else None
        holds = (
            needs.cache_tokens(model, profile)
            if model is not None and profile is not None
            else None
        )
        routes.append(
            Route(
                key=replica.replica_id,
                model=replica.model,
                url=engine_url(node, head.spec.host, head.spec.port),
                engine=head.spec.engine,
                weight=own.weight if own is not None else 1.0,
                target_waiting=own.target_waiting if own is not None else None,
                kv_ceiling=own.kv_ceiling if own is not None else None,
                # an engine that answers no health check takes no new request, nor one
                # not yet found to be what its node reported (``claims``)
                ready=replica.state is ReplicaState.READY and replica.healthy and replica.verified,
                verifying=replica.state is ReplicaState.READY
                and replica.healthy
                and replica.verifying,
                draining=replica.state is ReplicaState.DRAINING,
                engine_key=head.engine_key,
                node=head.node_id,
                affinity=own.affinity if own is not None else "prefix",
                affinity_bound=own.affinity_bound if own is not None else 1.5,
                cache_tokens=holds,
            )
        )
    return versioned(
        models,
        routes,
        settled=settled,
        heard=heard,
        keys=keys,
        tenant_keys=tenant_keys,
        tenants=tenants,
    )


def engine_url(node: Node, host: str, port: int) -> str:
    """Where a shard's engine answers: its node's address (its spec's ``host`` where the
    node says none), the port it was given."""
    return f"http://{url_host(node.address or host)}:{port}"


class RoutingPublisher:
    """The current routing snapshot, and a way to wait for the next one. (What the
    routers that follow it report is kept apart: ``followers.RouterReports``.)"""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self.snapshot = snapshot or versioned({}, [])
        # the API keys every snapshot carries (hashes: the config's [[router.keys]])
        self.keys: list[RouterKey] = list(self.snapshot.keys)
        self.tenant_keys: list[RouterKey] = list(self.snapshot.tenant_keys)
        self.tenants: list[TenantRouting] = list(self.snapshot.tenants)
        self.body = msgspec.json.encode(self.snapshot)  # what every watcher is sent
        self._changed = trio.Event()

    def publish(self, snapshot: Snapshot) -> bool:
        """Make ``snapshot`` current if it says something new; True when it did."""
        if snapshot.version == self.snapshot.version:
            return False
        self.snapshot = snapshot
        self.body = msgspec.json.encode(snapshot)
        self._changed.set()
        self._changed = trio.Event()
        return True

    def set_keys(self, keys: list[RouterKey]) -> bool:
        """Carry ``keys`` (the config's) from now on (in this snapshot and every one
        after); True when that changed what routers are sent."""
        self.keys = list(keys)
        return self._again()

    def set_tenancy(self, keys: list[RouterKey], tenants: list[TenantRouting]) -> bool:
        """Carry the tenants' ``keys`` and ``tenants`` from now on, beside the config's
        keys; True when that changed what routers are sent."""
        self.tenant_keys = list(keys)
        self.tenants = list(tenants)
        return self._again()

    def _again(self) -> bool:
        s = self.snapshot
        return self.publish(
            versioned(
                s.models,
                s.routes,
                settled=s.settled,
                heard=s.heard,
                keys=self.keys,
                tenant_keys=self.tenant_keys,
                tenants=self.tenants,
            )
        )

    @property
    def watchers(self) -> int:
        """How many are waiting for the next snapshot now."""
        return self._changed.statistics().tasks_waiting

    async def next(self, since: str) -> Snapshot:
        """The current snapshot as soon as its version is not ``since``."""
        while self.snapshot.version == since:
            await self._changed.wait()
        return self.snapshot

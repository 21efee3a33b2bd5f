"""The routing table: which endpoints serve each model, kept in step with the fleet.

The table is built from a ``Snapshot``: inside ``llmgw server`` straight from
the fleet manager's replicas, a few times a second; in a standalone
``llmgw router`` from the control plane's ``GET /v1/routing`` watch (a long
poll that answers when the snapshot changes). Endpoints keep their identity
across refreshes, so each keeps its in-flight count, breaker and load
signals. A Draining replica stays in the table (its in-flight requests
finish) but takes no new request.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import httpx
import msgspec
import trio

from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.replicas import ReplicaState
from llmgw.engines import adapters
from llmgw.engines.base import url_host
from llmgw.router.balancer import Admission, Endpoint

log = logging.getLogger("llmgw.router")

REFRESH_S = 0.25
SCRAPE_S = 1.0


class Route(msgspec.Struct, kw_only=True):
    key: str  # replica id, or the static URL
    model: str
    url: str
    engine: str = ""  # "" for static endpoints: no metrics to scrape
    weight: float = 1.0
    ready: bool = True
    draining: bool = False


class ModelRouting(msgspec.Struct, kw_only=True):
    target_waiting: float | None = None
    kv_ceiling: float | None = None


class Snapshot(msgspec.Struct, kw_only=True):
    version: str = ""
    models: dict[str, ModelRouting] = {}  # every model the catalog knows
    routes: list[Route] = []


def static_endpoints(fleet: FleetManager | None) -> dict[str, list[str]]:
    """The catalog's router-only entries: model -> URLs."""
    if fleet is None:
        return {}
    models = fleet.reconciler.catalog.models.values()
    return {m.name: list(m.static_endpoints) for m in models if m.static_endpoints}


def fleet_snapshot(fleet: FleetManager | None, static: dict[str, list[str]]) -> Snapshot:
    """What the router needs to know, from the control plane's current state."""
    routes = [
        Route(key=url, model=m, url=url.rstrip("/")) for m, urls in static.items() for url in urls
    ]
    models = {m: ModelRouting() for m in static}
    if fleet is not None:
        catalog = fleet.reconciler.catalog
        for name, entry in catalog.models.items():
            models[name] = ModelRouting(
                target_waiting=entry.routing.target_waiting, kv_ceiling=entry.routing.kv_ceiling
            )
        nodes = fleet.control.nodes.nodes
        for replica in fleet.reconciler.replicas.values():
            if replica.state not in (ReplicaState.READY, ReplicaState.DRAINING):
                continue
            head = next((s for s in replica.shards if s.rank == 0), None)
            node = nodes.get(head.node_id) if head is not None else None
            if head is None or node is None:
                continue
            model = catalog.models.get(replica.model)
            routes.append(
                Route(
                    key=replica.replica_id,
                    model=replica.model,
                    url=f"http://{url_host(node.address or head.spec.host)}:{head.spec.port}",
                    engine=head.spec.engine,
                    weight=model.routing.weight if model is not None else 1.0,
                    ready=replica.state is ReplicaState.READY,
                    draining=replica.state is ReplicaState.DRAINING,
                )
            )
    routes.sort(key=lambda r: r.key)
    snap = Snapshot(models=models, routes=routes)
    snap.version = hashlib.sha256(msgspec.json.encode(snap)).hexdigest()[:16]
    return snap


class FleetRouting:
    """The control plane's routing snapshot, computed at most once per ``max_age_s``
    however many ask: the in-process router's table and every ``GET /v1/routing``
    watcher (one per standalone router worker) read the same one, instead of each
    rebuilding it (routes, JSON, hash) on the same beat."""

    def __init__(self, fleet: FleetManager | None, max_age_s: float = REFRESH_S) -> None:
        self.fleet = fleet
        self.max_age_s = max_age_s
        self._snap: Snapshot | None = None
        self._at = 0.0

    def __call__(self) -> Snapshot:
        now = trio.current_time()
        if self._snap is None or now - self._at >= self.max_age_s:
            self._snap = fleet_snapshot(self.fleet, static_endpoints(self.fleet))
            self._at = now
        return self._snap


class RoutingTable:
    def __init__(self, source: Callable[[], Snapshot] | None = None) -> None:
        self.source = source  # None: fed by ``apply`` (a standalone router's watch)
        self.version = ""
        self.endpoints: dict[str, list[Endpoint]] = {}
        self.admission: dict[str, Admission] = {}
        self._known: frozenset[str] = frozenset()
        self._by_key: dict[str, Endpoint] = {}
        self._engines: dict[str, str] = {}  # key -> engine, for scraping
        if source is not None:
            self.apply(source())

    def known(self, model: str) -> bool:
        return model in self._known

    def apply(self, snap: Snapshot) -> None:
        if snap.version and snap.version == self.version:
            return
        table: dict[str, list[Endpoint]] = {}
        seen: set[str] = set()
        for route in snap.routes:
            ep = self._by_key.get(route.key)
            if ep is None or ep.url != route.url:
                ep = self._by_key[route.key] = Endpoint(
                    key=route.key, model=route.model, url=route.url
                )
            ep.weight = route.weight
            ep.ready = route.ready
            ep.draining = route.draining
            self._engines[route.key] = route.engine
            table.setdefault(route.model, []).append(ep)
            seen.add(route.key)
        for key in list(self._by_key):
            if key not in seen and self._by_key[key].in_flight == 0:
                del self._by_key[key]
                self._engines.pop(key, None)
        self.admission = {
            m: Admission(target_waiting=r.target_waiting, kv_ceiling=r.kv_ceiling)
            for m, r in snap.models.items()
        }
        self._known = frozenset(snap.models)
        self.endpoints = table
        self.version = snap.version

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.source is not None:
                nursery.start_soon(self._refresh_loop)
            nursery.start_soon(self._scrape_loop)
            task_status.started()

    async def _refresh_loop(self) -> None:
        assert self.source is not None
        while True:
            await trio.sleep(REFRESH_S)
            self.apply(self.source())

    async def _scrape_loop(self) -> None:
        engines = adapters()
        async with httpx.AsyncClient(timeout=SCRAPE_S) as client:
            while True:
                for key, engine in list(self._engines.items()):
                    ep = self._by_key.get(key)
                    adapter = engines.get(engine)
                    if ep is None or adapter is None:
                        continue
                    try:
                        r = await client.get(ep.url + "/metrics")
                    except httpx.HTTPError:
                        continue  # stale signals degrade to the in-flight count
                    if r.status_code == 200:
                        ep.load = adapter.parse_metrics(r.text)
                        ep.load_at = trio.current_time()
                await trio.sleep(SCRAPE_S)


async def follow(table: RoutingTable, admin_url: str, token: str, *, poll_s: float = 25.0) -> None:
    """Keep ``table`` in step with the control plane's routing, over a long-poll watch.

    The control plane answers at once when the snapshot differs from the version
    we hold, or after ``poll_s`` with the same one. While it is unreachable the
    table stays as it was: engines keep serving, the router keeps routing.
    """
    delay = 0.5
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=poll_s + 10) as client:
        while True:
            try:
                r = await client.get(
                    admin_url.rstrip("/") + "/v1/routing",
                    params={"since": table.version, "wait": str(poll_s)},
                    headers=headers,
                )
                r.raise_for_status()
                snap = msgspec.json.decode(r.content, type=Snapshot)
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                log.warning(
                    "cannot follow the control plane's routing (%s); keeping the table", exc
                )
                await trio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            delay = 0.5
            if snap.version != table.version:
                log.info("routing table now version %s: %d routes", snap.version, len(snap.routes))
            table.apply(snap)

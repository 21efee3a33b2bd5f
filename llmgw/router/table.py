"""The routing table: which endpoints serve each model, kept in step with the fleet.

Endpoints are refreshed from the control plane's replicas a few times a
second and keep their identity across refreshes, so each keeps its own
in-flight count, breaker and load signals. A Draining replica stays in the
table (its in-flight requests finish) but takes no new request.
"""

from __future__ import annotations

import logging

import httpx
import trio

from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.replicas import ReplicaState
from llmgw.engines.llamacpp import url_host
from llmgw.router.balancer import Admission, Endpoint

log = logging.getLogger("llmgw.router")

REFRESH_S = 0.25
SCRAPE_S = 1.0


class RoutingTable:
    def __init__(
        self, fleet: FleetManager | None, static: dict[str, list[str]] | None = None
    ) -> None:
        self.fleet = fleet
        self.static = static or {}
        self.endpoints: dict[str, list[Endpoint]] = {}
        self.admission: dict[str, Admission] = {}
        self._by_key: dict[str, Endpoint] = {}
        self._metrics_urls: dict[str, tuple[str, str]] = {}  # key -> (url, engine)
        self.refresh()

    def known(self, model: str) -> bool:
        if model in self.static:
            return True
        return self.fleet is not None and model in self.fleet.reconciler.catalog.models

    def refresh(self) -> None:
        table: dict[str, list[Endpoint]] = {}
        seen: set[str] = set()
        for model, urls in self.static.items():
            for url in urls:
                table.setdefault(model, []).append(self._endpoint(url, model, url.rstrip("/")))
                seen.add(url)
        if self.fleet is not None:
            catalog = self.fleet.reconciler.catalog
            nodes = self.fleet.control.nodes.nodes
            for replica in self.fleet.reconciler.replicas.values():
                if replica.state not in (ReplicaState.READY, ReplicaState.DRAINING):
                    continue
                head = next((s for s in replica.shards if s.rank == 0), None)
                node = nodes.get(head.node_id) if head is not None else None
                if head is None or node is None:
                    continue
                host = url_host(node.address or head.spec.host)
                base = f"http://{host}:{head.spec.port}"
                ep = self._endpoint(replica.replica_id, replica.model, base)
                entry = catalog.models.get(replica.model)
                if entry is not None:
                    ep.weight = entry.routing.weight
                    self.admission[replica.model] = Admission(
                        target_waiting=entry.routing.target_waiting,
                        kv_ceiling=entry.routing.kv_ceiling,
                    )
                ep.ready = replica.state is ReplicaState.READY
                ep.draining = replica.state is ReplicaState.DRAINING
                self._metrics_urls[replica.replica_id] = (f"{base}/metrics", head.spec.engine)
                table.setdefault(replica.model, []).append(ep)
                seen.add(replica.replica_id)
        for key in list(self._by_key):
            if key not in seen and self._by_key[key].in_flight == 0:
                del self._by_key[key]
                self._metrics_urls.pop(key, None)
        self.endpoints = table

    def _endpoint(self, key: str, model: str, url: str) -> Endpoint:
        ep = self._by_key.get(key)
        if ep is None or ep.url != url:
            ep = self._by_key[key] = Endpoint(key=key, model=model, url=url)
        return ep

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._refresh_loop)
            nursery.start_soon(self._scrape_loop)
            task_status.started()

    async def _refresh_loop(self) -> None:
        while True:
            await trio.sleep(REFRESH_S)
            self.refresh()

    async def _scrape_loop(self) -> None:
        from llmgw.agent.supervisor import adapters

        engines = adapters()
        async with httpx.AsyncClient(timeout=SCRAPE_S) as client:
            while True:
                for key, (url, engine) in list(self._metrics_urls.items()):
                    ep = self._by_key.get(key)
                    adapter = engines.get(engine)
                    if ep is None or adapter is None:
                        continue
                    try:
                        r = await client.get(url)
                    except httpx.HTTPError:
                        continue  # stale signals degrade to the in-flight count
                    if r.status_code == 200:
                        ep.load = adapter.parse_metrics(r.text)
                        ep.load_at = trio.current_time()
                await trio.sleep(SCRAPE_S)

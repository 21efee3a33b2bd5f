"""What ``ctl bench`` aims at and measures on: the model's replicas, their routes and
nodes as the management API says them, the router's URL and an API key for it.

All of it is read before the first request: a replica that is not Ready, a model
the catalog lacks, a router that cannot be found or a key that is missing is
said at once, and no level is measured to be thrown away. ``Fleet.describe``
names the engine, its version and the hardware the result is kept with.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.addr import url_host
from llmgw.admin.views import ModelList, NodeList, NodeView, ReplicaList, ReplicaView
from llmgw.bench import results
from llmgw.bench.ladder import Scrape
from llmgw.cli.admin_client import AdminClient, CtlError, Target
from llmgw.config import ConfigError, ServerConfig, load_config, parse_hostport
from llmgw.config.loader import read_text
from llmgw.config.schema import StandaloneRouterConfig
from llmgw.engines import installed
from llmgw.routing import Route, Snapshot


class Fleet:
    """What the management API says of the model: replicas, routes, nodes."""

    def __init__(self, model: str, replicas: list[ReplicaView], routing: Snapshot,
                 nodes: list[NodeView]) -> None:  # fmt: skip
        self.model = model
        self.replicas = [r for r in replicas if r.model == model]
        self.routes = {r.key: r for r in routing.routes}
        self.nodes = {n.node_id: n for n in nodes}
        self.ready = [r for r in self.replicas if r.state == "Ready"]

    @classmethod
    def read(cls, client: AdminClient, model: str) -> Fleet:
        models = client.get("/v1/models", ModelList).models
        if not any(m.model == model for m in models):
            known = ", ".join(sorted(m.model for m in models)) or "none"
            raise CtlError(f"no model {model!r} in the catalog (models: {known})")
        return cls(
            model,
            client.get("/v1/replicas", ReplicaList).replicas,
            client.get("/v1/routing", Snapshot),
            client.get("/v1/nodes", NodeList).nodes,
        )

    def replica(self, rid: str) -> ReplicaView:
        for r in self.replicas:
            if r.replica_id == rid:
                return r
        known = ", ".join(r.replica_id for r in self.replicas) or "none"
        raise CtlError(f"model {self.model} has no replica {rid!r} (its replicas: {known})")

    def route(self, rid: str) -> Route:
        replica = self.replica(rid)
        route = self.routes.get(rid)
        if route is None or replica.state != "Ready":
            raise CtlError(f"replica {rid} is {replica.state}, not serving: pick a Ready one")
        return route

    def describe(self, rids: list[str]) -> tuple[str, str, results.Hardware]:
        engines, versions = set(), set()
        hw = results.Hardware()
        for rid in rids:
            r = self.replica(rid)
            route = self.routes.get(rid)
            engine = route.engine if route is not None else ""
            for shard in r.shards:
                node = self.nodes.get(shard.node_id)
                engines.add(engine)
                versions.add(_engine_version(node, engine))
                if shard.node_id in hw.nodes:
                    continue
                hw.nodes.append(shard.node_id)
                gpus = {g.index: g for g in node.gpus} if node is not None else {}
                hw.gpus += [gpus[i].name if i in gpus else "?" for i in shard.gpus]
                if node is not None:
                    hw.cpus = node.cpus or hw.cpus
                    if node.memory_total_bytes:
                        hw.memory_gb = node.memory_total_bytes / (1 << 30)
        return (
            engines.pop() if len(engines) == 1 else "mixed",
            versions.pop() if len(versions) == 1 else "mixed",
            hw,
        )


def _engine_version(node: NodeView | None, engine: str) -> str:
    """The version of ``engine`` its node reports ("" where it says none): its first
    required program's (vllm-ray's is vllm's)."""
    if node is None:
        return ""
    name = installed(engine)[0]
    return node.engines.get(name, "")


def scrape(route: Route) -> Scrape:
    return Scrape(url=route.url, engine=route.engine, key=route.engine_key)


def router_url(target: Target) -> str:
    config, _ = target.server_config()
    if config is not None:
        cfg, _ = load_config(ServerConfig, config)
        listen = cfg.router.listen
        beside = config.parent / "router.toml"  # the standalone router llmgw init sets up
        if not listen and beside.exists():
            listen = load_config(StandaloneRouterConfig, beside)[0].router.listen
        if listen:
            host, port = parse_hostport(listen, key="router.listen")
            if host in ("0.0.0.0", "::", ""):
                host = "127.0.0.1"
            return f"http://{url_host(host)}:{port}/v1"
    raise CtlError(
        "where is the router? give --url http://HOST:PORT/v1 (or --replica R to aim at one replica)"
    )


def api_key(path: Path | None) -> str:
    if path is not None:
        try:
            return read_text(path).strip()
        except ConfigError as exc:
            raise CtlError(f"API key file {exc}") from None
    key = os.environ.get("LLMGW_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not key:
        raise CtlError(
            "no API key for the router: --api-key-file FILE, or set LLMGW_API_KEY "
            "(`llmgw ctl key create NAME` makes one)"
        )
    return key

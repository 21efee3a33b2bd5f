"""``llmgw server``: wire the control plane's parts together and serve."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import ssl
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import msgspec
import trio

from llmgw.addr import advertised_host, is_wildcard, join_hostport
from llmgw.admin.api import AdminApi
from llmgw.admin.reload import NotReloaded, Reloader, unknown_settings
from llmgw.admin.tenancy import TenancyApi
from llmgw.admin.views import ConsoleInfo
from llmgw.agent.discovery.address import route_address
from llmgw.bench.kept import BenchStore
from llmgw.config import ConfigError, ServerConfig, parse_hostport
from llmgw.config.errors import one_line
from llmgw.config.loader import read_text
from llmgw.config.schema import is_loopback, resolve, token_from_file
from llmgw.console.app import ConsoleApp
from llmgw.console.listener import VIEWER_TOKEN_FILE, console_server, keep_traffic
from llmgw.console.sessions import Sessions
from llmgw.console.traffic import TrafficHistory
from llmgw.console.traffic import sources as traffic_sources
from llmgw.controlplane.catalog import load_catalog
from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.followers import RouterReports
from llmgw.controlplane.leases import FILE as LEASES_FILE
from llmgw.controlplane.leases import LeaseBank, LeaseRefused
from llmgw.controlplane.metrics import ControlPlaneMetrics
from llmgw.controlplane.nodes import LivenessPolicy, scrape_targets
from llmgw.controlplane.reconciler import Timing
from llmgw.controlplane.replicas import ReplicaState
from llmgw.controlplane.routing import RoutingPublisher
from llmgw.controlplane.service import ControlPlane
from llmgw.controlplane.stream import AgentStreamServer, StreamLimits
from llmgw.controlplane.tenants import FILE as TENANTS_FILE
from llmgw.controlplane.tenants import TenantError, TenantStore
from llmgw.controlplane.usage import FILE as USAGE_FILE
from llmgw.controlplane.usage import UsageLedger
from llmgw.http import HttpServer
from llmgw.http.metrics import metrics_app, registry_page, watch_listeners
from llmgw.http.tls_front import serve_tls
from llmgw.router.counters import model_counters
from llmgw.router.keys import KeyRing, api_keys, followed, published
from llmgw.router.leases import LeaseClient, Unreachable
from llmgw.router.metrics import RouterMetrics
from llmgw.router.quota import Quotas
from llmgw.router.table import RoutingTable
from llmgw.router.tally import Tally
from llmgw.routing import LeaseAnswer, LeaseExchange, ModelCounters, RouterKey
from llmgw.serve import open_listeners
from llmgw.serve.limits import admin_limits, metrics_server, process_shares
from llmgw.serve.router import holds_of, router_app
from llmgw.telemetry import daemon_registry
from llmgw.tls.ca import CAError, describe_certificate
from llmgw.tls.contexts import browser_context, server_context

log = logging.getLogger("llmgw.server")


def admin_token(config: ServerConfig, base: Path) -> tuple[str, Path | None]:
    """The admin token: written in config, read from a file, or created once.

    A created token is written 0600 to the state directory, so ``ctl`` on the
    same machine can find it and nobody has to invent one before the first start.
    """
    if config.admin.token:
        return config.admin.token, None
    if config.admin.token_file:
        path = resolve(base, config.admin.token_file)
        return token_from_file(base, config.admin.token_file, "admin.token_file"), path
    path = resolve(base, config.state_dir) / "admin-token"
    return state_token(path, "admin token"), path


def state_token(path: Path, what: str) -> str:
    """The token in the state directory's file ``path``, created (0600) on first use."""
    if path.exists():
        token = read_text(path).strip()
        if not token:
            raise ConfigError(str(path), "", f"the {what} is empty: delete it to make another")
        return token
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    except OSError as exc:
        raise ConfigError(
            str(path), "state_dir", f"cannot write the {what}: {exc.strerror or exc}"
        ) from None
    log.info("created %s in %s", what, path)
    return token


def viewer_token(config: ServerConfig, base: Path) -> tuple[str, Path]:
    """The console's viewer token: read from console.viewer_token_file, or created once
    in the state directory."""
    if config.console.viewer_token_file:
        path = resolve(base, config.console.viewer_token_file)
        return token_from_file(
            base, config.console.viewer_token_file, "console.viewer_token_file"
        ), path
    path = resolve(base, config.state_dir) / VIEWER_TOKEN_FILE
    return state_token(path, "console viewer token"), path


async def _reload_on_sighup(reload: Reloader) -> None:
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            try:
                await reload()
            except NotReloaded as exc:
                log.error("%s", exc)
            except Exception as exc:  # a reload never takes the server down
                log.error("not reloaded, nothing changed: %s", one_line(exc))
                log.debug("the reload failed here", exc_info=True)


# an address no packet is sent to: connecting a UDP socket there asks the routing table
# for the default route's source address
_DEFAULT_ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1, never routed on the internet


def advertised_metrics(bound: str, stream_host: str, cert: Path) -> str:
    """Where Prometheus reaches the metrics listener bound at ``bound`` (host:port): itself,
    or for a wildcard the first reachable-looking of the address agents dial (the agent
    stream's listen host, then the names in the server certificate, which hold every
    name agents dial) and the default route's source address."""
    host, port = parse_hostport(bound, key="metrics.listen")
    if not is_wildcard(host):
        return bound
    names: list[str] = [stream_host]
    try:
        names += [s.split(":", 1)[1] for s in describe_certificate(cert)["sans"]]
    except CAError:
        pass  # the stream would not have started with a bad certificate
    names.append(route_address(*_DEFAULT_ROUTE_PROBE))
    chosen = advertised_host(names)
    return join_hostport(chosen, port) if chosen else bound


def _follow(ring: KeyRing, published: list[RouterKey]) -> None:
    """The in-process router takes the keys the routing carries (the tenants') besides
    its own; the control plane logged each change as it made it."""
    ring.follow(followed(published))


@attrs.frozen
class _Console:
    server: HttpServer
    app: ConsoleApp
    tls: ssl.SSLContext | None
    viewer_token_path: Path
    read_traffic: Callable[[], dict[str, dict[str, ModelCounters]]]


def _console(
    config: ServerConfig,
    base: Path,
    admin_api: AdminApi,
    token: str,
    router_metrics: RouterMetrics | None,
) -> _Console | None:
    """The web console's parts, when [console] listen asks for it; its files are read
    (tokens, certificate) before anything is served."""
    c = config.console
    if not c.listen:
        return None
    viewer, viewer_path = viewer_token(config, base)
    try:
        sessions = Sessions(token, viewer, c.session_hours * 3600)
    except ValueError as exc:
        raise ConfigError(str(viewer_path), "console.viewer_token_file", str(exc)) from None
    tls = None
    if c.tls:
        sc = config.agent_stream
        tls = browser_context(resolve(base, c.cert or sc.cert), resolve(base, c.key or sc.key))
    in_process = partial(model_counters, router_metrics) if router_metrics is not None else None
    routers = admin_api.routers
    read = traffic_sources(in_process, lambda: routers.traffic(trio.current_time()))
    history = TrafficHistory(c.traffic_step_s)
    app = ConsoleApp(
        admin_api, sessions, admin_api.control.changes, history, secure=tls is not None
    )
    return _Console(console_server(app), app, tls, viewer_path, read)


async def _open_console(config: ServerConfig, console: _Console, nursery: trio.Nursery) -> None:
    await nursery.start(keep_traffic, console.app.traffic, console.read_traffic, console.app.bell)
    host, port = parse_hostport(config.console.listen, key="console.listen")
    tls = console.tls
    serve = partial(serve_tls, console.server, tls) if tls is not None else console.server.serve_tcp
    listeners = await open_listeners(
        "console.listen", host, port, lambda: nursery.start(serve, host, port)
    )
    scheme = "https" if tls is not None else "http"
    urls = [f"{scheme}://{_show(x)}/" for x in listeners]
    console.app.admin.console = ConsoleInfo(
        on=True, urls=urls, tls=tls is not None, viewer_token_file=str(console.viewer_token_path)
    )
    log.info(
        "web console on %s (sign in with the viewer token in %s, or the admin token to act)",
        ", ".join(urls),
        console.viewer_token_path,
    )


def _show(listener: trio.SocketListener) -> str:
    host, port, *_ = listener.socket.getsockname()
    return join_hostport(host, port)


async def serve(
    config: ServerConfig, base: Path, reread: Callable[[], ServerConfig] | None = None
) -> None:
    """Run the control plane until cancelled; ``reread`` reads the config file again
    (``ctl reload`` and SIGHUP take the API keys from it)."""
    sc = config.agent_stream
    ssl_context = server_context(
        resolve(base, sc.ca), resolve(base, sc.cert), resolve(base, sc.key)
    )
    # every file is checked before anything is written (the admin token)
    catalog_path = resolve(base, config.catalog) if config.catalog else None
    catalog = load_catalog(catalog_path) if catalog_path is not None else None
    token, _ = admin_token(config, base)
    tenants_path = resolve(base, config.state_dir) / TENANTS_FILE
    try:  # tenants and their keys, as the last confirmed change left them
        tenants = TenantStore(tenants_path)
    except TenantError as exc:
        raise ConfigError(str(tenants_path), "", str(exc)) from None
    mc = config.metrics
    metrics_token = (
        token_from_file(base, mc.token_file, "metrics.token_file") if mc.token_file else ""
    )
    lv = config.liveness
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=lv.unreachable_after_s, lost_after=lv.lost_after_s),
        heartbeat_interval=lv.heartbeat_interval_s,
        metrics=ControlPlaneMetrics(daemon_registry("server")),
    )
    stream = AgentStreamServer(
        control,
        ssl_context,
        StreamLimits(
            handshake_timeout=sc.handshake_timeout_s,
            idle_timeout=lv.lost_after_s,
            send_timeout=sc.send_timeout_s,
            max_message_bytes=sc.max_message_bytes,
        ),
    )
    fleet = None
    if catalog_path is not None and catalog is not None:
        fleet = FleetManager(
            control,
            catalog,
            catalog_path=catalog_path,
            state_dir=resolve(base, config.state_dir),
            timing=Timing.of(config.reconcile),
        )
    routing = fleet.routing if fleet is not None else RoutingPublisher()
    routers = fleet.routers if fleet is not None else RouterReports()
    got = process_shares(config.router.max_connections if config.router.listen else 0)
    # the API keys of [[router.keys]] go to standalone routers with the routing, as
    # hashes; so do the tenants' keys, and the tenants' limits, on every change
    routing.set_keys(published(api_keys(config.router)))
    routing.set_tenancy(*tenants.published())
    router = None
    keys = None
    tally = Tally()  # what tenants' keys use through the router in this process
    bank = LeaseBank(tenants.limits, resolve(base, config.state_dir) / LEASES_FILE)
    control.metrics.watch_leases(bank, time.time)

    async def lease_here(ex: LeaseExchange) -> LeaseAnswer:
        """The in-process router's exchanges: a call, not a request."""
        try:
            return await bank.serve(ex, time.time())
        except LeaseRefused as exc:
            raise Unreachable(str(exc)) from None

    leases = LeaseClient(Quotas(), lease_here, f"in-process-{secrets.token_hex(6)}")
    router_metrics = None
    if config.router.listen:
        metrics = router_metrics = RouterMetrics(control.metrics.registry)
        keys = KeyRing(api_keys(config.router))
        ring = keys
        table = RoutingTable(
            routing.next,
            routing.snapshot,
            on_gone=metrics.forget,
            wedged_after_s=config.router.wedged_after_s,
            silent_after_s=config.router.silent_after_s,
            on_wedged=lambda ids: routers.report_wedged("in-process", ids, trio.current_time()),
            on_keys=lambda published: _follow(ring, published),
            alone=lambda: routers.routers(trio.current_time()) == 0,
        )
        holds = holds_of(config.router, table, lambda model: fleet.held() if fleet else None)
        if fleet is not None:  # what the router here sees of ranged models, read each pass
            fleet.load_sources.append(holds.loads)
            fleet.cache_sources.append(table.cached)
        app = router_app(config.router, table, metrics, keys, got, tally, leases, holds)
        router = (table, app)
    reload = Reloader(fleet, keys, reread, routing)
    ledger = UsageLedger(resolve(base, config.state_dir) / USAGE_FILE)
    if config.router.listen:
        ledger.read_in_process(tally.rows)
    tenancy = TenancyApi(tenants, lambda: routing.set_tenancy(*tenants.published()), ledger, bank)
    admin_api = AdminApi(
        control,
        token,
        fleet,
        routing,
        router[0].traffic if router else None,
        reload,
        routers,
        tenancy,
        BenchStore(resolve(base, config.state_dir) / "bench"),
    )
    console = _console(config, base, admin_api, token, router_metrics)
    admin = HttpServer(admin_api, limits=admin_limits(got), name="admin", admit=admin_api.admit)
    watched = {"admin": admin} if router is None else {"router": router[1], "admin": admin}
    stream_host, stream_port = parse_hostport(sc.listen, key="agent_stream.listen")
    admin_host, admin_port = parse_hostport(config.admin.listen, key="admin.listen")
    if not is_loopback(admin_host):  # only with admin.insecure_listen (see the schema)
        log.warning(
            "admin API on %s is plain HTTP beyond loopback (admin.insecure_listen = true):"
            " its token crosses the network in clear",
            config.admin.listen,
        )
    async with trio.open_nursery() as nursery:
        listeners = await open_listeners(
            "agent_stream.listen",
            stream_host,
            stream_port,
            lambda: nursery.start(stream.serve, stream_host, stream_port),
        )
        log.info("agent stream listening on %s", ", ".join(_show(x) for x in listeners))
        await nursery.start(control.run_liveness)
        nursery.start_soon(ledger.run, time.time)
        if reload is not None:
            nursery.start_soon(_reload_on_sighup, reload)
        if fleet is not None:
            await nursery.start(fleet.run)
            log.info(
                "reconciling %d models from %s",
                len(fleet.catalog.models),
                fleet.catalog_path,
            )
            for line in unknown_settings(fleet.catalog):
                log.warning("%s", line)
        admin_listeners = await open_listeners(
            "admin.listen",
            admin_host,
            admin_port,
            lambda: nursery.start(admin.serve_tcp, admin_host, admin_port),
        )
        if mc.listen:
            m_host, m_port = parse_hostport(mc.listen, key="metrics.listen")
            own: list[str] = []  # this listener's address, once open

            def sd() -> bytes:
                engines = [
                    (s.node_id, r.model, r.replica_id, s.shard_id)
                    for r in (fleet.replicas() if fleet is not None else ())
                    if r.state is ReplicaState.READY
                    for s in r.shards
                    if s.rank == 0  # the rank that serves HTTP
                ]
                return msgspec.json.encode(
                    scrape_targets(
                        control.nodes.nodes.values(),
                        own[0] if own else "",
                        engines,
                        routers.followers(trio.current_time()),
                    )
                )

            m_server = metrics_server(
                metrics_app(registry_page(control.metrics.registry), metrics_token, sd),
                got,
                "metrics",
            )
            watched["metrics"] = m_server
            m_listeners = await open_listeners(
                "metrics.listen",
                m_host,
                m_port,
                lambda: nursery.start(m_server.serve_tcp, m_host, m_port),
            )
            bound = _show(m_listeners[0])
            own.append(advertised_metrics(bound, stream_host, resolve(base, sc.cert)))
            log.info(
                "metrics on %s%s%s",
                ", ".join(f"http://{_show(x)}/metrics" for x in m_listeners),
                " (token asked)" if metrics_token else "",
                f"; service discovery names it {own[0]}" if own[0] != bound else "",
            )
        if console is not None:
            watched["console"] = console.server
            await _open_console(config, console, nursery)
        watch_listeners(control.metrics.registry, watched)
        if router is not None:
            await nursery.start(router[0].run)
            await nursery.start(leases.run)
            r_host, r_port = parse_hostport(config.router.listen, key="router.listen")
            r_listeners = await open_listeners(
                "router.listen",
                r_host,
                r_port,
                lambda: nursery.start(router[1].serve_tcp, r_host, r_port),
            )
            log.info(
                "OpenAI-compatible endpoint on %s",
                ", ".join(f"http://{_show(x)}/v1" for x in r_listeners),
            )
        # what is alive now (config, catalog, imported code) lives as long as the
        # server: keep the collector from walking it on every pass (GC pauses were
        # the tail of the reconcile benchmark)
        gc.freeze()
        log.info(
            "admin API listening on %s",
            ", ".join(f"http://{_show(x)}" for x in admin_listeners),
        )

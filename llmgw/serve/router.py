"""``llmgw router``: the OpenAI-compatible endpoint, standalone, in one or more processes.

Each worker process opens its own listener on the shared port (SO_REUSEPORT:
the kernel spreads connections across them), follows the control plane's
routing table on its own, and keeps routing with the table it has while the
control plane is away: engines keep serving, so the router keeps serving.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import trio

from llmgw.addr import advertised_host, is_wildcard, join_hostport, url_host
from llmgw.agent.discovery.address import route_address
from llmgw.config import ConfigError, parse_hostport
from llmgw.config.errors import one_line
from llmgw.config.schema import RouterConfig, StandaloneRouterConfig, token_from_file
from llmgw.http import HttpServer
from llmgw.http.client import ClientLimits, UpstreamPool
from llmgw.http.metrics import metrics_app, registry_page, watch_listeners
from llmgw.router import worker_metrics
from llmgw.router.app import RouterApp, error_body
from llmgw.router.counters import model_counters
from llmgw.router.guards import Limits
from llmgw.router.hold import Holds
from llmgw.router.keys import KeyRing, api_keys, followed
from llmgw.router.leases import SEND_S, LeaseClient, http_send
from llmgw.router.metrics import RouterMetrics
from llmgw.router.quota import Quotas
from llmgw.router.report import Reporter
from llmgw.router.table import HttpWatch, RoutingTable
from llmgw.router.tally import Tally
from llmgw.routing import RouterKey
from llmgw.serve import open_listeners
from llmgw.serve.limits import Shares, capped_line, metrics_server, process_shares, router_limits
from llmgw.telemetry import daemon_registry

log = logging.getLogger("llmgw.router")

FIRST_TABLE_S = 5.0  # a router starting waits this long for its routing table


def router_app(
    config: RouterConfig,
    table: RoutingTable,
    metrics: RouterMetrics,
    keys: KeyRing,
    got: Shares | None = None,
    tally: Tally | None = None,
    leases: LeaseClient | None = None,
    holds: Holds | None = None,
) -> HttpServer:
    """The endpoint's HTTP server, as ``llmgw server`` and ``llmgw router`` both run it;
    ``keys`` may be replaced while it serves. ``got``: the process's connection shares
    (made here when not given); a cut ``max_connections`` is said in one line.
    ``tally``: where what tenants' keys use is counted (the control plane's ledger
    reads it); ``leases``: where tenants' limits are spent from (``router.leases``);
    ``holds``: where requests for a model with no replica wait (``router.hold``)."""
    if got is None:
        got = process_shares(config.max_connections)
    if line := capped_line("router.max_connections", config.max_connections, got):
        log.warning("%s", line)
    pool = UpstreamPool(
        ClientLimits(
            connect_timeout_s=config.connect_timeout_s,
            first_byte_timeout_s=config.first_byte_timeout_s,
            idle_timeout_s=config.idle_timeout_s,
        )
    )
    app = RouterApp(
        table,
        keys,
        pool,
        max_attempts=config.max_attempts,
        metrics=metrics,
        queue_timeout_s=config.queue_timeout_s,
        access_log=config.access_log,
        resume_streams=config.resume_streams,
        limits=guard_limits(config),
        tally=tally,
        leases=leases,
        holds=holds,
    )
    return HttpServer(
        app,
        limits=router_limits(config, got),
        error_body=error_body,
        name="router",
        admit=app.admit,  # the key is checked from the head, before any body is kept
    )


def holds_of(
    config: RouterConfig,
    table: RoutingTable,
    notify: Callable[[str], None],
    arrivals: Callable[[], None] = lambda: None,
) -> Holds:
    """Where the router holds requests for a model with no replica yet (``router.hold``);
    ``notify``: tells the control plane a model's requests are held; ``arrivals``: that
    requests arrive again after a reading."""
    return Holds(
        table,
        hold_s=config.hold_timeout_s,
        max_held=config.max_held,
        notify=notify,
        arrivals=arrivals,
    )


def guard_limits(config: RouterConfig) -> Limits:
    """What a request may ask of an engine (``llmgw.router.guards``), from the config."""
    return Limits(
        json_depth=config.max_json_depth,
        grammar_depth=config.max_grammar_depth,
        grammar_bytes=config.max_grammar_kb * 1024,
        schema_bytes=config.max_schema_kb * 1024,
    )


async def reuseport_listeners(host: str, port: int) -> list[trio.SocketListener]:
    listeners: list[trio.SocketListener] = []
    for family, kind, proto, _, addr in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        sock = trio.socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            await sock.bind(addr)
            sock.listen(4096)
        except OSError:
            sock.close()
            for listener in listeners:
                listener.socket.close()
            raise
        listeners.append(trio.SocketListener(sock))
    return listeners


NO_KEYS = (
    "no API keys, neither in this router's config nor in the control plane's: every "
    "request is refused (401); add one with llmgw ctl key create NAME to the server's config "
    "and llmgw ctl reload"
)


def _follow_keys(keys: KeyRing, worker: int) -> Callable[[list[RouterKey]], None]:
    """What the routing table calls with the control plane's keys when they change:
    take them besides the router's own, and say so in one line (worker 0's)."""

    first = [True]  # the first snapshot: said even when it brings no key

    def follow(published: list[RouterKey]) -> None:
        said = keys.follow(followed(published))
        was_first, first[0] = first[0], False
        if worker or (said is None and not was_first):
            return
        if said is not None:
            log.info("keys from the control plane: %s", said)
        if not keys:
            log.warning("%s", NO_KEYS)

    return follow


def admin_token(config: StandaloneRouterConfig, base: Path) -> str:
    if config.admin_token:
        return config.admin_token
    return token_from_file(base, config.admin_token_file, "admin_token_file")


async def _reload_keys_on_sighup(
    keys: KeyRing,
    reread: Callable[[], StandaloneRouterConfig],
    children: list[trio.Process],
    worker: int,
) -> None:
    """SIGHUP: read the config file again and use its keys from the next request on
    (worker 0 passes the signal on to the other workers); a bad file changes nothing."""
    who = f"worker {worker}: " if worker else ""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            for child in children:
                if child.returncode is None:
                    child.send_signal(signal.SIGHUP)
            try:
                config = reread()
            except ConfigError as exc:
                log.error("%skeys not reloaded, nothing changed: %s", who, exc)
                continue
            except Exception as exc:  # a reload never takes the router down
                log.error("%skeys not reloaded, nothing changed: %s", who, one_line(exc))
                log.debug("the reload failed here", exc_info=True)
                continue
            log.info("%skeys reloaded: %s", who, keys.replace(api_keys(config.router)))
            if not keys:
                log.warning("%s%s", who, NO_KEYS)


async def serve(
    config: StandaloneRouterConfig,
    base: Path,
    argv: list[str],
    worker: int,
    run_dir: str,
    reread: Callable[[], StandaloneRouterConfig] | None = None,
) -> None:
    """Worker 0 starts the others (``--worker i``) and serves the metrics of all.
    ``reread`` reads the config file again, for SIGHUP (the keys)."""
    token = admin_token(config, base)
    metrics_token = (
        token_from_file(base, config.metrics_token_file, "metrics_token_file")
        if config.metrics_token_file and worker == 0
        else ""
    )
    watch = HttpWatch(config.admin_url, token)
    reporter = Reporter(config.admin_url, token)  # what it tells the control plane
    watch.extra = reporter.query  # a control plane older than the report reads it there
    metrics = RouterMetrics(daemon_registry("router"))
    reporter.traffic = lambda: model_counters(metrics)
    keys = KeyRing(api_keys(config.router))
    table = RoutingTable(
        watch,
        on_gone=metrics.forget,
        wedged_after_s=config.router.wedged_after_s,
        silent_after_s=config.router.silent_after_s,
        on_wedged=reporter.wedged,
        on_keys=_follow_keys(keys, worker),
    )
    got = process_shares(config.router.max_connections)
    lease_client = httpx.AsyncClient(timeout=SEND_S)
    leases = LeaseClient(
        Quotas(), http_send(config.admin_url, token, lease_client), reporter.router_id
    )
    holds = holds_of(config.router, table, lambda model: reporter.held(), reporter.arrived)
    reporter.load = holds.loads  # each ranged model's requests here, in every report
    reporter.cached = table.cached  # and what it believes their replicas hold
    server = router_app(config.router, table, metrics, keys, got, reporter.tally, leases, holds)
    watch_listeners(metrics.registry, {"router": server})
    host, port = parse_hostport(config.router.listen, key="router.listen")
    # bound before any worker starts: a port held elsewhere is one line, from worker 0
    listeners = await open_listeners(
        "router.listen", host, port, lambda: reuseport_listeners(host, port)
    )
    children: list[trio.Process] = []
    made_run_dir = False
    if worker == 0 and config.metrics_listen and config.workers > 1:
        run_dir = tempfile.mkdtemp(prefix="llmgw-router-")
        made_run_dir = True
    if worker == 0:
        for i in range(1, config.workers):
            more = ["--run-dir", run_dir] if run_dir else []
            children.append(
                await trio.lowlevel.open_process(
                    [sys.executable, "-m", "llmgw", *argv, "--worker", str(i), *more]
                )
            )
    try:
        async with watch, lease_client, trio.open_nursery() as nursery:
            if reread is not None:
                nursery.start_soon(_reload_keys_on_sighup, keys, reread, children, worker)
            await nursery.start(table.run)
            await nursery.start(reporter.run)
            await nursery.start(leases.run)
            # connections wait in the listener's backlog until the routing table comes
            # (the models, the tenants' keys), within FIRST_TABLE_S
            with trio.move_on_after(FIRST_TABLE_S):
                await table.heard.wait()
            if not table.heard.is_set() and worker == 0:
                log.warning(
                    "router: no routing table from the control plane at %s within %.0f s: "
                    "serving, and answering 503 until it comes (is the server up, and the "
                    "admin token right?)",
                    config.admin_url,
                    FIRST_TABLE_S,
                )
            await nursery.start(server.serve, listeners)
            where = ", ".join(
                f"http://{x.socket.getsockname()[0]}:{x.socket.getsockname()[1]}/v1"
                for x in listeners
            )
            log.info(
                "router %s serving on %s, following %s",
                f"worker {worker}" if worker else f"with {config.workers} process(es)",
                where,
                config.admin_url,
            )
            # worker 0 tells the control plane where its metrics are, for discovery
            listening = await _serve_metrics(
                nursery, config, metrics, worker, run_dir, metrics_token, got
            )
            if listening:
                reporter.serves_metrics(listening)
    finally:
        with trio.CancelScope(shield=True):
            for child in children:
                child.terminate()
            with trio.move_on_after(0.8):
                for child in children:
                    await child.wait()
            for child in children:
                if child.returncode is None:
                    child.kill()
            if made_run_dir:
                shutil.rmtree(run_dir, ignore_errors=True)


async def _serve_metrics(
    nursery: trio.Nursery,
    config: StandaloneRouterConfig,
    metrics: RouterMetrics,
    worker: int,
    run_dir: str,
    token: str,
    got: Shares,
) -> str:
    """Worker 0: ``metrics_listen`` (asking for ``token``, if any), with every worker's
    metrics; returns where it listens ("" when nowhere). The others: their own, on a
    loopback port of their choosing, published in the run directory."""
    registry = metrics.registry
    if worker == 0:
        if not config.metrics_listen:
            return ""
        host, port = parse_hostport(config.metrics_listen, key="metrics_listen")
        pages = Path(run_dir) if run_dir else None

        async def every_worker() -> bytes:
            assert pages is not None
            return await worker_metrics.page(registry, pages)

        render = registry_page(registry) if pages is None else every_worker
        app = metrics_server(metrics_app(render, token), got, "router-metrics")
        listeners = await open_listeners(
            "metrics_listen", host, port, lambda: nursery.start(app.serve_tcp, host, port)
        )
        log.info(
            "router metrics on %s",
            ", ".join(
                f"http://{url_host(x.socket.getsockname()[0])}:{x.socket.getsockname()[1]}/metrics"
                for x in listeners
            ),
        )
        bound = listeners[0].socket.getsockname()
        host = bound[0]
        if is_wildcard(host):  # the address on the route to the control plane, as agents do
            admin = urlsplit(config.admin_url)
            port = admin.port or (443 if admin.scheme == "https" else 80)
            host = advertised_host([route_address(admin.hostname or "", port)]) or host
        return join_hostport(host, bound[1])
    elif run_dir:
        listeners = await nursery.start(
            metrics_server(metrics_app(registry_page(registry)), got, "router-metrics").serve_tcp,
            "127.0.0.1",
            0,
        )
        worker_metrics.publish_port(Path(run_dir), worker, listeners[0].socket.getsockname()[1])
    return ""

"""``llmgw router``: the OpenAI-compatible endpoint, standalone, in one or more processes.

Each worker process opens its own listener on the shared port (SO_REUSEPORT:
the kernel spreads connections across them), follows the control plane's
routing table on its own, and keeps routing with the table it has while the
control plane is away: engines keep serving, so the router keeps serving.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import trio

from llmgw.config import ConfigError, parse_hostport
from llmgw.config.schema import RouterConfig, StandaloneRouterConfig, resolve
from llmgw.http import HttpServer, ServerLimits
from llmgw.http.client import ClientLimits, UpstreamPool
from llmgw.router.app import RouterApp, error_body
from llmgw.router.keys import ApiKey, KeyRing
from llmgw.router.metrics import RouterMetrics
from llmgw.router.table import RoutingTable, follow

log = logging.getLogger("llmgw.router")


def router_app(config: RouterConfig, table: RoutingTable, metrics: RouterMetrics) -> HttpServer:
    """The endpoint's HTTP server, as ``llmgw server`` and ``llmgw router`` both run it."""
    keys = KeyRing([ApiKey(k.name, k.sha256, frozenset(k.models)) for k in config.keys])
    pool = UpstreamPool(
        ClientLimits(
            connect_timeout_s=config.connect_timeout_s,
            first_byte_timeout_s=config.first_byte_timeout_s,
            idle_timeout_s=config.idle_timeout_s,
        )
    )
    return HttpServer(
        RouterApp(
            table,
            keys,
            pool,
            max_attempts=config.max_attempts,
            metrics=metrics,
            queue_timeout_s=config.queue_timeout_s,
            access_log=config.access_log,
        ),
        limits=ServerLimits(max_body_bytes=int(config.max_body_mb * 2**20)),
        error_body=error_body,
        name="router",
    )


async def reuseport_listeners(host: str, port: int) -> list[trio.SocketListener]:
    listeners = []
    for family, kind, proto, _, addr in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        sock = trio.socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        await sock.bind(addr)
        sock.listen(4096)
        listeners.append(trio.SocketListener(sock))
    return listeners


def admin_token(config: StandaloneRouterConfig, base: Path) -> str:
    if config.admin_token:
        return config.admin_token
    path = resolve(base, config.admin_token_file)
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError("", "admin_token_file", f"cannot read {path}: {exc.strerror}") from None


async def serve(config: StandaloneRouterConfig, base: Path, argv: list[str], worker: bool) -> None:
    token = admin_token(config, base)
    table = RoutingTable()
    server = router_app(config.router, table, RouterMetrics())
    host, port = parse_hostport(config.router.listen, key="router.listen")
    children: list[trio.Process] = []
    if not worker:
        for _ in range(config.workers - 1):
            children.append(
                await trio.lowlevel.open_process([sys.executable, "-m", "llmgw", *argv, "--worker"])
            )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, table, config.admin_url, token)
            await nursery.start(table.run)
            listeners = await reuseport_listeners(host, port)
            await nursery.start(server.serve, listeners)
            where = ", ".join(
                f"http://{x.socket.getsockname()[0]}:{x.socket.getsockname()[1]}/v1"
                for x in listeners
            )
            log.info(
                "router %s serving on %s, following %s",
                "worker" if worker else f"with {config.workers} process(es)",
                where,
                config.admin_url,
            )
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

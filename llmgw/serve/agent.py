"""``llmgw agent``: resolve the configuration, then discover, supervise and stay connected."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw.addr import join_hostport
from llmgw.agent.health import HealthSettings
from llmgw.agent.hostlock import answer, fleet_digest, hold_node
from llmgw.agent.inventory import InventorySource
from llmgw.agent.lock import hold
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.reload import plan
from llmgw.agent.stream import AgentStream, StreamSettings
from llmgw.agent.supervisor import Supervisor, SupervisorSettings
from llmgw.agent.weights import Fetcher
from llmgw.config import AgentConfig, ConfigError, parse_hostport
from llmgw.config.errors import one_line
from llmgw.config.schema import resolve, token_from_file
from llmgw.engines import programs
from llmgw.engines.llamacpp import LLAMA_SERVER
from llmgw.http.metrics import metrics_app, registry_page
from llmgw.serve import open_listeners
from llmgw.serve.limits import metrics_server, process_shares
from llmgw.telemetry import daemon_registry
from llmgw.tls.contexts import client_context, server_context
from llmgw.weights.budget import Budget
from llmgw.weights.peer import PeerServer, PeerTrust

log = logging.getLogger("llmgw.agent")


def node_id(config: AgentConfig) -> str:
    """The node id: written in config, or the hostname (the certificate's common name)."""
    return config.node_id or socket.gethostname()


def binaries(source: InventorySource, base: Path) -> dict[str, str]:
    """Where each command an engine runs lives on this node (``llmgw.engines.programs``):
    written in config (``[engines] llama_server``, as the source has it since the last
    reload), else on PATH, else where discovery found it."""
    found = {e.name: e.path for e in source.inventory().engines if e.path}
    out: dict[str, str] = {}
    for program in programs():
        if program is LLAMA_SERVER and source.llama_server:
            out[program.command] = str(resolve(base, source.llama_server))
            continue
        path = shutil.which(program.command) or found.get(program.name)
        if path:
            out[program.command] = path
    return out


def build(config: AgentConfig, base: Path) -> AgentStream:
    nid = node_id(config)
    cert = resolve(base, config.cert or f"pki/{nid}.pem")
    key = resolve(base, config.key or f"pki/{nid}-key.pem")
    ca = resolve(base, config.ca)
    ssl_context = client_context(ca, cert, key)
    addresses = [
        parse_hostport(a, key=f"control_plane[{i}]") for i, a in enumerate(config.control_plane)
    ]
    settings = StreamSettings(
        node_id=nid,
        control_plane=addresses,
        ssl_context=ssl_context,
        connect_timeout=config.connect_timeout_s,
        handshake_timeout=config.handshake_timeout_s,
        backoff_initial=config.backoff.initial_s,
        backoff_max=config.backoff.max_s,
        ca_file=str(ca),
        name_probe_context=client_context(ca, cert, key, check_name=False),
    )
    metrics = AgentMetrics(daemon_registry("agent"))
    source = InventorySource(
        config.inventory,
        addresses[0],
        discovery=config.discovery,
        weights=config.weights,
        base=base,
        on_discovered=metrics.discovery.observe,
        llama_server=config.engines.llama_server,
    )
    e = config.engines
    source.port_range = list(e.port_range)
    source.state_dir = resolve(base, config.state_dir)
    supervisor = Supervisor(
        SupervisorSettings(
            state_dir=resolve(base, config.state_dir),
            port_range=(e.port_range[0], e.port_range[1]),
            kill_unidentified=e.kill_unidentified,
            stop_grace_s=e.stop_grace_s,
            log_max_bytes=e.log_max_mb << 20,
            stopped_log_keep_s=e.stopped_log_keep_hours * 3600,
            stopped_logs_max_bytes=e.stopped_logs_max_mb << 20,
            health=HealthSettings.every(e.health_interval_s, e.unhealthy_after),
            nvidia_smi=config.discovery.nvidia_smi,
            # "auto": where the control plane will route to, the node's own address
            engine_bind=(config.inventory.address or e.bind) if e.bind == "auto" else e.bind,
        ),
        lambda: binaries(source, base),
        on_event=metrics.event,
    )
    source.busy = supervisor.busy_ports
    landing = source.landing_dir()
    limit = source.budget_bytes()
    supervisor.fetcher = Fetcher(
        landing,
        budget=Budget(landing, limit) if limit is not None else None,
        # what no eviction may take: the files of every shard placed here
        in_use=lambda: [Path(s.spec.model_path) for s in supervisor.shards.values()],
        on_bytes=lambda kind, n: metrics.fetched_bytes.labels(kind).inc(n),
        on_failure=lambda reason: metrics.fetch_failures.labels(reason).inc(),
        on_landed=source.refresh,  # placement hears at once that this node holds them
    )
    source.fetching = supervisor.fetcher.fetching
    source.no_room = supervisor.fetcher.no_room
    # agents prove who they are to each other's transfer listeners as to the control plane
    supervisor.fetcher.trust = PeerTrust.load(ca, cert, key)
    metrics.watch_shards(lambda: [s.state for s in supervisor.shards.values()])
    return AgentStream(settings, source, supervisor, metrics)


async def _serve_weights(
    config: AgentConfig, base: Path, stream: AgentStream, nursery: trio.Nursery
) -> None:
    """The weights transfer listener (``[weights] peer_listen``): agents of the fabric
    take what this node holds, or is fetching, from it; its port is in the inventory."""
    nid = node_id(config)
    host, port = parse_hostport(config.weights.peer_listen, key="weights.peer_listen")
    context = server_context(
        resolve(base, config.ca),
        resolve(base, config.cert or f"pki/{nid}.pem"),
        resolve(base, config.key or f"pki/{nid}-key.pem"),
    )
    server = PeerServer(stream.source.landing_dir(), context)
    listeners = await open_listeners(
        "weights.peer_listen", host, port, lambda: nursery.start(server.serve, host, port)
    )
    where = listeners[0].socket.getsockname()
    stream.source.weights_port = where[1]
    log.info("weights transfer listener on %s", join_hostport(where[0], where[1]))


@attrs.frozen
class Rereader:
    """How SIGHUP reads the config file again: ``read`` (the file and the command
    line's overrides), ``source`` (the file's name, for the one log line) and
    ``set_log_level`` (the CLI's logging setup)."""

    read: Callable[[], AgentConfig]
    source: str
    set_log_level: Callable[[str], None]


async def serve(config: AgentConfig, base: Path, reread: Rereader | None = None) -> None:
    # before anything is discovered, adopted or killed: a second agent for this node
    # on this host refuses here, whatever its state dir; then one on the same state dir
    nid = node_id(config)
    fleet = fleet_digest(resolve(base, config.ca))
    with hold_node(nid, fleet) as node_lock, hold(resolve(base, config.state_dir)):
        await _serve(config, base, node_lock, reread)


def take(stream: AgentStream, config: AgentConfig) -> None:
    """Put a reloaded config's reloadable parts (``reload.plan``'s ``running``) to work."""
    source = stream.source
    source.overrides = config.inventory
    source.settings = config.discovery
    source.weights = config.weights
    fetcher = stream.supervisor.fetcher
    fetcher.weights_dir = source.landing_dir()
    limit = source.budget_bytes()
    if limit != (fetcher.budget.limit if fetcher.budget is not None else None):
        # fetches in flight keep their room in the budget they began under
        fetcher.budget = Budget(fetcher.weights_dir, limit) if limit is not None else None
    source.llama_server = config.engines.llama_server
    sup = stream.supervisor
    sup.settings = attrs.evolve(
        sup.settings,
        stop_grace_s=config.engines.stop_grace_s,
        nvidia_smi=config.discovery.nvidia_smi,
    )


async def _reload_on_sighup(stream: AgentStream, config: AgentConfig, reread: Rereader) -> None:
    """SIGHUP (``systemctl reload``): read the config again, take what can be taken,
    run discovery again (the next heartbeat carries what changed), and say so in one
    line; a bad file changes nothing and says why, and the agent runs on."""
    running = config
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            try:
                read = reread.read()
            except ConfigError as exc:
                log.error("%s not reloaded, nothing changed: %s", reread.source, exc)
                continue
            except Exception as exc:  # a reload never takes the agent down
                log.error("%s not reloaded, nothing changed: %s", reread.source, one_line(exc))
                continue
            change = plan(running, read)
            level, running = running.log_level, change.running
            take(stream, running)
            if running.log_level != level:
                reread.set_log_level(running.log_level)
            log.info("%s", change.line(reread.source))
            if change.taken:
                await stream.source.refresh()


async def _serve(
    config: AgentConfig, base: Path, node_lock: socket.socket, reread: Rereader | None
) -> None:
    mc = config.metrics
    # read before anything starts: a bad token file is one line, exit 2
    metrics_token = (
        token_from_file(base, mc.token_file, "metrics.token_file") if mc.token_file else ""
    )
    stream = build(config, base)
    log.info(
        "agent %s starting; control plane %s",
        stream.settings.node_id,
        ", ".join(config.control_plane),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer, node_lock)
        if reread is not None:
            nursery.start_soon(_reload_on_sighup, stream, config, reread)
        await nursery.start(stream.source.run)
        inv = stream.source.inventory()
        log.info(
            "discovered: %d GPUs, %s of memory, engines: %s, %d weight copies",
            len(inv.gpus),
            f"{inv.memory.total_bytes / 2**30:.1f} GiB" if inv.memory.total_bytes else "unknown",
            ", ".join(f"{e.name} {e.version}".strip() for e in inv.engines) or "none",
            len(inv.weights),
        )
        assert stream.metrics is not None  # build() gives it one
        if config.weights.peer_listen:
            await _serve_weights(config, base, stream, nursery)
        await nursery.start(stream.supervisor.run)
        if config.metrics.listen:
            host, port = parse_hostport(config.metrics.listen, key="metrics.listen")
            server = metrics_server(
                metrics_app(
                    registry_page(stream.metrics.registry),
                    metrics_token,
                    engine=stream.supervisor.engine_metrics,
                ),
                process_shares(0),
                "agent-metrics",
            )
            listeners = await open_listeners(
                "metrics.listen", host, port, lambda: nursery.start(server.serve_tcp, host, port)
            )
            where = listeners[0].socket.getsockname()
            log.info("agent metrics on http://%s:%d/metrics", where[0], where[1])
            stream.metrics_address = join_hostport(where[0], where[1])
        await stream.run()

"""The shapes of ``server.toml`` and ``agent.toml``, with their bounds.

Every config struct refuses unknown keys. Cross-field rules live in
``validate`` so that each one is written once and names the key it is about.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import msgspec

from llmgw.config.errors import ConfigError
from llmgw.config.loader import parse_hostport, read_text

DAY_S = 86_400.0


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


def _positive(key: str, value: float, *, at_most: float | None = None) -> None:
    if value <= 0:
        raise ConfigError("", key, f"must be greater than 0, got {value}")
    if at_most is not None and value > at_most:
        raise ConfigError("", key, f"must be at most {at_most:g}, got {value}")


def resolve(base: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def token_from_file(base: Path, path: str, key: str) -> str:
    """The token in the file ``key`` names (relative to ``base``).

    Raises:
        ConfigError: the file cannot be read, or holds nothing.
    """
    where = resolve(base, path)
    token = read_text(where, key).strip()
    if not token:
        raise ConfigError(str(where), key, "is empty: write the token in it")
    return token


class TlsFiles(_Section):
    ca: str = "pki/ca.pem"  # the fleet's CA certificate
    cert: str = ""  # this daemon's certificate
    key: str = ""  # its private key (mode 0600)


class AgentStreamConfig(_Section):
    """The mutual-TLS listener agents dial."""

    listen: str = "0.0.0.0:7443"  # where agents dial in (mutual TLS)
    ca: str = "pki/ca.pem"  # the CA that signed every agent's certificate
    cert: str = "pki/server.pem"  # must hold every name and address agents dial
    key: str = "pki/server-key.pem"  # the server certificate's private key
    max_message_bytes: int = 1024 * 1024  # a larger message from an agent closes its stream
    handshake_timeout_s: float = 10.0  # TLS and WebSocket handshake, then registration
    send_timeout_s: float = 10.0  # an agent that does not read for this long is dropped


class LivenessConfig(_Section):
    """How long a silent node stays Ready, then Unreachable, then Lost."""

    heartbeat_interval_s: float = 5.0  # agents send one this often (told at registration)
    unreachable_after_s: float = 15.0  # silent this long: Unreachable, not routed to
    lost_after_s: float = 60.0  # silent this long: Lost, its replicas placed elsewhere


class AdminConfig(_Section):
    """The management API (ctl talks to it) and its token."""

    listen: str = "127.0.0.1:7444"  # the management API and /metrics (plain HTTP)
    token: str = ""  # the admin bearer token itself; prefer token_file
    token_file: str = ""  # default: <state_dir>/admin-token, created on first start
    # the admin API is plain HTTP: an address that is not loopback is refused
    # unless this says, on purpose, that the token may cross the network in clear
    insecure_listen: bool = False


class ConsoleConfig(_Section):
    """The web console: the fleet at a glance, live, in a browser (``llmgw.console``)."""

    listen: str = ""  # e.g. "127.0.0.1:7445"; empty: no console
    # serve it over TLS with the server's certificate (agent_stream.cert and .key), or
    # with cert and key below; a listen address that is not loopback needs it
    tls: bool = False
    cert: str = ""  # a certificate browsers trust, instead of the server's own (PEM)
    key: str = ""  # its private key (PEM)
    # the token that signs in to see everything but secrets (the admin token signs in
    # to act as well); default: <state_dir>/console-viewer-token, created on first start
    viewer_token_file: str = ""
    session_hours: float = 12.0  # a signed-in browser stays so this long
    # the traffic page's step: the routers' counters are read this often, and an hour
    # of steps is kept
    traffic_step_s: float = 10.0


def is_loopback(host: str) -> bool:
    """Whether a listen host is loopback only (a name other than localhost is not
    known to be: it could resolve to anything)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ReconcileConfig(_Section):
    """The reconciler's clocks: startup, drains, retries."""

    startup_margin_s: float = 30.0  # beyond a profile's startup timeout before a replica is failed
    drain_grace_s: float = (
        300.0  # a replica moving off a draining node waits at most this for its replacement
    )
    drain_timeout_s: float = (
        120.0  # in-flight work gets this long before a draining replica is stopped
    )
    retry_base_s: float = 5.0  # failed placements and replicas are retried with backoff from here
    retry_cap_s: float = 300.0  # the longest wait between two tries (crash loops)
    # after a start, agents re-register before anything is placed; nodes known from
    # before (state_dir/nodes.json) are waited for until back or Lost (lost_after_s)
    settle_s: float = 15.0
    # a replica a router holds wedged (router.wedged_after_s) this much longer is failed
    # and replaced: its engine restarted
    wedged_grace_s: float = 60.0


class KeyConfig(_Section):
    name: str  # who holds the key: logs and metrics say this, never the key
    sha256: str  # of the key; `llmgw ctl key create NAME` makes one
    models: list[str] = []  # empty: every model


class RouterConfig(_Section):
    """The OpenAI-compatible endpoint: keys, limits and timeouts."""

    listen: str = ""  # the OpenAI-compatible endpoint, e.g. "0.0.0.0:8000"; empty: none
    # API keys, as hashes (`llmgw ctl key create NAME`). The server's go to every standalone
    # router with its routing (`llmgw ctl reload` after a change); a standalone router
    # takes those and its own. With none at all, every request is refused (401)
    keys: list[KeyConfig] = []
    max_body_mb: float = 16.0  # one request's body; larger: 413
    # bodies held at once, all clients together, shared fairly per key and per address:
    # when full, a client within its share takes room from one over it; else 503
    max_bodies_mb: float = 256.0
    # a body must keep arriving this fast once its first 5 s are over (over each 5 s);
    # slower: 408 (a stalled body holds memory for no one); 0: no floor
    min_body_kib_per_s: float = 8.0
    # open at once, all clients (cut to fit the open-files limit, said at start); at it,
    # idle connections that showed no key make room; a tenth is kept for keyed requests
    max_connections: int = 10_000
    max_connections_per_address: int = 1000  # open from one client IP; past it: 503
    # a client that takes no bytes of its response this long is cut and its request
    # cancelled (the engine frees its slot); keep it under silent_after_s
    send_timeout_s: float = 5.0
    max_attempts: int = 3  # per request, retries included (only before the first byte)
    connect_timeout_s: float = 2.0  # to an engine; past it the next replica is tried
    first_byte_timeout_s: float = 120.0  # request sent -> head and first body byte (prefill)
    idle_timeout_s: float = 60.0  # between chunks of a streamed answer
    queue_timeout_s: float = 0.0  # every replica saturated: wait this long for room, then 429
    # a model with a range of replicas and none started: hold its requests this long for
    # one to start, then 503 with Retry-After
    hold_timeout_s: float = 120.0
    max_held: int = 1000  # requests held at once per model; more: 503 at once
    # work in flight and the engine's progress counter flat this long: wedged, its
    # breaker opens (0: never judged)
    wedged_after_s: float = 30.0
    # work in flight and nothing heard from the replica this long, neither a byte of a
    # reply nor an answer to a metrics scrape (a stopped process, a hung host): wedged
    # too, and its streams go on elsewhere (0: never judged)
    silent_after_s: float = 6.0
    # a stream whose replica fails mid-way goes on from another replica of the same
    # engine (asking engines for the ids of the tokens they stream); false: it ends
    # with an error event
    resume_streams: bool = True
    access_log: bool = False  # one line per request (logger llmgw.router.access), key by name
    # what engines choke on, refused with 400 before one sees it (0: no limit): JSON
    # nested deeper than this anywhere in a body (schemas, tools and content included)
    max_json_depth: int = 128
    # a grammar (grammar, guided_grammar) or regex (guided_regex) nesting its groups
    # deeper than this (llama-server crashes at 20,000)
    max_grammar_depth: int = 256
    # a grammar, regex or choice list larger than this, in KiB
    max_grammar_kb: int = 32
    # a JSON schema (json_schema, response_format, guided_json, structured_outputs)
    # larger than this, in KiB (llama-server takes 0.5 s to compile 16 KiB of one)
    max_schema_kb: int = 16

    def validate(self) -> None:
        """The bounds on what clients may make the endpoint hold (called by the
        configs that hold a ``[router]``)."""
        for key in ("max_json_depth", "max_grammar_depth", "max_grammar_kb", "max_schema_kb"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    "", f"router.{key}", f"must be 0 (no limit) or more, got {getattr(self, key)}"
                )
        if self.max_json_depth > 512:
            raise ConfigError(
                "",
                "router.max_json_depth",
                f"must be at most 512 (deeper JSON is not read), got {self.max_json_depth}",
            )
        _positive("router.max_body_mb", self.max_body_mb)
        if self.max_bodies_mb < self.max_body_mb:
            raise ConfigError(
                "",
                "router.max_bodies_mb",
                f"must be at least router.max_body_mb ({self.max_body_mb:g}), "
                f"got {self.max_bodies_mb:g}",
            )
        if self.min_body_kib_per_s < 0:
            raise ConfigError(
                "",
                "router.min_body_kib_per_s",
                f"must be 0 or more, got {self.min_body_kib_per_s:g}",
            )
        _positive("router.send_timeout_s", self.send_timeout_s, at_most=300)
        _positive("router.hold_timeout_s", self.hold_timeout_s, at_most=3600)
        for key in ("wedged_after_s", "silent_after_s"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    "", f"router.{key}", f"must be 0 or more, got {getattr(self, key):g}"
                )
        for key in ("max_connections", "max_connections_per_address", "max_held"):
            if getattr(self, key) < 1:
                raise ConfigError(
                    "", f"router.{key}", f"must be at least 1, got {getattr(self, key)}"
                )


class ServerConfig(_Section):
    state_dir: str = "state"  # the admin token, the operator's cordons and drains, tenants and their keys (tenants.json), their usage (usage.json) and the routers' leases of their limits (leases.json)
    catalog: str = ""  # the models to run; empty: no placement (a plain control plane)
    log_level: str = "info"  # debug, info, warning or error
    agent_stream: AgentStreamConfig = msgspec.field(default_factory=AgentStreamConfig)
    liveness: LivenessConfig = msgspec.field(default_factory=LivenessConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    reconcile: ReconcileConfig = msgspec.field(default_factory=ReconcileConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    # Prometheus's own listener and token (the admin listener's /metrics needs the admin
    # token, which can drain nodes); defined further down
    metrics: MetricsConfig = msgspec.field(default_factory=lambda: MetricsConfig())
    console: ConsoleConfig = msgspec.field(default_factory=ConsoleConfig)

    def validate(self) -> None:
        parse_hostport(self.agent_stream.listen, key="agent_stream.listen")
        if self.metrics.listen:
            parse_hostport(self.metrics.listen, key="metrics.listen")
        admin_host, _ = parse_hostport(self.admin.listen, key="admin.listen")
        if not is_loopback(admin_host) and not self.admin.insecure_listen:
            raise ConfigError(
                "",
                "admin.listen",
                f"{self.admin.listen!r} is not loopback, and the admin API is plain HTTP"
                " (its token would cross the network in clear): listen on 127.0.0.1 and"
                " reach it over SSH, or set admin.insecure_listen = true to accept that",
            )
        self.console_checked()
        lv = self.liveness
        _positive("liveness.heartbeat_interval_s", lv.heartbeat_interval_s, at_most=3600)
        _positive("liveness.unreachable_after_s", lv.unreachable_after_s, at_most=DAY_S)
        _positive("liveness.lost_after_s", lv.lost_after_s, at_most=7 * DAY_S)
        if lv.unreachable_after_s <= lv.heartbeat_interval_s:
            raise ConfigError(
                "",
                "liveness.unreachable_after_s",
                f"must be longer than liveness.heartbeat_interval_s ({lv.heartbeat_interval_s:g})"
                ", or every node would flap",
            )
        if lv.lost_after_s <= lv.unreachable_after_s:
            raise ConfigError(
                "",
                "liveness.lost_after_s",
                f"must be longer than liveness.unreachable_after_s ({lv.unreachable_after_s:g})",
            )
        _positive("agent_stream.max_message_bytes", self.agent_stream.max_message_bytes)
        _positive(
            "agent_stream.handshake_timeout_s", self.agent_stream.handshake_timeout_s, at_most=300
        )
        _positive("agent_stream.send_timeout_s", self.agent_stream.send_timeout_s, at_most=300)
        rc = self.reconcile
        for key in (
            "startup_margin_s",
            "drain_grace_s",
            "drain_timeout_s",
            "retry_base_s",
            "retry_cap_s",
        ):
            _positive(f"reconcile.{key}", getattr(rc, key), at_most=DAY_S)
        self.router.validate()
        _check_log_level(self.log_level)

    def console_checked(self) -> None:
        c = self.console
        if not c.listen:
            return
        host, _ = parse_hostport(c.listen, key="console.listen")
        if not is_loopback(host) and not c.tls:
            raise ConfigError(
                "",
                "console.listen",
                f"{c.listen!r} is not loopback, and without TLS the console's sign-in token"
                " and session would cross the network in clear: set console.tls = true"
                " (the server's certificate, or console.cert and console.key), or listen"
                " on 127.0.0.1 and reach it over SSH",
            )
        if bool(c.cert) != bool(c.key):
            raise ConfigError("", "console.cert", "give console.cert and console.key together")
        if (c.cert or c.key) and not c.tls:
            raise ConfigError("", "console.tls", "console.cert is set: set console.tls = true")
        _positive("console.session_hours", c.session_hours, at_most=24 * 30)
        if not 1 <= c.traffic_step_s <= 60:
            raise ConfigError(
                "", "console.traffic_step_s", f"must be 1 to 60, got {c.traffic_step_s}"
            )


class GpuOverride(_Section):
    index: int  # as CUDA_VISIBLE_DEVICES names it
    name: str = "GPU"  # the model, e.g. "NVIDIA H200"
    uuid: str = ""  # nvidia-smi's GPU UUID
    memory_total_mib: int | None = None  # its memory, MiB
    healthy: bool = True  # false: never placed on
    problems: list[str] = []  # why it is not healthy, in words


class InventoryOverrides(_Section):
    """What is written wins over what is discovered."""

    address: str = ""  # where routers reach this node's engines; default: as the server sees it
    cpus: int | None = None  # replaces the CPUs counted
    memory_gb: float | None = None  # GiB; replaces /proc/meminfo's total
    fabric: str = ""  # the node's fabric; cannot be discovered
    ib_fabrics: dict[str, str] = {}  # adapter name -> fabric label
    labels: dict[str, str] = {}  # matched by profiles' selectors
    gpus: list[GpuOverride] | None = None  # replaces what nvidia-smi says
    engines: dict[str, str] | None = None  # name -> version; replaces probed ones by name


class DiscoveryConfig(_Section):
    """How the agent finds things out; the defaults fit a normal Linux node."""

    interval_s: float = 60.0  # engines, GPUs, weights are probed again this often
    probe_timeout_s: float = 10.0  # each external command (nvidia-smi, engine --version)
    nvidia_smi: str = "nvidia-smi"  # the command that lists GPUs; a missing one: no GPUs
    llama_server_search: list[str] = []  # extra glob patterns after PATH and the usual places
    meminfo: str = "/proc/meminfo"  # where memory is read from
    mounts: str = "/proc/mounts"  # where storage is classified from (shared or local)
    infiniband: str = "/sys/class/infiniband"  # where InfiniBand adapters are listed


class WeightsConfig(_Section):
    """Where the agent looks for model weights."""

    dirs: list[str] = []  # where to look for model weights
    default_dir: str = "/var/lib/llmgw-weights"  # where fetched weights land; always looked in
    # GiB the weights in default_dir may take: a fetch past it evicts the weights unused
    # for longest (never ones a replica here uses or a fetch needs), or fails saying so.
    # Unset: only the disk's free space bounds them
    budget_gb: float | None = None
    # HOST:PORT of this agent's weights transfer listener (mutual TLS, the agent's own
    # certificate): agents of its fabric take weights it holds, or is fetching, from it
    # instead of from their source. Empty: it serves none (it may still take from others)
    peer_listen: str = ""


class EnginesConfig(_Section):
    """How the agent runs engines: binaries, ports, stops, logs, health."""

    # the one launched and reported; default: what discovery finds (PATH, then unpacked archives)
    llama_server: str = ""
    port_range: list[int] = msgspec.field(default_factory=lambda: [20000, 20999])  # engine ports
    kill_unidentified: bool = True  # kill a process on those ports that no shard describes
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this; a profile's stop_grace_s wins
    log_max_mb: int = 64  # each engine's log is rotated past this (one old copy kept)
    stopped_log_keep_hours: float = 72.0  # logs of shards no longer running here, at most
    stopped_logs_max_mb: int = 1024  # those logs in all, newest kept
    health_interval_s: float = 2.0  # a ready engine's health is checked this often
    unhealthy_after: int = 3  # checks in a row without an answer: reported unhealthy
    # where engines listen: "auto" (the node's address as reported: [inventory] address,
    # by default the local address of the agent's connection to the control plane),
    # "0.0.0.0" (every interface), or an address of this node
    bind: str = "auto"


class MetricsConfig(_Section):
    """Prometheus /metrics of this daemon."""

    listen: str = ""  # e.g. "127.0.0.1:9464"; empty: no metrics listener
    # a file holding the token Prometheus must send (Authorization: Bearer): it reads
    # metrics and nothing else; empty: none asked (keep the listener on a trusted network)
    token_file: str = ""


class BackoffConfig(_Section):
    """How the agent waits between attempts to reach the control plane."""

    initial_s: float = 0.5  # the first wait before dialling again
    # the longest wait (exponential, full jitter); for a minute after a stream that
    # worked ends, at most 2 s (a restarted control plane is back within moments)
    max_s: float = 30.0


class AgentConfig(_Section):
    control_plane: list[str] = []  # host:port of the server's agent stream, tried in turn
    ca: str = "pki/ca.pem"  # the fleet's CA certificate
    cert: str = ""  # default: pki/<node_id>.pem
    key: str = ""  # default: pki/<node_id>-key.pem
    node_id: str = ""  # default: the hostname
    state_dir: str = "agent-state"  # shard records, engine logs, the one-agent lock
    log_level: str = "info"  # debug, info, warning or error
    connect_timeout_s: float = 10.0  # name lookup and TCP connect to the control plane
    handshake_timeout_s: float = 10.0  # TLS, WebSocket and registration
    backoff: BackoffConfig = msgspec.field(default_factory=BackoffConfig)
    inventory: InventoryOverrides = msgspec.field(default_factory=InventoryOverrides)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    engines: EnginesConfig = msgspec.field(default_factory=EnginesConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)

    def validate(self) -> None:
        if not self.control_plane:
            raise ConfigError(
                "", "control_plane", 'no control plane address given (write ["host:7443"])'
            )
        for i, address in enumerate(self.control_plane):
            parse_hostport(address, key=f"control_plane[{i}]")
        _positive("connect_timeout_s", self.connect_timeout_s, at_most=300)
        _positive("handshake_timeout_s", self.handshake_timeout_s, at_most=300)
        _positive("backoff.initial_s", self.backoff.initial_s, at_most=3600)
        _positive("backoff.max_s", self.backoff.max_s, at_most=3600)
        if self.backoff.max_s < self.backoff.initial_s:
            raise ConfigError("", "backoff.max_s", "must be at least backoff.initial_s")
        if self.inventory.memory_gb is not None:
            _positive("inventory.memory_gb", self.inventory.memory_gb)
        if self.inventory.cpus is not None:
            _positive("inventory.cpus", self.inventory.cpus)
        _positive("discovery.interval_s", self.discovery.interval_s, at_most=DAY_S)
        if self.weights.budget_gb is not None:
            _positive("weights.budget_gb", self.weights.budget_gb)
        if self.weights.peer_listen:
            parse_hostport(self.weights.peer_listen, key="weights.peer_listen")
        pr = self.engines.port_range
        if len(pr) != 2 or not 1 <= pr[0] <= pr[1] <= 65535:
            raise ConfigError(
                "", "engines.port_range", f"must be [low, high] within 1-65535, got {pr}"
            )
        _positive("engines.stop_grace_s", self.engines.stop_grace_s, at_most=3600)
        _positive("engines.health_interval_s", self.engines.health_interval_s, at_most=3600)
        _positive("engines.unhealthy_after", self.engines.unhealthy_after, at_most=1000)
        _positive("engines.log_max_mb", self.engines.log_max_mb)
        _positive("engines.stopped_log_keep_hours", self.engines.stopped_log_keep_hours)
        _positive("engines.stopped_logs_max_mb", self.engines.stopped_logs_max_mb)
        if self.engines.bind != "auto":
            try:
                ipaddress.ip_address(self.engines.bind)
            except ValueError:
                raise ConfigError(
                    "",
                    "engines.bind",
                    f'must be "auto", "0.0.0.0" or an IP address of this node, '
                    f"got {self.engines.bind!r}",
                ) from None
        if self.metrics.listen:
            parse_hostport(self.metrics.listen, key="metrics.listen")
        _positive("discovery.probe_timeout_s", self.discovery.probe_timeout_s, at_most=600)
        _check_log_level(self.log_level)


def _check_log_level(level: str) -> None:
    if level.lower() not in {"debug", "info", "warning", "error"}:
        raise ConfigError("", "log_level", f"{level!r} is not one of debug, info, warning, error")


class StandaloneRouterConfig(_Section):
    """``llmgw router``: the OpenAI-compatible endpoint on a machine of its own,
    following the control plane's routing table over its admin API."""

    admin_url: str = "http://127.0.0.1:7444"  # the control plane's management API
    admin_token: str = ""  # the control plane's admin token; prefer admin_token_file
    admin_token_file: str = ""  # a file holding it (mode 0600)
    workers: int = 1  # processes sharing the listen port (SO_REUSEPORT)
    metrics_listen: str = ""  # Prometheus /metrics of every worker, e.g. "127.0.0.1:9464"
    metrics_token_file: str = ""  # the token metrics_listen asks for; empty: none
    log_level: str = "info"  # debug, info, warning or error
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)

    def validate(self) -> None:
        if not self.admin_url.startswith(("http://", "https://")):
            raise ConfigError("", "admin_url", f"{self.admin_url!r} is not an http(s) URL")
        if not self.admin_token and not self.admin_token_file:
            raise ConfigError("", "admin_token", "set admin_token or admin_token_file")
        if not self.router.listen:
            raise ConfigError("", "router.listen", "where should the router listen? (host:port)")
        host_port = parse_hostport(self.router.listen, key="router.listen")
        if not 1 <= self.workers <= 64:
            raise ConfigError("", "workers", f"must be in 1-64, got {self.workers}")
        if self.workers > 1 and host_port[1] == 0:
            raise ConfigError(
                "", "router.listen", "several workers share one port: give a fixed port"
            )
        self.router.validate()
        if self.metrics_listen:
            metrics = parse_hostport(self.metrics_listen, key="metrics_listen")
            if metrics[1] == host_port[1] and metrics[1] != 0:
                raise ConfigError(
                    "", "metrics_listen", f"port {metrics[1]} is router.listen's: use another"
                )
        _check_log_level(self.log_level)

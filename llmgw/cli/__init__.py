"""The ``llmgw`` command: ``server``, ``agent`` and ``ctl``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import cyclopts
import msgspec

from llmgw.cli.bench import bench_app
from llmgw.cli.cert import cert_app
from llmgw.cli.ctl import ctl_app
from llmgw.cli.init import init
from llmgw.cli.onboard import onboard
from llmgw.cli.runtime import fail, run_daemon, setup_logging
from llmgw.cli.tenancy import key_app, tenant_app, usage
from llmgw.cli.weights import weights_app
from llmgw.config import AgentConfig, ConfigError, ServerConfig, load_config
from llmgw.tls import TLSConfigError
from llmgw.version import describe

OPERATOR_ERRORS = (ConfigError, TLSConfigError)
C = TypeVar("C", bound=msgspec.Struct)

app = cyclopts.App(
    name="llmgw",
    help="Run open-weight LLMs on your own GPU fleet behind one OpenAI-compatible endpoint.",
    version=describe,
)
ctl_app.command(cert_app)
ctl_app.command(onboard)
ctl_app.command(bench_app)
ctl_app.command(tenant_app)
ctl_app.command(key_app)
ctl_app.command(usage)
ctl_app.command(weights_app)
app.command(ctl_app)
app.command(init)

Overrides = Annotated[
    list[str] | None,
    cyclopts.Parameter(
        name=["--set", "-s"],
        help="Override one config key, KEY=VALUE with a dotted key "
        "(e.g. --set liveness.lost_after_s=30). Repeatable; wins over the file.",
    ),
]


@app.command
def server(
    config: Annotated[Path | None, cyclopts.Parameter(name=["--config", "-c"])] = None,
    *,
    set_: Overrides = None,
    agent_listen: str | None = None,
    admin_listen: str | None = None,
    log_level: str | None = None,
) -> int:
    """Run the control plane: accept agent streams (mutual TLS), keep the node table, and
    serve the management API on the admin listener.

    Parameters
    ----------
    config
        TOML file (see packaging/server.example.toml). Relative paths in it are
        resolved against its folder.
    agent_listen
        Where agents dial in, HOST:PORT (same as --set agent_stream.listen=...).
    admin_listen
        The management API, HOST:PORT; loopback by default.
    log_level
        debug, info, warning or error.
    """
    overrides = list(set_ or [])
    for key, value in (
        ("agent_stream.listen", agent_listen),
        ("admin.listen", admin_listen),
        ("log_level", log_level),
    ):
        if value is not None:
            overrides.append(f"{key}={_quote(value)}")
    from llmgw.serve import server as daemon

    def reread() -> ServerConfig:  # ctl reload and SIGHUP: the keys, from the same file
        return load_config(ServerConfig, config, overrides)[0]

    return _start(
        "llmgw server",
        ServerConfig,
        config,
        overrides,
        lambda cfg, base: daemon.serve(cfg, base, reread),
    )


@app.command
def agent(
    config: Annotated[Path | None, cyclopts.Parameter(name=["--config", "-c"])] = None,
    *,
    set_: Overrides = None,
    control_plane: list[str] | None = None,
    node_id: str | None = None,
    log_level: str | None = None,
    check: Annotated[bool, cyclopts.Parameter(negative="")] = False,
) -> int:
    """Run the node agent: dial the control plane over mutual TLS, register this node,
    heartbeat, and reconnect forever with jittered backoff.

    Parameters
    ----------
    config
        TOML file (see packaging/agent.example.toml): the control plane's
        addresses and the TLS files; everything else is discovered.
    control_plane
        HOST:PORT of the control plane's agent stream (repeatable).
    node_id
        Node id; defaults to the hostname and must equal the certificate's common name.
    log_level
        debug, info, warning or error.
    check
        Preflight, then exit: read the config and certificates, dial the control
        plane (name lookup, TCP, TLS, identity), show what discovery finds. Starts
        nothing and disturbs no running agent; exits 1 at the first blocker.
    """
    overrides = list(set_ or [])
    if control_plane:
        overrides.append("control_plane=[" + ", ".join(_quote(a) for a in control_plane) + "]")
    if node_id is not None:
        overrides.append(f"node_id={_quote(node_id)}")
    if log_level is not None:
        overrides.append(f"log_level={_quote(log_level)}")
    if check:
        from llmgw.cli.check import check_agent

        return check_agent(config, overrides)
    from llmgw.serve import agent as daemon

    reread = daemon.Rereader(  # SIGHUP: the file again, with the same overrides
        read=lambda: load_config(AgentConfig, config, overrides)[0],
        source=str(config) if config else "the agent's config",
        set_log_level=setup_logging,
    )
    return _start(
        "llmgw agent",
        AgentConfig,
        config,
        overrides,
        lambda cfg, base: daemon.serve(cfg, base, reread),
    )


@app.command
def router(
    config: Annotated[Path | None, cyclopts.Parameter(name=["--config", "-c"])] = None,
    *,
    set_: Overrides = None,
    workers: int | None = None,
    worker: Annotated[int, cyclopts.Parameter(show=False)] = 0,
    run_dir: Annotated[str, cyclopts.Parameter(show=False)] = "",
    log_level: str | None = None,
) -> int:
    """Run the OpenAI-compatible endpoint on its own, following the control plane's
    routing table over its admin API; several can stand behind a load balancer.

    Parameters
    ----------
    config
        TOML file (see packaging/router.example.toml).
    workers
        Processes sharing the listen port (each follows the table itself).
    log_level
        debug, info, warning or error.
    """
    overrides = list(set_ or [])
    if workers is not None:
        overrides.append(f"workers={workers}")
    if log_level is not None:
        overrides.append(f"log_level={_quote(log_level)}")
    from llmgw.config.schema import StandaloneRouterConfig
    from llmgw.serve import router as daemon

    # what the other workers are started with: the same file and everything said on
    # this command line (--log-level, --workers, --set), as overrides
    argv = (
        ["router"]
        + (["--config", str(config)] if config else [])
        + [a for o in overrides for a in ("--set", o)]
    )

    def reread() -> StandaloneRouterConfig:  # SIGHUP: the keys, from the same file
        return load_config(StandaloneRouterConfig, config, overrides)[0]

    return _start(
        "llmgw router",
        StandaloneRouterConfig,
        config,
        overrides,
        lambda cfg, base: daemon.serve(cfg, base, argv, worker, run_dir, reread),
    )


def _start(
    program: str,
    kind: type[C],
    path: Path | None,
    overrides: list[str],
    serve: Callable[[C, Path], Awaitable[None]],
) -> int:
    """Load and check the config, then run the daemon; bad config: exit 2, one line."""
    try:
        cfg, base = load_config(kind, path, overrides)
    except ConfigError as exc:
        return fail(program, str(exc))
    setup_logging(getattr(cfg, "log_level", "info"))
    return run_daemon(program, lambda: serve(cfg, base), OPERATOR_ERRORS)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main() -> None:
    app()

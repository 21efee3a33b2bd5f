"""How many connections each listener of a daemon may hold, within its open-files limit.

Every connection is a file descriptor, and a client connection to the
OpenAI-compatible endpoint may need a second one, to its engine. A process
that accepts until ``accept`` fails with EMFILE has none left to reach its
engines, write its logs or answer its admin API: one client holding idle
connections fails everyone. So the limits are divided up front, from the
open-files limit (which the CLI has raised to its hard limit) and the
descriptors already open:

- three quarters go to the client endpoint, two per connection, so its
  ``max_connections`` is cut to fit (said in one line at start);
- the admin API gets at most an eighth, the metrics listener a sixteenth
  (each also has a small fixed ceiling: they serve operators, routers and
  Prometheus, not the public);
- the rest is left for agent streams, engines' logs and whatever the process
  opens later.

A tenth of the endpoint's connections is kept for requests with an API key
(``ServerLimits.reserved_connections``).
"""

from __future__ import annotations

import os
import resource

import attrs

from llmgw.config.schema import RouterConfig
from llmgw.http import HttpServer, ServerLimits
from llmgw.http.metrics import MetricsApp

ADMIN_CONNECTIONS = 256  # ctl, routers' routing watches (one per worker)
METRICS_CONNECTIONS = 64  # Prometheus servers, a dashboard or two
_MIB = 2**20


@attrs.frozen
class Shares:
    """Connections each listener may hold, and the limit they were cut from."""

    nofile: int  # the open-files limit; 0: none
    in_use: int  # descriptors open when the shares were made
    clients: int  # the client endpoint's max_connections, as configured or cut
    admin: int
    metrics: int


def shares(configured: int, nofile: int, in_use: int) -> Shares:
    """Divide ``nofile`` descriptors (0: no limit) among the listeners; see the module
    docstring. ``configured`` is the endpoint's ``max_connections``."""
    if nofile <= 0:
        return Shares(nofile, in_use, configured, ADMIN_CONNECTIONS, METRICS_CONNECTIONS)
    free = max(0, nofile - in_use)
    return Shares(
        nofile,
        in_use,
        max(1, min(configured, free * 3 // 8)),
        max(1, min(ADMIN_CONNECTIONS, free // 8)),
        max(1, min(METRICS_CONNECTIONS, free // 16)),
    )


def process_shares(configured: int) -> Shares:
    """``shares`` for this process, from its open-files limit as it is now (the CLI has
    raised the soft limit to the hard one: ``cli.runtime.raise_open_files_limit``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64  # no /proc: a guess of what a daemon holds at start
    nofile = 0 if soft == resource.RLIM_INFINITY else soft
    return shares(configured, nofile, in_use)


def capped_line(key: str, configured: int, got: Shares) -> str:
    """The one line to log when the open-files limit cut ``key`` (the endpoint's
    max_connections); "" if it did not."""
    if got.clients >= configured:
        return ""
    return (
        f"{key} {configured} cut to {got.clients}: the open-files limit"
        f" is {got.nofile} ({got.in_use} open at start) and each client connection may need"
        " a second one to its engine; raise LimitNOFILE (ulimit -n) to allow more"
    )


def router_limits(config: RouterConfig, got: Shares) -> ServerLimits:
    """The client endpoint's limits: its config, with ``max_connections`` as cut."""
    return ServerLimits(
        max_body_bytes=int(config.max_body_mb * _MIB),
        max_bodies_bytes=int(config.max_bodies_mb * _MIB),
        min_body_rate=config.min_body_kib_per_s * 1024,
        write_timeout_s=config.send_timeout_s,
        max_connections=got.clients,
        reserved_connections=got.clients // 10,
        max_connections_per_address=min(config.max_connections_per_address, got.clients),
    )


def admin_limits(got: Shares) -> ServerLimits:
    """The admin API's: bodies only after its token, and few of them."""
    return ServerLimits(
        max_bodies_bytes=16 * _MIB,
        max_connections=got.admin,
        max_connections_per_address=got.admin,
        reserved_connections=got.admin // 10,
    )


def metrics_limits(got: Shares, token: bool) -> ServerLimits:
    """A metrics listener's: GET only, so no body at all; with a ``token``, a tenth of its
    connections kept for requests that carry it."""
    return ServerLimits(
        max_body_bytes=0,
        max_bodies_bytes=64 * 1024,
        max_connections=got.metrics,
        max_connections_per_address=got.metrics,
        reserved_connections=got.metrics // 10 if token else 0,
    )


def metrics_server(app: MetricsApp, got: Shares, name: str) -> HttpServer:
    """A metrics listener's server: every request judged by its head (``app.admit``)."""
    return HttpServer(app, limits=metrics_limits(got, bool(app.token)), name=name, admit=app.admit)

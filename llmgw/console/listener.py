"""The console's listener and the task that keeps its traffic, as ``llmgw server`` runs them."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from llmgw.console.traffic import TrafficHistory
from llmgw.controlplane.changes import Bell
from llmgw.http import HttpServer, ServerLimits
from llmgw.http.types import Handler
from llmgw.routing import ModelCounters

VIEWER_TOKEN_FILE = "console-viewer-token"  # in the state directory, unless the config names one


def console_server(app: Handler) -> HttpServer:
    """A few people's browsers: small bodies, a bounded number of connections."""
    limits = ServerLimits(
        max_body_bytes=64 * 1024,
        max_bodies_bytes=8 * 1024 * 1024,
        max_connections=1024,
        max_connections_per_address=256,
    )
    return HttpServer(app, limits=limits, name="console")


async def keep_traffic(
    history: TrafficHistory,
    read: Callable[[], dict[str, dict[str, ModelCounters]]],
    bell: Bell,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Every step, what the routers answered since the last; the bell rings when a
    step had any traffic (an open traffic page then reads it)."""
    history.sample(read(), time.time())
    task_status.started()
    while True:
        await trio.sleep(history.step_s)
        history.sample(read(), time.time())
        if history.moved():
            bell.ring("traffic")

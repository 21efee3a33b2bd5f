"""Launch: from a shard spec to an engine process the agent can find again.

Theory of operation
-------------------
The adapter validates the spec first (refusing before minutes of loading).
Validation reads the model's files (a GGUF header can be megabytes, on a
filer that may hang), so it runs in a worker thread: the event loop keeps
heartbeating while it reads.

A process that holds the shard's port and that no spec describes is killed
(and, for a GPU shard, any process holding GPU memory that no spec
describes); a port still held after that refuses the launch. The engine
starts in its own session and process group, with a clean environment that
carries its shard's tag (``env``), and its output appended to a log file; the full spec, the pid, its start time and command line are
written to the state directory (atomically) *before* the shard is reported
``starting``.

An engine that serves HTTP listens on the node's address on the route to
the control plane (``[engines] bind``), and takes requests only with its own
key: a random secret made here for each launch, passed in its environment
(never argv, which any user can read in ``/proc``), kept in its record (mode
0600) for a restarted agent, and reported to the control plane, whose routers
send it. Nothing logs it.

A command can overtake the launch at each await: the launcher checks that the
shard is still ``starting`` right before it spawns, and ends what it spawned
if a stop or drain came in while it did.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from pathlib import Path

import msgspec
import trio

from llmgw.agent.context import ShardContext
from llmgw.agent.env import engine_env, tagged_shard
from llmgw.agent.lifecycle import Event, Phase
from llmgw.agent.procs import (
    ProcessIdentity,
    environ,
    identity,
    port_holders,
    terminate_group,
)
from llmgw.agent.shard import Shard
from llmgw.engines import adapters
from llmgw.engines.base import with_key

log = logging.getLogger("llmgw.agent.supervisor")


def held_why(port: int, holders: set[int], state_dir: Path) -> str:
    """Why a port cannot be had, in words that say what to do where the agent knows."""
    for pid in sorted(holders):
        sid = tagged_shard(environ(pid), state_dir)
        if sid is not None:
            return (
                f"port {port} is held by pid {pid}, an engine this agent started for shard "
                f"{sid} that no readable record describes; stop it (kill -TERM -- -{pid}) "
                "to free the port"
            )
    return f"port {port} is held by pid {', '.join(map(str, sorted(holders)))}"


async def launch(ctx: ShardContext, shard: Shard) -> bool:
    """Start the shard's engine; True when it runs and is the shard's to watch."""
    spec = shard.spec
    adapter = adapters().get(spec.engine)
    if adapter is None:
        known = ", ".join(adapters())
        ctx.fire(shard, Event.REFUSED, f"unknown engine {spec.engine!r} (known: {known})")
        return False
    # the engine listens where the agent says, not where the control plane asked
    bind = ctx.bind_address(spec)
    spec = spec if bind == spec.host else msgspec.structs.replace(spec, host=bind)
    # the adapter reads the model's files: off the event loop, which must keep heartbeating
    problems = await trio.to_thread.run_sync(adapter.validate, spec, abandon_on_cancel=True)
    if problems:
        ctx.fire(shard, Event.REFUSED, "refused before launch: " + "; ".join(problems))
        return False
    binaries = dict(ctx.binaries())
    try:
        how = adapter.launch(spec, binaries)
    except KeyError as exc:
        ctx.fire(shard, Event.REFUSED, f"{exc.args[0]} is not installed on this node")
        return False
    if how.health_url is not None:  # it serves HTTP: only to whoever holds its own key
        how = with_key(how, adapter.key_env, secrets.token_urlsafe(32))
    ports = {spec.port} if how.health_url is not None and spec.port else set()
    if ctx.settings.kill_unidentified:
        await ctx.kill_unidentified(ports)
        if spec.gpus:
            await ctx.kill_gpu_holders()
    holders = port_holders(ports).get(spec.port, set()) if ports else set()
    if holders:
        ctx.fire(shard, Event.REFUSED, held_why(spec.port, holders, ctx.settings.state_dir))
        return False
    if shard.phase is not Phase.STARTING:
        return False  # stopped or drained while it was being prepared: nothing to launch
    shard.launch = how
    fd = shard.tail.open_for_engine()
    try:
        process = await trio.lowlevel.open_process(
            how.argv,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            env=engine_env(os.environ, how.env, spec.shard_id, ctx.settings.state_dir),
        )
    except OSError as exc:
        os.close(fd)
        ctx.fire(shard, Event.REFUSED, f"cannot start {how.argv[0]}: {exc.strerror or exc}")
        return False
    os.close(fd)
    shard.process = process
    # Right after the spawn, /proc may not show the new program's argv yet; the
    # start time is fixed at fork, so record it with the argv we passed.
    seen = identity(process.pid)
    shard.ident = ProcessIdentity(
        pid=process.pid,
        start_time=seen.start_time if seen else 0,
        cmdline=tuple(how.argv),
        pgid=process.pid,  # start_new_session: the engine leads its own group
        state="R",
    )
    shard.launched_at = time.time()
    ctx.write_record(shard)
    ctx.on_event("launched")
    log.info("shard %s: started %s (pid %d)", spec.shard_id, how.argv[0], process.pid)
    if ctx.fire(shard, Event.LAUNCHED, f"pid {process.pid}").to is not Phase.STARTING:
        # a stop or drain came while it was spawning; whoever ends the shard may
        # have looked before there was a process to end
        log.info("shard %s: ending pid %d, no longer wanted", spec.shard_id, process.pid)
        await terminate_group(process.pid, grace=2.0, on_sigkill=ctx.sigkill_hook(shard, 2.0))
        with trio.move_on_after(5):
            await process.wait()
        ctx.records.remove(spec.shard_id)  # it describes nothing now
        return False
    return True

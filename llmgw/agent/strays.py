"""Processes nobody can describe: they hold an engine port or a GPU, and no shard is them.

Placement hands out this node's engine ports and GPUs; a process holding one
that no shard spec describes (an engine left by an agent whose records were
lost, something an operator started by hand) would make the next engine
placed there fail, or share a GPU it was promised alone. The agent kills
such processes, logs each kill with what it was and what it held, and
reports it (``on_kill``) for the control plane to log too.

Every kill the agent makes, these and a shard's SIGKILL after its stop
grace, waits in ``KillReports`` until a registered session carries it up on
a heartbeat.

A process carrying this agent's tag (``env``) is spared: it is an engine this
agent started whose record was lost or spoiled, and killing a healthy engine
because a file went bad would take its replica down for nothing. It is
logged, with the pid to stop by hand.

A process that leads its own group (as every engine the agent starts does)
is ended with its group; anything else gets SIGKILL alone, so the agent never
signals its own group or a shell's.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import trio

from llmgw.agent.discovery.gpus import gpu_processes
from llmgw.agent.env import tagged_shard
from llmgw.agent.procs import (
    ProcessIdentity,
    environ,
    group_members,
    identity,
    listening_ports,
    port_holders,
    terminate_group,
)
from llmgw.agent.shard import Shard
from llmgw.http.logsafe import printable
from llmgw.protocol.messages import ProcessKill

log = logging.getLogger("llmgw.agent.supervisor")

KILL_REPORTS_LIMIT = 1000
COMMAND_MAX_CHARS = 200
NO_SPEC = "and no shard spec describes it"


class KillReports:
    """Kills waiting for a session to report them (bounded, oldest dropped).

    A kill leaves only once a heartbeat carrying it was sent (``sent``), so one
    made while the stream is down goes up on the next registered session."""

    def __init__(self) -> None:
        self.items: list[ProcessKill] = []
        self.changed = trio.Event()

    def put(self, kill: ProcessKill) -> None:
        self.items.append(kill)
        del self.items[:-KILL_REPORTS_LIMIT]
        self.changed.set()
        self.changed = trio.Event()

    def sent(self, batch: Sequence[ProcessKill]) -> None:
        gone = {id(k) for k in batch}
        self.items = [k for k in self.items if id(k) not in gone]


def kill_report(
    pid: int, cmdline: Sequence[str], reason: str, kind: str, shard_id: str = ""
) -> ProcessKill:
    return ProcessKill(
        pid=pid,
        reason=reason,
        kind=kind,
        shard_id=shard_id,
        command=short_command(cmdline),
        killed_at=time.time(),
    )


def short_command(cmdline: Sequence[str]) -> str:
    """A command line cut short; escape it (``printable``) where it is logged."""
    return " ".join(cmdline)[:COMMAND_MAX_CHARS]


def port_range_listeners(port_range: tuple[int, int]) -> set[int]:
    """The ports of the engine range that something listens on now."""
    low, high = port_range
    return {p for p in listening_ports() if low <= p <= high}


def ours(shards: Iterable[Shard]) -> set[int]:
    """This agent and every process of every shard it runs."""
    pids: set[int] = {os.getpid()}
    for shard in shards:
        if shard.ident is not None:
            pids.update(group_members(shard.ident.pgid))
            pids.add(shard.ident.pid)
    return pids


def spared(who: ProcessIdentity, holds: str, state_dir: Path) -> bool:
    """True (and logged) when ``who`` carries this agent's tag: an engine of ours."""
    sid = tagged_shard(environ(who.pid), state_dir)
    if sid is None:
        return False
    log.error(
        "pid %d holds %s and no record describes it, but it is an engine this agent "
        "started for shard %s: leaving it running. Stop it with 'kill -TERM -- -%d' "
        "if it is not wanted",
        who.pid,
        holds,
        printable(sid),  # read from the process's environment: anyone could have set it
        who.pgid,
    )
    return True


async def kill_unidentified(
    ports: set[int],
    ours: set[int],
    on_event: Callable[[str], None],
    state_dir: Path,
    on_kill: Callable[[ProcessKill], None] = lambda _: None,
) -> None:
    """Kill processes that hold a port we assign and that no shard describes."""
    if not ports:
        return
    for port, pids in sorted(port_holders(ports).items()):
        for pid in sorted(pids - ours):
            who = identity(pid)
            if who is None or spared(who, f"port {port}", state_dir):
                continue
            what = f"port {port}, which this agent assigns to engines, {NO_SPEC}"
            log.warning(
                "killing pid %d (%s): it holds %s", pid, printable(short_command(who.cmdline)), what
            )
            on_event("killed")
            await kill_process(who)
            on_kill(kill_report(pid, who.cmdline, f"held {what}", "stray"))


async def kill_gpu_holders(
    nvidia_smi: str,
    ours: Callable[[], set[int]],
    on_event: Callable[[str], None],
    state_dir: Path,
    on_kill: Callable[[ProcessKill], None] = lambda _: None,
) -> None:
    """Kill processes holding GPU memory that no shard describes: placement hands
    this node's GPUs out, and would hand theirs out again."""
    holders = await gpu_processes(nvidia_smi)
    if not holders:
        return
    known = ours()
    for pid, gpu in sorted(holders.items()):
        if pid in known:
            continue
        who = identity(pid)
        if who is None or spared(who, f"memory on GPU {gpu}", state_dir):
            continue
        what = f"memory on GPU {gpu}, which this agent assigns to engines, {NO_SPEC}"
        log.warning(
            "killing pid %d (%s): it holds %s", pid, printable(short_command(who.cmdline)), what
        )
        on_event("killed")
        await kill_process(who)
        on_kill(kill_report(pid, who.cmdline, f"held {what}", "stray"))


async def kill_process(who: ProcessIdentity) -> None:
    if who.pgid == who.pid and who.pgid != os.getpgrp():
        await terminate_group(who.pid, grace=2.0)
    else:
        try:
            os.kill(who.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

"""Adoption: a restarted agent takes over the engines its previous run left serving.

A restarted agent reads the records and adopts every engine whose pid is
alive with the same start time and command line (a recycled pid is not our
engine; see ``procs``), or with the same start time and this agent's tag for
that shard in its environment (``env``): a record read from its previous
copy may hold the command line of a launcher the engine has since exec'd.

An engine of ours whose record cannot be read at all (tagged, but no record
describes it) is never killed: the agent cannot describe its shard to the
control plane, so it does not adopt it, but leaves it serving and says so in
one line with the pid to stop by hand. Stray killing (``strays``) spares it
for the same reason. It cannot wait on a process that is not its child,
so it watches it through a pidfd (polling /proc where there are none) and
stops it by signalling the group.

An adopted shard starts out ``starting``; one health check of each before the
first registration, and before its watcher starts, moves those that serve to
``ready`` (through the lifecycle table, and reported like any other move), so
a reconnecting agent reports the engines that serve as ready, not as
starting. The watcher of each of the rest waits for its health as a new
shard's does, within its spec's startup timeout.

An engine launched able to sleep is asked first whether it sleeps (a sleeping
vLLM answers its health check, but generates nothing): one that does is
``sleeping``, as it was, and waits to be woken.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import attrs
import trio

from llmgw.agent.env import tagged_shard
from llmgw.agent.lifecycle import Phase
from llmgw.agent.output import OutputTail
from llmgw.agent.procs import (
    ProcessIdentity,
    alive,
    all_pids,
    environ,
    identity,
    is_same_process,
    reaped_exit,
    zombie_exit,
)
from llmgw.agent.records import RecordStore
from llmgw.agent.shard import Shard
from llmgw.engines.base import Launch

log = logging.getLogger("llmgw.agent.supervisor")

WATCH_INTERVAL_S = 0.5
CHECK_BOUND_S = 3.0  # the health checks before the first registration, all together
# an adopted engine's exit status: looked for this many times, this far apart
EXIT_STATUS_TRIES = 5
EXIT_STATUS_WAIT_S = 0.02


def is_our_engine(recorded: ProcessIdentity, shard_id: str, state_dir: Path) -> bool:
    """The recorded engine still runs: same pid, start time and command line, or
    same pid and start time with this agent's tag for ``shard_id``."""
    if is_same_process(recorded):
        return True
    now = identity(recorded.pid)
    return (
        now is not None
        and alive(recorded.pid)
        and now.start_time == recorded.start_time
        and tagged_shard(environ(recorded.pid), state_dir) == shard_id
    )


def tagged_leaders(state_dir: Path) -> dict[int, str]:
    """Group leaders carrying the tag of this agent's state dir: pid -> shard."""
    found: dict[int, str] = {}
    for pid in all_pids():
        sid = tagged_shard(environ(pid), state_dir)
        if sid is None:
            continue
        who = identity(pid)
        if who is not None and who.pgid == pid and alive(pid):
            found[pid] = sid
    return found


def report_unrecorded(adopted: Iterable[Shard], state_dir: Path) -> dict[int, str]:
    """Log every engine of ours that no record describes; they are left running."""
    adopted = list(adopted)
    known = {s.ident.pid for s in adopted if s.ident is not None}
    # a daemon an adopted engine started in a session of its own (Ray's head, from
    # `ray start --head`) carries its tag; the shard's cleanup (`ray stop`) ends it
    shards = {s.shard_id for s in adopted}
    left = {
        pid: sid
        for pid, sid in tagged_leaders(state_dir).items()
        if pid not in known and sid not in shards
    }
    for pid, sid in sorted(left.items()):
        log.error(
            "pid %d is an engine this agent started for shard %s, but no readable record "
            "describes it; it is left running and unmanaged. Stop it with "
            "'kill -TERM -- -%d' if it is not wanted",
            pid,
            sid,
            pid,
        )
    return left


def adopt_records(
    records: RecordStore, tail_for: Callable[[str], OutputTail], state_dir: Path
) -> list[Shard]:
    """A shard for every recorded engine that is still that engine; forget the others."""
    adopted: list[Shard] = []
    for record in records.load_all():
        sid = record.spec.shard_id
        recorded = ProcessIdentity(
            pid=record.pid,
            start_time=record.start_time,
            cmdline=tuple(record.cmdline),
            pgid=record.pgid,
            state="",
        )
        if not is_our_engine(recorded, sid, state_dir):
            log.info(
                "shard %s from a previous agent is gone (pid %d is not that engine any more); "
                "forgetting it",
                sid,
                record.pid,
            )
            records.remove(sid)
            continue
        now = identity(record.pid)
        if now is not None and now.cmdline and now.cmdline != recorded.cmdline:
            recorded = attrs.evolve(recorded, cmdline=now.cmdline)  # recognised by its tag
        tail = tail_for(sid)
        tail.skip_to_end()
        adopted.append(
            Shard(
                spec=record.spec,
                tail=tail,
                launch=Launch(
                    argv=list(record.cmdline),
                    env={},
                    health_url=record.health_url,
                    metrics_url=record.metrics_url,
                    cleanup=record.cleanup,
                    engine_key=record.engine_key,
                    sleep_url=record.sleep_url,
                    wake_url=record.wake_url,
                    sleeping_url=record.sleeping_url,
                ),
                ident=recorded,
                adopted=True,
                detail=f"adopted pid {record.pid}",
                launched_at=record.launched_at,
            )
        )
        log.warning(
            "adopted shard %s (pid %d) left running by a previous agent; watching it by "
            "polling. Its earlier output is gone from this agent's memory (what it wrote "
            "is still in %s)",
            sid,
            record.pid,
            record.log_path,
        )
    return adopted


async def adopted_exit(shard: Shard) -> int | None:
    """Wait for an engine that is not our child to end; its returncode if it can be read.

    A pidfd becomes readable when any process exits, child or not; the
    identity is checked again after opening it, so a pid recycled in
    between is not waited on. Without pidfds, poll. The exit status is its
    parent's to reap, but it can be read while the engine is a zombie, or from
    the pidfd once it is reaped (where the kernel keeps it there): the few
    moments in between are waited out.
    """
    ident = shard.ident
    assert ident is not None
    try:
        fd = os.pidfd_open(ident.pid)
    except (OSError, AttributeError):
        while is_same_process(ident):  # noqa: ASYNC110 (no event to wait on)
            await trio.sleep(WATCH_INTERVAL_S)
        return zombie_exit(ident)
    try:
        if is_same_process(ident):
            await trio.lowlevel.wait_readable(fd)
        for _ in range(EXIT_STATUS_TRIES):
            code = zombie_exit(ident)
            if code is None:
                code = reaped_exit(fd)
            if code is not None:
                return code
            await trio.sleep(EXIT_STATUS_WAIT_S)
        return None
    finally:
        os.close(fd)


async def check_adopted(
    shards: Iterable[Shard],
    healthy: Callable[[str], Awaitable[bool]],
    ready: Callable[[Shard], object],
    *,
    settle_s: float,
    asleep: Callable[[Shard], Awaitable[bool]],
    sleeping: Callable[[Shard], object],
) -> None:
    """One health check of every adopted shard still starting; ``ready`` those that serve
    (one without HTTP: that has run for ``settle_s``), ``sleeping`` those whose engine
    says it sleeps (``asleep``, asked first)."""
    with trio.move_on_after(CHECK_BOUND_S):
        for shard in list(shards):
            url = shard.launch.health_url if shard.launch else None
            starting = shard.adopted and shard.phase is Phase.STARTING
            if not starting:
                continue
            if url is None:
                # no HTTP (a Ray worker): ready once it has stayed up, as when launched
                if time.time() - shard.launched_at >= settle_s:
                    ready(shard)
            elif await asleep(shard):
                sleeping(shard)
            elif await healthy(url):
                ready(shard)

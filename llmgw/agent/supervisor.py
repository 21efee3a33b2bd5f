"""The engine supervisor: launch, watch, adopt, stop.

Theory of operation
-------------------
Each shard runs in a task of the supervisor's nursery, which belongs to the
agent daemon and outlives any one control-plane session: engines keep
serving while the agent reconnects.

Launch: the adapter validates the spec first (refusing before minutes of
loading); a process that holds the shard's port and that no spec describes
is killed; the engine starts in its own session and process group with its
output appended to a log file; the full spec, the pid, its start time and
command line are written to the state directory (atomically) *before* the
shard is reported ``starting``. Readiness is the engine's own health
endpoint, bounded by the spec's startup timeout; a shard with no HTTP
endpoint (a Ray worker) is ready once it has stayed up for a moment.

Adoption: a restarted agent reads the records and adopts every engine whose
pid is alive with the same start time and command line (a recycled pid is
not our engine). It cannot wait on a process that is not its child, so it
watches it through a pidfd (polling /proc where there are none) and stops
it by signalling the group.

Stop (adopted or not): SIGTERM to the group, SIGKILL after the grace; the
shard is reported ``stopped`` only once no process of its group remains.

Every transition is queued in the ``outbox`` for whichever session is up;
``reports()`` describes every shard for ``Register``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import httpx
import trio

from llmgw.agent.discovery.gpus import gpu_processes
from llmgw.agent.output import OutputTail
from llmgw.agent.procs import (
    ProcessIdentity,
    alive,
    group_members,
    identity,
    is_same_process,
    listening_ports,
    port_holders,
    terminate_group,
)
from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.engines import adapters
from llmgw.engines.base import Launch
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardState, ShardStatus

log = logging.getLogger("llmgw.agent.supervisor")

HEALTH_INTERVAL_S = 0.25
WATCH_INTERVAL_S = 0.5
WORKER_SETTLE_S = 1.0  # a shard without HTTP is ready once it stayed up this long
OUTBOX_LIMIT = 1000


@attrs.frozen
class SupervisorSettings:
    state_dir: Path
    port_range: tuple[int, int] = (20000, 20999)
    kill_unidentified: bool = True
    stop_grace_s: float = 10.0
    log_max_bytes: int = 64 << 20
    nvidia_smi: str = "nvidia-smi"


@attrs.define(eq=False)
class Shard:
    spec: ShardSpec
    state: ShardState
    tail: OutputTail
    launch: Launch | None = None
    process: trio.Process | None = None  # None when adopted (not our child)
    ident: ProcessIdentity | None = None
    adopted: bool = False
    detail: str = ""
    stopping: bool = False
    launched_at: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.ident.pid if self.ident else None


class Outbox:
    """Status reports waiting for a session to carry them (bounded, oldest dropped)."""

    def __init__(self) -> None:
        self.items: list[ShardStatus] = []
        self.changed = trio.Event()

    def put(self, status: ShardStatus) -> None:
        self.items.append(status)
        del self.items[:-OUTBOX_LIMIT]
        self.changed.set()
        self.changed = trio.Event()

    def take(self) -> list[ShardStatus]:
        items, self.items = self.items, []
        return items


class Supervisor:
    def __init__(
        self,
        settings: SupervisorSettings,
        binaries: Callable[[], Mapping[str, str]],
        *,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.binaries = binaries
        self.records = RecordStore(settings.state_dir)
        self.shards: dict[str, Shard] = {}
        self.outbox = Outbox()
        self.on_event = on_event or (lambda _: None)
        self._nursery: trio.Nursery | None = None
        self._failed: set[str] = set()
        self._http = httpx.AsyncClient(timeout=2.0)

    # --- the daemon side --------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt what a previous agent left, kill what nobody can describe, then serve."""
        async with self._http, trio.open_nursery() as nursery:
            self._nursery = nursery
            self.adopt_all()
            await self._check_adopted()
            if self.settings.kill_unidentified:
                await self.kill_unidentified(self._port_range_listeners())
                await self.kill_gpu_holders()
            task_status.started()
            await trio.sleep_forever()

    def reports(self) -> list[ShardReport]:
        return [
            ShardReport(spec=s.spec, state=s.state, pid=s.pid, detail=s.detail)
            for s in self.shards.values()
            if s.state not in ("stopped", "failed")
        ]

    def start(self, spec: ShardSpec) -> None:
        existing = self.shards.get(spec.shard_id)
        if existing is not None:
            log.info(
                "shard %s is already %s; ignoring a second start", spec.shard_id, existing.state
            )
            self._report(existing)
            return
        if spec.shard_id in self._failed:
            self.on_event("restarted")
        shard = Shard(spec=spec, state="starting", tail=self._tail(spec.shard_id))
        self.shards[spec.shard_id] = shard
        self._spawn(self._run_new, shard)

    def stop(self, shard_id: str, grace: float | None = None) -> None:
        shard = self.shards.get(shard_id)
        if shard is None:
            self.outbox.put(
                ShardStatus(shard_id=shard_id, state="stopped", detail="not running here")
            )
            return
        self._spawn(self._stop, shard, self.settings.stop_grace_s if grace is None else grace)

    def drain(self, shard_id: str, grace: float) -> None:
        """Stop taking work, then stop. The router stops routing to a draining shard at once;
        the engine finishes what it has in flight within the grace."""
        shard = self.shards.get(shard_id)
        if shard is None:
            self.outbox.put(
                ShardStatus(shard_id=shard_id, state="stopped", detail="not running here")
            )
            return
        self._set(shard, "draining", "draining: finishing in-flight requests")
        self._spawn(self._drain, shard, grace)

    # --- launching --------------------------------------------------------

    async def _run_new(self, shard: Shard) -> None:
        spec = shard.spec
        adapter = adapters().get(spec.engine)
        if adapter is None:
            self._fail(shard, f"unknown engine {spec.engine!r} (known: {', '.join(adapters())})")
            return
        problems = adapter.validate(spec)
        if problems:
            self._fail(shard, "refused before launch: " + "; ".join(problems))
            return
        binaries = dict(self.binaries())
        try:
            launch = adapter.launch(spec, binaries)
        except KeyError as exc:
            self._fail(shard, f"{exc.args[0]} is not installed on this node")
            return
        ports = {spec.port} if launch.health_url is not None and spec.port else set()
        if self.settings.kill_unidentified:
            await self.kill_unidentified(ports)
            if spec.gpus:
                await self.kill_gpu_holders()
        holders = port_holders(ports).get(spec.port, set()) if ports else set()
        if holders:
            self._fail(
                shard, f"port {spec.port} is held by pid {', '.join(map(str, sorted(holders)))}"
            )
            return
        shard.launch = launch
        fd = shard.tail.open_for_engine()
        try:
            process = await trio.lowlevel.open_process(
                launch.argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=fd,
                start_new_session=True,
                env={**os.environ, **launch.env},
            )
        except OSError as exc:
            os.close(fd)
            self._fail(shard, f"cannot start {launch.argv[0]}: {exc.strerror or exc}")
            return
        os.close(fd)
        shard.process = process
        # Right after the spawn, /proc may not show the new program's argv yet; the
        # start time is fixed at fork, so record it with the argv we passed.
        seen = identity(process.pid)
        shard.ident = ProcessIdentity(
            pid=process.pid,
            start_time=seen.start_time if seen else 0,
            cmdline=tuple(launch.argv),
            pgid=process.pid,  # start_new_session: the engine leads its own group
            state="R",
        )
        shard.launched_at = time.time()
        self._write_record(shard)
        self.on_event("launched")
        log.info("shard %s: started %s (pid %d)", spec.shard_id, launch.argv[0], process.pid)
        self._set(shard, "starting", f"pid {process.pid}")
        await self._until_ready(shard, deadline=trio.current_time() + spec.startup_timeout_s)
        await self._watch(shard)

    async def _until_ready(self, shard: Shard, *, deadline: float) -> None:
        launch = shard.launch
        assert launch is not None
        settled = trio.current_time() + WORKER_SETTLE_S
        while True:
            if not self._running(shard):
                return  # _watch reports how it ended
            if shard.stopping:
                return
            if launch.health_url is None:
                if trio.current_time() >= settled:
                    break
            elif await self._healthy(launch.health_url):
                break
            if trio.current_time() >= deadline:
                timeout = shard.spec.startup_timeout_s
                log.warning(
                    "shard %s: not ready within %g s; stopping it", shard.spec.shard_id, timeout
                )
                await self._terminate(shard, grace=2.0)
                self._fail(shard, f"not ready within the startup timeout of {timeout:g} s")
                return
            await trio.sleep(HEALTH_INTERVAL_S)
        self._settle_identity(shard)
        self._set(shard, "ready", "")
        log.info("shard %s is ready", shard.spec.shard_id)

    async def _healthy(self, url: str) -> bool:
        try:
            response = await self._http.get(url)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _watch(self, shard: Shard) -> None:
        """Until the engine ends; an end nobody asked for is a failure, with its output."""
        if shard.state == "failed":
            return
        if shard.process is not None:
            code = await shard.process.wait()
            why = (
                f"killed by signal {signal.Signals(-code).name}"
                if code < 0
                else f"exited with code {code}"
            )
        else:
            await self._adopted_exit(shard)
            why = "exited (adopted: its exit status is its old parent's to read)"
        if shard.stopping or shard.state in ("stopped", "failed"):
            return
        # what the engine left behind (children in its group, a daemonized Ray head)
        # would hold its port and GPUs
        if shard.ident is not None:
            await terminate_group(shard.ident.pgid, grace=2.0)
        await self._cleanup(shard)
        self._fail(shard, f"engine {why}")

    async def _adopted_exit(self, shard: Shard) -> None:
        """Wait for an engine that is not our child to end.

        A pidfd becomes readable when any process exits, child or not; the
        identity is checked again after opening it, so a pid recycled in
        between is not waited on. Without pidfds, poll.
        """
        assert shard.ident is not None
        try:
            fd = os.pidfd_open(shard.ident.pid)
        except (OSError, AttributeError):
            while self._running(shard):  # noqa: ASYNC110 (no event to wait on)
                await trio.sleep(WATCH_INTERVAL_S)
            return
        try:
            if is_same_process(shard.ident):
                await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)

    def _running(self, shard: Shard) -> bool:
        if shard.process is not None:
            return shard.process.returncode is None and alive(shard.process.pid)
        return shard.ident is not None and is_same_process(shard.ident)

    # --- adoption -----------------------------------------------------------

    def adopt_all(self) -> None:
        for record in self.records.load_all():
            sid = record.spec.shard_id
            recorded = ProcessIdentity(
                pid=record.pid,
                start_time=record.start_time,
                cmdline=tuple(record.cmdline),
                pgid=record.pgid,
                state="",
            )
            if not is_same_process(recorded):
                log.info(
                    "shard %s from a previous agent is gone (pid %d is not that engine any more); "
                    "forgetting it",
                    sid,
                    record.pid,
                )
                self.records.remove(sid)
                continue
            tail = self._tail(sid)
            tail.skip_to_end()
            shard = Shard(
                spec=record.spec,
                state="starting",
                tail=tail,
                launch=Launch(
                    argv=list(record.cmdline),
                    env={},
                    health_url=record.health_url,
                    metrics_url=record.metrics_url,
                    cleanup=record.cleanup,
                ),
                ident=recorded,
                adopted=True,
                detail=f"adopted pid {record.pid}",
                launched_at=record.launched_at,
            )
            self.shards[sid] = shard
            self.on_event("adopted")
            log.warning(
                "adopted shard %s (pid %d) left running by a previous agent; watching it by "
                "polling. Its earlier output is gone from this agent's memory (what it wrote "
                "is still in %s)",
                sid,
                record.pid,
                record.log_path,
            )
            self._spawn(self._run_adopted, shard)

    async def _check_adopted(self) -> None:
        """One health check of every adopted shard before the first Register, so a
        reconnecting agent reports the engines that serve as ready, not as starting."""
        with trio.move_on_after(3):
            for shard in self.shards.values():
                url = shard.launch.health_url if shard.launch else None
                if shard.adopted and url is not None and await self._healthy(url):
                    shard.state = "ready"
                    shard.detail = f"adopted pid {shard.pid}"

    async def _run_adopted(self, shard: Shard) -> None:
        if shard.state == "ready":
            await self._watch(shard)
            return
        deadline = trio.current_time() + shard.spec.startup_timeout_s
        await self._until_ready(shard, deadline=deadline)
        await self._watch(shard)

    # --- engines nobody can describe ----------------------------------------

    def _port_range_listeners(self) -> set[int]:
        low, high = self.settings.port_range
        return {p for p in listening_ports() if low <= p <= high}

    def _ours(self) -> set[int]:
        pids: set[int] = {os.getpid()}
        for shard in self.shards.values():
            if shard.ident is not None:
                pids.update(group_members(shard.ident.pgid))
                pids.add(shard.ident.pid)
        return pids

    async def kill_unidentified(self, ports: set[int]) -> None:
        """Kill processes that hold a port we assign and that no shard describes."""
        if not ports:
            return
        ours = self._ours()
        for port, pids in sorted(port_holders(ports).items()):
            for pid in sorted(pids - ours):
                who = identity(pid)
                if who is None:
                    continue
                command = " ".join(who.cmdline)[:200]
                log.warning(
                    "killing pid %d (%s): it holds port %d, which this agent assigns to engines, "
                    "and no shard spec describes it",
                    pid,
                    command,
                    port,
                )
                self.on_event("killed")
                await self._kill_process(who)

    async def kill_gpu_holders(self) -> None:
        """Kill processes holding GPU memory that no shard describes: placement hands
        this node's GPUs out, and would hand theirs out again."""
        holders = await gpu_processes(self.settings.nvidia_smi)
        if not holders:
            return
        ours = self._ours()
        for pid, gpu in sorted(holders.items()):
            if pid in ours:
                continue
            who = identity(pid)
            if who is None:
                continue
            log.warning(
                "killing pid %d (%s): it holds memory on GPU %s, which this agent assigns "
                "to engines, and no shard spec describes it",
                pid,
                " ".join(who.cmdline)[:200],
                gpu,
            )
            self.on_event("killed")
            await self._kill_process(who)

    async def _kill_process(self, who: ProcessIdentity) -> None:
        if who.pgid == who.pid and who.pgid != os.getpgrp():
            await terminate_group(who.pid, grace=2.0)
        else:
            try:
                os.kill(who.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # --- stopping -----------------------------------------------------------

    async def _terminate(self, shard: Shard, *, grace: float) -> bool:
        shard.stopping = True
        if shard.ident is None:
            return True
        gone = await terminate_group(shard.ident.pgid, grace=grace)
        if shard.process is not None:
            with trio.move_on_after(5):
                await shard.process.wait()
        await self._cleanup(shard)
        return gone

    async def _cleanup(self, shard: Shard) -> None:
        command = shard.launch.cleanup if shard.launch else None
        if not command:
            return
        with trio.move_on_after(30) as scope:
            try:
                result = await trio.run_process(
                    command, capture_stdout=True, capture_stderr=True, check=False
                )
            except OSError as exc:
                log.warning("shard %s: cleanup %s failed: %s", shard.spec.shard_id, command, exc)
                return
            if result.returncode != 0:
                log.warning(
                    "shard %s: cleanup %s exited %d: %s",
                    shard.spec.shard_id,
                    " ".join(command),
                    result.returncode,
                    result.stderr.decode(errors="replace").strip()[-300:],
                )
        if scope.cancelled_caught:
            log.warning("shard %s: cleanup %s took over 30 s", shard.spec.shard_id, command)

    async def _stop(self, shard: Shard, grace: float) -> None:
        sid = shard.spec.shard_id
        self._set(shard, "stopping", "")
        gone = await self._terminate(shard, grace=grace)
        if not gone:
            self._fail(
                shard,
                f"could not stop: process group {shard.ident and shard.ident.pgid} survived SIGKILL",
            )
            return
        self.records.remove(sid)
        self._set(shard, "stopped", "")
        log.info("shard %s stopped", sid)
        if self.shards.get(sid) is shard:
            del self.shards[sid]

    async def _drain(self, shard: Shard, grace: float) -> None:
        deadline = trio.current_time() + grace
        launch = shard.launch
        while launch is not None and launch.metrics_url and trio.current_time() < deadline:
            if await self._idle(shard, launch.metrics_url):
                break
            await trio.sleep(HEALTH_INTERVAL_S)
        await self._stop(shard, grace=min(10.0, grace))

    async def _idle(self, shard: Shard, url: str) -> bool:
        adapter = adapters().get(shard.spec.engine)
        try:
            response = await self._http.get(url)
        except httpx.HTTPError:
            return True  # nothing answers: nothing in flight to protect
        if adapter is None or response.status_code != 200:
            return True
        load = adapter.parse_metrics(response.text)
        return not load.running and not load.waiting

    # --- plumbing -------------------------------------------------------------

    def _write_record(self, shard: Shard) -> None:
        assert shard.ident is not None and shard.launch is not None
        self.records.write(
            ShardRecord(
                spec=shard.spec,
                pid=shard.ident.pid,
                pgid=shard.ident.pgid,
                start_time=shard.ident.start_time,
                cmdline=list(shard.ident.cmdline),
                log_path=str(shard.tail.path),
                launched_at=shard.launched_at,
                health_url=shard.launch.health_url,
                metrics_url=shard.launch.metrics_url,
                cleanup=shard.launch.cleanup,
            )
        )

    def _settle_identity(self, shard: Shard) -> None:
        """Once ready, record the process as it is now: a launcher script may have
        exec'd the engine (``sh -c "ray start ... && exec vllm serve ..."``), and
        adoption compares command lines."""
        if shard.ident is None or shard.adopted:
            return
        now = identity(shard.ident.pid)
        if now is None or now.start_time != shard.ident.start_time or not now.cmdline:
            return
        if now.cmdline != shard.ident.cmdline:
            shard.ident = attrs.evolve(shard.ident, cmdline=now.cmdline)
            self._write_record(shard)

    def _tail(self, shard_id: str) -> OutputTail:
        return OutputTail(self.records.log_path(shard_id), max_bytes=self.settings.log_max_bytes)

    def _spawn(self, fn: Callable[..., object], *args: object) -> None:
        if self._nursery is None:
            raise RuntimeError("the supervisor is not running")
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    def _set(self, shard: Shard, state: ShardState, detail: str) -> None:
        shard.state = state
        shard.detail = detail
        self._report(shard)

    def _report(self, shard: Shard, tail: list[str] | None = None) -> None:
        self.outbox.put(
            ShardStatus(
                shard_id=shard.spec.shard_id,
                state=shard.state,
                detail=shard.detail,
                output_tail=tail or [],
                pid=shard.pid,
            )
        )

    def _fail(self, shard: Shard, why: str) -> None:
        tail = shard.tail.tail() if shard.launch is not None else []
        shard.state = "failed"
        shard.detail = why
        self.records.remove(shard.spec.shard_id)
        log.warning("shard %s failed: %s", shard.spec.shard_id, why)
        self._report(shard, tail)
        self._failed.add(shard.spec.shard_id)
        if self.shards.get(shard.spec.shard_id) is shard:
            del self.shards[shard.spec.shard_id]

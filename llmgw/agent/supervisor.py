"""The engine supervisor: run each shard through its lifecycle, and report every move.

Theory of operation
-------------------
Each shard runs in tasks of the supervisor's nursery, which belongs to the
agent daemon and outlives any one control-plane session: engines keep
serving while the agent reconnects.

Every phase a shard is in and every move it may make are in
``lifecycle.TRANSITIONS``. The tasks here only observe (the launcher, the
watcher, the drainer, the terminator) or relay commands, and hand what they
saw to ``fire``, which asks the table where the shard goes, reports the move
when the table says so, forgets a shard that reached ``stopped`` or
``failed``, and sets going what the move asks for: ending the process group,
or a drain.

Launch is ``launch``; adoption of engines a previous agent left is
``adoption``; processes nobody can describe are ``strays``, killed only
once the control plane has accepted this agent's registration (``registered``:
an agent it refuses may stand beside the one whose engines those are); engine
log files are bounded by ``logs``.

Readiness is the engine's own health endpoint, bounded by the spec's startup
timeout; a shard with no HTTP endpoint (a Ray worker) is ready once it has
stayed up for a moment. An end nobody asked for is a failure, reported with
the engine's output tail once what it left in its group is gone.

Stop (adopted or not): SIGTERM to the group, SIGKILL after the grace; the
shard is reported ``stopped`` only once no process of its group remains.

Every report is queued in the ``outbox`` for whichever session is up;
``reports()`` describes every shard for ``Register``. Every kill (a stray, a
group that outlived its grace after SIGTERM: ``sigkill_hook``) is logged
and queued in ``kills``, which the stream carries up on its heartbeats so
that the control plane logs it too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import httpx
import trio

from llmgw.agent import health, logs, strays
from llmgw.agent.adoption import adopt_records, adopted_exit, check_adopted, report_unrecorded
from llmgw.agent.busy import BusyPorts
from llmgw.agent.health import HealthSettings
from llmgw.agent.launch import launch
from llmgw.agent.lifecycle import TERMINAL, Event, Move, Phase, expects_exit, move
from llmgw.agent.output import OutputTail
from llmgw.agent.procs import alive, describe_exit, identity, is_same_process, terminate_group
from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.agent.shard import Outbox, Shard
from llmgw.engines import adapters
from llmgw.http.logsafe import printable
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardState, ShardStatus

__all__ = ["Outbox", "Shard", "Supervisor", "SupervisorSettings"]


def engine_auth(shard: Shard) -> dict[str, str]:
    """The header that lets the agent past its engine's key (none when it has none)."""
    key = shard.launch.engine_key if shard.launch else ""
    return {"authorization": f"Bearer {key}"} if key else {}


log = logging.getLogger("llmgw.agent.supervisor")

HEALTH_INTERVAL_S = 0.25
WORKER_SETTLE_S = 1.0  # a shard without HTTP is ready once it stayed up this long
GIVE_UP_GRACE_S = 2.0  # SIGTERM to SIGKILL for an engine not ready in time


@attrs.frozen
class SupervisorSettings:
    state_dir: Path
    port_range: tuple[int, int] = (20000, 20999)
    kill_unidentified: bool = True
    stop_grace_s: float = 10.0
    log_max_bytes: int = 64 << 20
    stopped_log_keep_s: float = 72 * 3600.0
    stopped_logs_max_bytes: int = 1 << 30
    nvidia_smi: str = "nvidia-smi"
    health: HealthSettings = attrs.Factory(HealthSettings)  # checks of engines once ready
    # where engines listen: "auto" (the address this node reaches the control plane
    # from), or an address ("0.0.0.0": every interface)
    engine_bind: str = "auto"


def stop_grace(spec: ShardSpec, settings: SupervisorSettings, asked: float | None = None) -> float:
    """SIGTERM to SIGKILL for a shard: what the stop asked for, else its profile's (in
    its spec), else this agent's ``[engines] stop_grace_s``."""
    if asked is not None:
        return asked
    return spec.stop_grace_s if spec.stop_grace_s is not None else settings.stop_grace_s


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
        self.kills = strays.KillReports()  # what this agent killed, until reported
        self.on_event = on_event or (lambda _: None)
        self._nursery: trio.Nursery | None = None
        self._failed: set[str] = set()
        self._unhealthy: set[str] = set()  # ready shards whose engine stopped answering
        self._http = httpx.AsyncClient(timeout=2.0)
        # set by the stream on the first RegisterAck: until the control plane has
        # accepted this agent as this node, it kills nothing (it may be an impostor,
        # or a second agent beside the one whose engines hold these ports)
        self.registered = trio.Event()
        # the local address of the stream's connection to the control plane (set by
        # the stream as it connects): where engines listen when their bind is "auto"
        self.stream_address = ""
        # the engine ports held by what no shard describes, for the inventory
        self.busy_ports = BusyPorts(
            settings.port_range,
            settings.state_dir,
            lambda: {s.spec.port for s in self.shards.values()},
            lambda: strays.ours(self.shards.values()),
        )

    # --- the daemon side --------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt what a previous agent left, then serve; once the control plane has
        accepted the registration, kill what nobody can describe."""
        async with self._http, trio.open_nursery() as nursery:
            self._nursery = nursery
            adopted = self.adopt_all()
            # before their watchers start, so the check alone decides which serve
            await check_adopted(
                adopted,
                self._healthy,
                lambda shard: self.fire(shard, Event.HEALTHY, f"adopted pid {shard.pid}"),
                settle_s=WORKER_SETTLE_S,
            )
            for shard in adopted:
                self._spawn(self._run_adopted, shard)
            nursery.start_soon(self._mind_logs)
            task_status.started()
            if self.settings.kill_unidentified:
                await self.registered.wait()
                await self.kill_unidentified(strays.port_range_listeners(self.settings.port_range))
                await self.kill_gpu_holders()
            await trio.sleep_forever()

    def bind_address(self, spec: ShardSpec) -> str:
        """Where the shard's engine listens: the configured address, or with "auto"
        this node's address on the route to the control plane (the spec's host until
        the stream has connected)."""
        bind = self.settings.engine_bind
        if bind == "auto":
            return self.stream_address or spec.host
        return bind

    def reports(self) -> list[ShardReport]:
        return [
            ShardReport(
                spec=s.spec,
                state=s.state,
                pid=s.pid,
                detail=s.detail,
                healthy=s.shard_id not in self._unhealthy,
                engine_key=s.launch.engine_key if s.launch else "",
            )
            for s in self.shards.values()
            if s.phase not in TERMINAL
        ]

    def start(self, spec: ShardSpec) -> None:
        existing = self.shards.get(spec.shard_id)
        if existing is not None:
            log.info(
                "shard %s is already %s; ignoring a second start", spec.shard_id, existing.state
            )
            self.fire(existing, Event.START)
            return
        if spec.shard_id in self._failed:
            self.on_event("restarted")
        shard = Shard(spec=spec, tail=self._tail(spec.shard_id))
        self.shards[spec.shard_id] = shard
        self._spawn(self._run_new, shard)

    def stop(self, shard_id: str, grace: float | None = None) -> None:
        """``grace`` None: the shard's own (``stop_grace``)."""
        shard = self.shards.get(shard_id)
        if shard is None:
            self._not_here(shard_id)
            return
        self.fire(shard, Event.STOP, "", grace=stop_grace(shard.spec, self.settings, grace))

    def drain(self, shard_id: str, grace: float) -> None:
        """Stop taking work, then stop. The router stops routing to a draining shard at once;
        the engine finishes what it has in flight within the grace."""
        shard = self.shards.get(shard_id)
        if shard is None:
            self._not_here(shard_id)
            return
        self.fire(shard, Event.DRAIN, "draining: finishing in-flight requests", grace=grace)

    def _not_here(self, shard_id: str) -> None:
        self.outbox.put(
            ShardStatus(shard_id=shard_id, state=ShardState.STOPPED, detail="not running here")
        )

    # --- every move goes through here ---------------------------------------

    def fire(
        self, shard: Shard, event: Event, detail: str | None = None, *, grace: float = 0.0
    ) -> Move:
        """Move ``shard`` on ``event`` as the lifecycle table says, and act on the move.

        ``detail`` goes with the report of a move (None: keep the current one; a
        report that only says the state again keeps it too); ``grace`` is for
        the process group's end or the drain the move starts.
        """
        before = shard.phase
        m = move(before, event, shard.shard_id)
        shard.phase = m.to
        if m.report and not m.again and detail is not None:
            shard.detail = detail
        if m.to in TERMINAL and before not in TERMINAL:
            self._forget(shard)
        if m.report:
            tail = shard.tail.tail() if m.to is Phase.FAILED and shard.launch else []
            self.outbox.put(
                ShardStatus(
                    shard_id=shard.shard_id,
                    state=shard.state,
                    detail=shard.detail,
                    output_tail=tail,
                    pid=shard.pid,
                    engine_key=shard.launch.engine_key if shard.launch else "",
                )
            )
        if m.end_process:
            self._spawn(self._end, shard, grace)
        if m.drain:
            self._spawn(self._drain, shard, grace)
        return m

    def _forget(self, shard: Shard) -> None:
        sid = shard.shard_id
        self.records.remove(sid)
        if shard.phase is Phase.FAILED:
            log.warning("shard %s failed: %s", sid, shard.detail)
            self._failed.add(sid)
        else:
            log.info("shard %s stopped", sid)
        if self.shards.get(sid) is shard:
            del self.shards[sid]

    # --- a shard's tasks ------------------------------------------------------

    async def _run_new(self, shard: Shard) -> None:
        if await launch(self, shard):
            await self._until_ready(
                shard, deadline=trio.current_time() + shard.spec.startup_timeout_s
            )
            await self._watch(shard)

    async def _run_adopted(self, shard: Shard) -> None:
        if shard.phase is Phase.STARTING:
            deadline = trio.current_time() + shard.spec.startup_timeout_s
            await self._until_ready(shard, deadline=deadline)
        await self._watch(shard)

    async def _until_ready(self, shard: Shard, *, deadline: float) -> None:
        launch = shard.launch
        assert launch is not None
        settled = trio.current_time() + WORKER_SETTLE_S
        while shard.phase is Phase.STARTING:
            if not self._running(shard):
                return  # _watch reports how it ended
            if launch.health_url is None:
                healthy = trio.current_time() >= settled
            else:
                healthy = await self._healthy(launch.health_url)
            if healthy:
                if shard.phase is Phase.STARTING:
                    self._settle_identity(shard)
                if self.fire(shard, Event.HEALTHY, "").to is Phase.READY:
                    log.info("shard %s is ready", shard.shard_id)
                return
            if trio.current_time() >= deadline:
                timeout = shard.spec.startup_timeout_s
                log.warning("shard %s: not ready within %g s; stopping it", shard.shard_id, timeout)
                shard.ending_why = f"not ready within the startup timeout of {timeout:g} s"
                self.fire(shard, Event.TIMED_OUT, grace=GIVE_UP_GRACE_S)
                return
            await trio.sleep(HEALTH_INTERVAL_S)

    async def engine_metrics(self, shard_id: str) -> bytes | None:
        """A Ready engine's own /metrics, fetched with its key (Prometheus cannot send a
        key per target); None when there is no such engine here or it did not answer."""
        shard = self.shards.get(shard_id)
        launch = shard.launch if shard is not None else None
        if shard is None or launch is None or not launch.metrics_url:
            return None
        if shard.phase is not Phase.READY:
            return None
        try:
            response = await self._http.get(launch.metrics_url, headers=engine_auth(shard))
        except httpx.HTTPError:
            return None
        return response.content if response.status_code == 200 else None

    async def _healthy(self, url: str) -> bool:
        try:
            response = await self._http.get(url)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _watch(self, shard: Shard) -> None:
        """Until the engine ends; an end nobody asked for is a failure, with its output."""
        if shard.phase in TERMINAL:
            return
        if shard.phase is Phase.READY and shard.launch and shard.launch.health_url:
            self._spawn(self._check_health, shard, shard.launch.health_url)
        if shard.process is not None:
            why = describe_exit(await shard.process.wait())
        else:
            code = await adopted_exit(shard)
            why = (
                describe_exit(code)
                if code is not None
                else "exited (adopted: its exit status could not be read)"
            )
        if expects_exit(shard.phase):
            return
        # what the engine left behind (children in its group, a daemonized Ray head)
        # would hold its port and GPUs
        if shard.ident is not None:
            await terminate_group(
                shard.ident.pgid,
                grace=2.0,
                on_sigkill=self.sigkill_hook(
                    shard, 2.0, "left running by its engine, which exited;"
                ),
            )
        await self._cleanup(shard)
        self.fire(shard, Event.EXITED, f"engine {why}")

    async def _check_health(self, shard: Shard, url: str) -> None:
        """While it is ready: is its engine still answering? Each change is reported."""
        sid = shard.shard_id

        def changed(healthy: bool, why: str) -> None:
            if healthy:
                self._unhealthy.discard(sid)
                log.info("shard %s %s", sid, why)
            else:
                self._unhealthy.add(sid)
                log.warning("shard %s is unhealthy: %s", sid, why)
            self.on_event("recovered" if healthy else "unhealthy")
            self.outbox.put(
                ShardStatus(
                    shard_id=sid,
                    state=shard.state,
                    detail=why,
                    pid=shard.pid,
                    healthy=healthy,
                    engine_key=shard.launch.engine_key if shard.launch else "",
                )
            )

        try:
            await health.watch(
                lambda: self._healthy(url),
                lambda: shard.phase is Phase.READY and self.shards.get(sid) is shard,
                self.settings.health,
                changed,
            )
        finally:
            self._unhealthy.discard(sid)

    def _running(self, shard: Shard) -> bool:
        if shard.process is not None:
            return shard.process.returncode is None and alive(shard.process.pid)
        return shard.ident is not None and is_same_process(shard.ident)

    async def _end(self, shard: Shard, grace: float) -> None:
        """End the shard's process group (the terminator), then say how that went."""
        gone = True
        if shard.ident is not None:
            gone = await terminate_group(
                shard.ident.pgid, grace=grace, on_sigkill=self.sigkill_hook(shard, grace)
            )
            if shard.process is not None:
                with trio.move_on_after(5):
                    await shard.process.wait()
            await self._cleanup(shard)
        if shard.phase is Phase.GIVING_UP:
            self.fire(shard, Event.GONE if gone else Event.SURVIVED, shard.ending_why)
        elif gone:
            self.fire(shard, Event.GONE, "")
        else:
            pgid = shard.ident.pgid if shard.ident else None
            self.fire(
                shard, Event.SURVIVED, f"could not stop: process group {pgid} survived SIGKILL"
            )

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
                log.warning("shard %s: cleanup %s failed: %s", shard.shard_id, command, exc)
                return
            if result.returncode != 0:
                log.warning(
                    "shard %s: cleanup %s exited %d: %s",
                    shard.shard_id,
                    " ".join(command),
                    result.returncode,
                    result.stderr.decode(errors="replace").strip()[-300:],
                )
        if scope.cancelled_caught:
            log.warning("shard %s: cleanup %s took over 30 s", shard.shard_id, command)

    async def _drain(self, shard: Shard, grace: float) -> None:
        """Until nothing is in flight or the grace is over (the drainer)."""
        deadline = trio.current_time() + grace
        launch = shard.launch
        while (
            shard.phase is Phase.DRAINING
            and launch is not None
            and launch.metrics_url
            and trio.current_time() < deadline
        ):
            if await self._idle(shard, launch.metrics_url):
                break
            await trio.sleep(HEALTH_INTERVAL_S)
        self.fire(shard, Event.DRAINED, "", grace=min(stop_grace(shard.spec, self.settings), grace))

    async def _idle(self, shard: Shard, url: str) -> bool:
        adapter = adapters().get(shard.spec.engine)
        try:
            response = await self._http.get(url, headers=engine_auth(shard))
        except httpx.HTTPError:
            return True  # nothing answers: nothing in flight to protect
        if adapter is None or response.status_code != 200:
            return True
        load = adapter.parse_metrics(response.text)
        return not load.running and not load.waiting

    def sigkill_hook(
        self, shard: Shard, grace: float, how: str = ""
    ) -> Callable[[Sequence[int]], None]:
        """For ``terminate_group``: when the shard's group outlived ``grace`` s after
        SIGTERM, log the SIGKILL and report it (``how``: what is left, when not the engine)."""

        def overdue(members: Sequence[int]) -> None:
            ident = shard.ident
            pid = ident.pid if ident is not None and ident.pid in members else min(members)
            who = identity(pid)
            cmdline = who.cmdline if who is not None and who.cmdline else ()
            if not cmdline and ident is not None and pid == ident.pid:
                cmdline = ident.cmdline
            others = f" (and {len(members) - 1} more of its group)" if len(members) > 1 else ""
            reason = " ".join(filter(None, [how, f"did not stop {grace:g} s after SIGTERM"]))
            log.warning(
                "shard %s: pid %d (%s)%s %s; sending SIGKILL",
                shard.shard_id,
                pid,
                printable(strays.short_command(cmdline)),
                others,
                reason,
            )
            self.on_event("killed_after_grace")
            self.kills.put(
                strays.kill_report(pid, cmdline, reason + others, "stop_timeout", shard.shard_id)
            )

        return overdue

    # --- adoption and strays ----------------------------------------------------

    def adopt_all(self) -> list[Shard]:
        """Take over every engine a previous agent left (their watchers are started after)."""
        state_dir = self.settings.state_dir
        adopted = adopt_records(self.records, self._tail, state_dir)
        for shard in adopted:
            self.shards[shard.shard_id] = shard
            self.write_record(shard)  # whole again, where it was read from its previous copy
            self.on_event("adopted")
        report_unrecorded(adopted, state_dir)
        return adopted

    async def kill_unidentified(self, ports: set[int]) -> None:
        """Kill processes that hold a port we assign and that no shard describes."""
        await strays.kill_unidentified(
            ports,
            strays.ours(self.shards.values()),
            self.on_event,
            self.settings.state_dir,
            self.kills.put,
        )

    async def kill_gpu_holders(self) -> None:
        """Kill processes holding GPU memory that no shard describes."""
        await strays.kill_gpu_holders(
            self.settings.nvidia_smi,
            lambda: strays.ours(self.shards.values()),
            self.on_event,
            self.settings.state_dir,
            self.kills.put,
        )

    # --- plumbing -------------------------------------------------------------

    def write_record(self, shard: Shard) -> None:
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
                engine_key=shard.launch.engine_key,
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
            self.write_record(shard)

    def _tail(self, shard_id: str) -> OutputTail:
        return OutputTail(self.records.log_path(shard_id))

    async def _mind_logs(self) -> None:
        """Bound the running engines' logs; sweep those of shards that no longer run."""
        s = self.settings
        await logs.mind(
            lambda: [sh.tail.path for sh in self.shards.values() if sh.ident is not None],
            lambda: set(self.shards) | self.records.shard_ids(),
            self.records.dir,
            max_bytes=s.log_max_bytes,
            keep_s=s.stopped_log_keep_s,
            keep_bytes=s.stopped_logs_max_bytes,
        )

    def _spawn(self, fn: Callable[..., object], *args: object) -> None:
        if self._nursery is None:
            raise RuntimeError("the supervisor is not running")
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

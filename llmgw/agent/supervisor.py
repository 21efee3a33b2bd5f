"""The engine supervisor: run each shard through its lifecycle, and report every move.

Theory of operation
-------------------
Each shard runs in tasks of the supervisor's nursery, which belongs to the
agent daemon and outlives any one control-plane session: engines keep
serving while the agent reconnects.

Every phase a shard is in and every move it may make are in
``lifecycle.TRANSITIONS``. The tasks (``launch``; the watcher, the drainer,
the sleeper, the waker and the terminator of ``runner``) only observe, and
the control plane's commands arrive here; both hand what they saw to
``fire``, which asks the table where the shard goes, reports the move when
the table says so, forgets a shard that reached ``stopped`` or ``failed``,
and sets going what the move asks for: ending the process group, a drain,
the engine's sleep or its wake. The tasks reach the supervisor only through
``context.ShardContext``, which it is.

Adoption of engines a previous agent left is ``adoption``; processes nobody
can describe are ``strays``, killed only once the control plane has accepted
this agent's registration (``registered``: an agent it refuses may stand
beside the one whose engines those are); engine log files are bounded by
``logs``.

Every report is queued in the ``outbox`` for whichever session is up;
``reports()`` describes every shard for ``Register``. Every kill (a stray, a
group that outlived its grace after SIGTERM: ``sigkill_hook``) is logged
and queued in ``kills``, which the stream carries up on its heartbeats so
that the control plane logs it too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import httpx
import trio

from llmgw.agent import logs, runner, strays
from llmgw.agent.adoption import adopt_records, check_adopted, report_unrecorded
from llmgw.agent.busy import BusyPorts
from llmgw.agent.context import SupervisorSettings, stop_grace
from llmgw.agent.discovery.weights import DEFAULT_WEIGHTS_DIR
from llmgw.agent.lifecycle import TERMINAL, Event, Move, Phase, move
from llmgw.agent.output import OutputTail
from llmgw.agent.procs import identity
from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.agent.runner import engine_auth, healthy
from llmgw.agent.shard import Outbox, Shard
from llmgw.agent.weights import Fetcher
from llmgw.http.logsafe import printable
from llmgw.protocol.exits import exit_fields
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardState, ShardStatus

__all__ = ["Outbox", "Shard", "Supervisor", "SupervisorSettings", "stop_grace"]

log = logging.getLogger("llmgw.agent.supervisor")


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
        # brings shards' weights to the node (the daemon sets its own, with metrics)
        self.fetcher = Fetcher(DEFAULT_WEIGHTS_DIR)
        self.on_event = on_event or (lambda _: None)
        self._nursery: trio.Nursery | None = None
        self._failed: set[str] = set()
        self.http = httpx.AsyncClient(timeout=2.0)
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
        async with self.http, trio.open_nursery() as nursery:
            self._nursery = nursery
            adopted = self.adopt_all()
            # before their watchers start, so the check alone decides which serve
            await check_adopted(
                adopted,
                lambda url: healthy(self.http, url),
                lambda shard: self.fire(shard, Event.HEALTHY, f"adopted pid {shard.pid}"),
                settle_s=runner.WORKER_SETTLE_S,
                asleep=lambda shard: runner.asleep(self.http, shard),
                sleeping=self._adopted_asleep,
            )
            for shard in adopted:
                self.spawn(runner.run_adopted, self, shard)
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
                healthy=s.healthy,
                engine_key=s.launch.engine_key if s.launch else "",
                fetching=s.fetching,
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
        self.spawn(runner.run_new, self, shard)

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

    def sleep(self, shard_id: str, grace: float) -> None:
        """Stop taking work and finish what is in flight (within ``grace``), then the
        engine sleeps: its process stays, its GPU memory is freed. One that cannot is
        stopped instead. Anywhere but ready this changes nothing, and says so."""
        shard = self.shards.get(shard_id)
        if shard is None:
            self._not_here(shard_id)
            return
        detail = "draining: finishing in-flight requests, then it sleeps"
        if self.fire(shard, Event.SLEEP, detail, grace=grace).again:
            log.info("shard %s is %s; a sleep changes nothing", shard_id, shard.state)
        else:
            log.info("shard %s: draining within %g s, then it sleeps", shard_id, grace)

    def wake(self, shard_id: str) -> None:
        """A sleeping engine wakes: the shard is starting until it answers its health
        check. Anywhere but sleeping this changes nothing, and says so."""
        shard = self.shards.get(shard_id)
        if shard is None:
            self._not_here(shard_id)
            return
        if self.fire(shard, Event.WAKE, "waking").again:
            log.info("shard %s is %s; a wake changes nothing", shard_id, shard.state)
        else:
            log.info("shard %s: waking its engine", shard_id)

    def _adopted_asleep(self, shard: Shard) -> None:
        if self.fire(shard, Event.SLEPT, f"adopted pid {shard.pid}, asleep").to is Phase.SLEEPING:
            log.info("shard %s (adopted pid %s) is asleep", shard.shard_id, shard.pid)

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
        if m.to is not Phase.STARTING and shard.fetch_scope is not None:
            shard.fetch_scope.cancel()  # its weights are no longer wanted (kept for the next)
        if m.report and not m.again and detail is not None:
            shard.detail = detail
        if m.to in TERMINAL and before not in TERMINAL:
            self._forget(shard)
        if m.report:
            failed = m.to is Phase.FAILED
            exit_code, signal = exit_fields(shard.returncode if failed else None)
            self.outbox.put(
                ShardStatus(
                    shard_id=shard.shard_id,
                    state=shard.state,
                    detail=shard.detail,
                    output_tail=shard.tail.tail() if failed and shard.launch else [],
                    pid=shard.pid,
                    engine_key=shard.launch.engine_key if shard.launch else "",
                    exit_code=exit_code,
                    signal=signal,
                )
            )
        if m.end_process:
            self.spawn(runner.end, self, shard, grace)
        if m.drain:
            self.spawn(runner.drain, self, shard, grace)
        if m.sleep:
            self.spawn(runner.fall_asleep, self, shard)
        if m.wake:
            self.spawn(runner.wake, self, shard)
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
            response = await self.http.get(launch.metrics_url, headers=engine_auth(shard))
        except httpx.HTTPError:
            return None
        return response.content if response.status_code == 200 else None

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
                sleep_url=shard.launch.sleep_url,
                wake_url=shard.launch.wake_url,
                sleeping_url=shard.launch.sleeping_url,
            )
        )

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

    def holds(self, shard: Shard) -> bool:
        return self.shards.get(shard.shard_id) is shard

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        if self._nursery is None:
            raise RuntimeError("the supervisor is not running")
        self._nursery.start_soon(fn, *args)

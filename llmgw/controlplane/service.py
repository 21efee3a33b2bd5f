"""The control plane's core: what happens when agents register, heartbeat and go.

The stream listener calls these methods synchronously (no awaits inside), so
the node table never sees a half-applied update. Placement and reconciliation
are not here: the fleet manager subscribes to ``on_register`` and
``on_shard_status``, which are called under the same rule, and sends its
commands through the ``dispatcher``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import trio

from llmgw.controlplane.changes import Bell
from llmgw.controlplane.dispatcher import AgentConnection, Dispatcher
from llmgw.controlplane.metrics import ControlPlaneMetrics
from llmgw.controlplane.nodes import Change, LivenessPolicy, NodeTable
from llmgw.controlplane.takeover import LiveStream, close_reason, refusal
from llmgw.http.logsafe import printable
from llmgw.protocol.errors import NodeTaken
from llmgw.protocol.messages import (
    Heartbeat,
    ProcessKill,
    Register,
    RegisterAck,
    ShardState,
    ShardStatus,
)
from llmgw.version import describe

log = logging.getLogger("llmgw.controlplane")

KILL_KINDS = frozenset({"stray", "stop_timeout"})  # any other kind is counted as "other"


class ControlPlane:
    def __init__(
        self,
        *,
        policy: LivenessPolicy,
        heartbeat_interval: float,
        metrics: ControlPlaneMetrics | None = None,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.heartbeat_interval = heartbeat_interval
        self.metrics = metrics or ControlPlaneMetrics()
        self.nodes = NodeTable(policy)
        self.changes = Bell()  # rung on every change an operator sees (``changes``)
        self.dispatcher = Dispatcher(self.metrics)
        self.metrics.watch_nodes(self.nodes.counts)
        self._clock = clock
        self._wall = wall
        self._generations = itertools.count(1)
        # what else wants to hear from the fleet (the reconciler, tests): called under no await
        self.on_register: list[Callable[[str, Register], None]] = []
        self.on_shard_status: list[Callable[[str, ShardStatus], None]] = []

    def new_generation(self) -> int:
        return next(self._generations)

    def registered(self, conn: AgentConnection, msg: Register) -> RegisterAck:
        """Accept a registration, or refuse it (``NodeTaken``) when another agent holds the
        node's stream live: a second agent for one node is refused, not let take over."""
        if msg.check_only:
            return self.checked(conn, msg)
        current = self._live_stream(msg.node_id)
        why = refusal(msg.node_id, current, msg.agent_instance, self.policy.unreachable_after)
        if why is not None and current is not None:
            raise NodeTaken(
                f"{why}: a second agent for one node (a copied certificate, or a second agent"
                " on its host) is refused; stop it",
                close_reason(msg.node_id, current),
            )
        conn.instance = msg.agent_instance
        changes, news = self.nodes.register(
            msg.node_id,
            msg.inventory,
            peer=conn.peer,
            connection=conn.generation,
            now=self._clock(),
            wall=self._wall(),
        )
        self.nodes.nodes[msg.node_id].agent_version = msg.agent_version
        self.nodes.nodes[msg.node_id].metrics_address = msg.metrics_address
        self.nodes.nodes[msg.node_id].can = frozenset(msg.can)
        self.dispatcher.attach(conn)
        self.metrics.connects.inc()
        inv = msg.inventory
        log.info(
            "node %s registered from %s (agent %s, %d GPUs, %d shards running)",
            msg.node_id,
            conn.peer,
            msg.agent_version or "?",
            len(inv.gpus),
            len(msg.shards),
        )
        self._report(changes, news, msg.node_id)
        self.changes.ring("nodes")  # its version, its connection
        for listener in self.on_register:
            listener(msg.node_id, msg)
        return RegisterAck(
            node_id=msg.node_id,
            heartbeat_interval_s=self.heartbeat_interval,
            server_version=describe(),
        )

    def _live_stream(self, node_id: str) -> LiveStream | None:
        conn = self.dispatcher.connections.get(node_id)
        node = self.nodes.nodes.get(node_id)
        if conn is None or node is None or not node.connected:
            return None
        if node.connection != conn.generation:
            return None
        return LiveStream(conn.peer, conn.instance, self._clock() - node.last_seen)

    def checked(self, conn: AgentConnection, msg: Register) -> RegisterAck:
        """A preflight (``llmgw agent --check``): its identity was proved by the session;
        ack it and touch nothing, so the node's running agent keeps its stream and state."""
        log.info(
            "node %s passed a check from %s (agent %s); its registration would be accepted",
            msg.node_id,
            conn.peer,
            msg.agent_version or "?",
        )
        return RegisterAck(
            node_id=msg.node_id,
            heartbeat_interval_s=self.heartbeat_interval,
            server_version=describe(),
        )

    def heartbeat(self, conn: AgentConnection, hb: Heartbeat) -> None:
        wall = self._wall()
        self.metrics.heartbeat_delay.observe(max(0.0, wall - hb.sent_at))
        changes, news = self.nodes.heartbeat(
            conn.node_id, conn.generation, hb, now=self._clock(), wall=wall
        )
        self._report(changes, news, conn.node_id)
        for kill in hb.kills:
            self.process_killed(conn.node_id, kill)

    def process_killed(self, node_id: str, kill: ProcessKill) -> None:
        """A node killed a process (a stray, an engine past its stop grace): one line,
        in the node's words escaped, and a count by kind."""
        shard = f" of shard {printable(kill.shard_id)}" if kill.shard_id else ""
        log.warning(
            "node %s killed pid %d%s (%s): %s",
            node_id,
            kill.pid,
            shard,
            printable(kill.command) or "command unknown",
            printable(kill.reason),
        )
        kind = kill.kind if kill.kind in KILL_KINDS else "other"
        self.metrics.agent_kills.labels(node_id, kind).inc()

    def shard_status(self, conn: AgentConnection, status: ShardStatus) -> None:
        if status.state == ShardState.FAILED:
            # one line, in the agent's words escaped; the engine's own output is kept
            # with the failure, for ``ctl replicas --failures``, never in this log
            log.warning(
                "node %s: shard %s failed: %s",
                conn.node_id,
                printable(status.shard_id),
                printable(status.detail) or "no reason given",
            )
        else:
            # a fetch's progress comes every few seconds, the same state each time
            log.log(
                logging.DEBUG if status.fetching is not None else logging.INFO,
                "node %s: shard %s is %s",
                conn.node_id,
                printable(status.shard_id),
                status.state,
            )
        for listener in self.on_shard_status:
            listener(conn.node_id, status)

    def disconnected(self, conn: AgentConnection) -> None:
        self.dispatcher.detach(conn)
        changes = self.nodes.disconnected(conn.node_id, conn.generation, now=self._clock())
        self._report(changes, [], conn.node_id)

    def sweep(self) -> None:
        self._report(self.nodes.sweep(self._clock()), [], None)

    async def run_liveness(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Move silent nodes along, checking often enough to be late by a small fraction."""
        tick = min(0.25, self.policy.unreachable_after / 10)
        task_status.started()
        while True:
            await trio.sleep(tick)
            self.sweep()

    def _report(self, changes: list[Change], news: list[str], node_id: str | None) -> None:
        if changes or news:
            self.changes.ring("nodes")
        for c in changes:
            self.metrics.liveness_changes.labels(c.new.value).inc()
            if c.old is not None:
                level = logging.INFO if c.new.value == "Ready" else logging.WARNING
                log.log(level, "node %s is %s (was %s): %s", c.node_id, c.new, c.old, c.why)
        for line in news:
            log.info("node %s %s", node_id, line)

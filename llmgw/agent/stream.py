"""The agent's outbound stream: dial, register, heartbeat, obey; reconnect forever.

Theory of operation
-------------------
``run`` loops forever over the control plane's addresses. Each attempt is
one *session*: TCP connect, TLS handshake (bounded; a refused certificate
surfaces here or at the first read), WebSocket upgrade with our subprotocol,
``Register``, wait for ``RegisterAck``, then heartbeat and obey commands until
the stream ends. A session lives in its own nursery, so ending it, for any
reason, ends every task of it.

Every attempt that fails is logged once, with the reason the control plane
gave when it gave one (a close code and reason, or the upgrade's refusal
body); a refusal is never reported as a clean close. The backoff is reset
only when a registration was accepted, so an agent the control plane keeps
refusing backs off to the ceiling instead of hammering it.

The read side blocks until the control plane sends something, which may be
never; a WebSocket ping with a deadline on every heartbeat bounds how long a
dead peer goes unnoticed. Cancellation (SIGTERM) unblocks every wait at once;
the stream is then closed with 1001 under a short shielded deadline.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Sequence

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from llmgw import __version__
from llmgw.addr import join_hostport
from llmgw.agent.backoff import Backoff
from llmgw.agent.inventory import InventorySource, same_inventory
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.supervisor import Supervisor
from llmgw.protocol import SUBPROTOCOL, CloseCode, ProtocolError, Role, Session
from llmgw.protocol.messages import (
    DrainShard,
    Heartbeat,
    Inventory,
    Register,
    RegisterAck,
    ShardReport,
    StartShard,
    StopShard,
)
from llmgw.wsio import close_quietly, close_ws, single_error, split_cancelled

log = logging.getLogger("llmgw.agent")


@attrs.frozen
class StreamSettings:
    node_id: str
    control_plane: Sequence[tuple[str, int]]
    ssl_context: ssl.SSLContext
    connect_timeout: float = 10.0
    handshake_timeout: float = 10.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    max_message_bytes: int = 1024 * 1024


class AgentStream:
    def __init__(
        self,
        settings: StreamSettings,
        source: InventorySource,
        supervisor: Supervisor,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.source = source
        self.supervisor = supervisor
        self.metrics = metrics
        self.backoff = Backoff(settings.backoff_initial, settings.backoff_max)
        self.sessions_started = 0
        self.registrations = 0

    async def run(self) -> None:
        """Connect, and reconnect forever; returns only by cancellation."""
        addresses = list(self.settings.control_plane)
        i = 0
        while True:
            host, port = addresses[i % len(addresses)]
            i += 1
            registered = await self.session(host, port)
            if registered:
                self.backoff.reset()
            delay = self.backoff.next_delay()
            log.info("reconnecting in %.2f s (attempt %d)", delay, self.backoff.attempt)
            await trio.sleep(delay)

    async def session(self, host: str, port: int) -> bool:
        """One attempt; True when the control plane accepted the registration.

        Whatever ends the attempt is logged once, in words, and never escapes:
        an agent must outlive every failure of its stream.
        """
        self.sessions_started += 1
        if self.sessions_started > 1 and self.metrics is not None:
            self.metrics.reconnects.inc()
        where = join_hostport(host, port)
        state = _Attempt()
        try:
            await self._session(host, port, where, state)
        except BaseException as exc:
            failure, cancelled = split_cancelled(exc)
            if failure is not None:
                if not isinstance(failure, Exception | BaseExceptionGroup):
                    raise  # KeyboardInterrupt and friends are not stream failures
                self._log_failure(where, state, _most_telling(failure))
            if cancelled is not None:
                raise cancelled from None
        return state.registered

    def _log_failure(self, where: str, state: _Attempt, exc: BaseException) -> None:
        if isinstance(exc, ConnectionClosed):
            self._log_closed(where, exc, state)
        elif isinstance(exc, ConnectionRejected):
            body = (exc.body or b"").decode(errors="replace").strip()
            log.error(
                "control plane %s refused the stream (HTTP %s): %s", where, exc.status_code, body
            )
        elif isinstance(exc, HandshakeError):
            log.error("WebSocket handshake with %s failed: %s", where, exc)
        elif isinstance(exc, trio.TooSlowError) and state.stage == "WebSocket upgrade":
            # TLS 1.3 finishes the client's handshake before the server checks the
            # client certificate, and the server's alert does not reach us
            log.error(
                "control plane %s completed TLS but never answered the WebSocket upgrade: "
                "it most likely refused this agent's certificate (expired, from another "
                "CA, or none); the control plane's log names the reason",
                where,
            )
        elif isinstance(exc, trio.TooSlowError):
            log.error("control plane %s did not answer in time (during %s)", where, state.stage)
        elif isinstance(exc, ssl.SSLCertVerificationError):
            log.error("control plane %s certificate rejected: %s", where, exc.verify_message or exc)
        elif isinstance(exc, ssl.SSLError):
            log.error("TLS with %s failed during %s: %s", where, state.stage, _ssl_reason(exc))
        elif isinstance(exc, trio.BrokenResourceError):
            cause = exc.__cause__
            reason = _ssl_reason(cause) if isinstance(cause, ssl.SSLError) else str(cause or exc)
            log.error("stream to %s broke during %s: %s", where, state.stage, reason)
        elif isinstance(exc, OSError):
            log.error("cannot connect to control plane %s: %s", where, exc.strerror or exc)
        elif isinstance(exc, ProtocolError):
            log.error("protocol error with control plane %s: %s", where, exc.reason)
        else:
            log.error(
                "stream to %s failed during %s", where, state.stage, exc_info=(type(exc), exc, None)
            )

    async def _session(self, host: str, port: int, where: str, state: _Attempt) -> None:
        s = self.settings
        state.stage = "connect"
        with trio.fail_after(s.connect_timeout):
            tcp = await trio.open_tcp_stream(host, port)
        tls = trio.SSLStream(tcp, s.ssl_context, server_hostname=host)
        try:
            state.stage = "TLS handshake"
            with trio.fail_after(s.handshake_timeout):
                await tls.do_handshake()
            with single_error():
                async with trio.open_nursery() as nursery:
                    state.stage = "WebSocket upgrade"
                    with trio.fail_after(s.handshake_timeout):
                        ws = await wrap_client_stream(
                            nursery,
                            tls,
                            host,
                            "/agent",
                            subprotocols=[SUBPROTOCOL],
                            max_message_size=s.max_message_bytes,
                        )
                    try:
                        await self._registered_session(ws, where, state)
                    finally:
                        await close_ws(ws, CloseCode.GOING_AWAY, "agent shutting down")
                    nursery.cancel_scope.cancel()
        finally:
            await close_quietly(tls)

    async def _registered_session(
        self, ws: WebSocketConnection, where: str, state: _Attempt
    ) -> None:
        s = self.settings
        session = Session(Role.AGENT, max_message_bytes=s.max_message_bytes)
        inventory = self.source.inventory()
        state.stage = "registration"
        register = Register(
            node_id=s.node_id,
            inventory=inventory,
            shards=self.running_shards(),
            agent_version=__version__,
        )
        await ws.send_message(session.send(register))
        with trio.fail_after(s.handshake_timeout):
            ack = session.receive(await ws.get_message())
        assert isinstance(ack, RegisterAck)
        state.registered = True
        state.stage = "session"
        self.registrations += 1
        self.supervisor.registered.set()
        log.info(
            "registered with control plane %s as node %s; heartbeat every %g s",
            where,
            s.node_id,
            ack.heartbeat_interval_s,
        )
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    self._heartbeats, ws, session, ack.heartbeat_interval_s, inventory
                )
                nursery.start_soon(self._statuses, ws, session, self.supervisor)
                while True:
                    self.handle_command(session.receive(await ws.get_message()))

    async def _heartbeats(
        self, ws: WebSocketConnection, session: Session, interval: float, sent: Inventory
    ) -> None:
        seq = 0
        while True:
            await trio.sleep(interval)
            seq += 1
            current = self.source.inventory()
            changed: Inventory | None = None
            if not same_inventory(current, sent):
                changed = sent = current
            hb = Heartbeat(seq=seq, sent_at=time.time(), memory=current.memory, inventory=changed)
            await ws.send_message(session.send(hb))
            # the read side may wait forever; a pong proves the control plane is alive
            with trio.fail_after(max(interval, 1.0) * 3):
                await ws.ping()

    async def _statuses(self, ws: WebSocketConnection, session: Session, sup: Supervisor) -> None:
        """Carry the supervisor's status reports up, in order, while this session lasts."""
        while True:
            changed = sup.outbox.changed
            for status in sup.outbox.take():
                await ws.send_message(session.send(status))
            await changed.wait()

    def running_shards(self) -> list[ShardReport]:
        """Every shard this agent runs; an empty list is news, and is sent as such."""
        return self.supervisor.reports()

    def handle_command(self, command: object) -> None:
        """Hand a command to the supervisor, whose answers go up through its outbox."""
        sup = self.supervisor
        if isinstance(command, StartShard):
            sup.start(command.spec)
        elif isinstance(command, StopShard):
            sup.stop(command.shard_id, command.grace_s)
        elif isinstance(command, DrainShard):
            sup.drain(command.shard_id, command.grace_s)

    def _log_closed(self, where: str, exc: ConnectionClosed, state: _Attempt) -> None:
        r = exc.reason
        code = r.code if r else None
        text = (r.reason or "") if r else ""
        name = r.name if r else "unknown"
        try:
            label = CloseCode(code).name if code is not None else name
        except ValueError:
            label = name
        if code == CloseCode.GOING_AWAY:
            log.warning("control plane %s is going away: %s", where, text or label)
        elif not state.registered:
            log.error(
                "control plane %s refused this agent (node %s): %s %s: %s",
                where,
                self.settings.node_id,
                code,
                label,
                text or "no reason given",
            )
        else:
            log.warning("control plane %s closed the stream: %s %s: %s", where, code, label, text)


@attrs.define
class _Attempt:
    stage: str = "connect"
    registered: bool = False


_PREFERENCE = (ConnectionClosed, ConnectionRejected, ProtocolError, ssl.SSLError)


def _most_telling(exc: BaseException) -> BaseException:
    """From an exception group, the one error that best says why a stream ended."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        elif not isinstance(e, trio.Cancelled):
            leaves.append(e)

    walk(exc)
    for kind in _PREFERENCE:
        for leaf in leaves:
            if isinstance(leaf, kind):
                return leaf
    return leaves[0] if leaves else exc


def _ssl_reason(exc: ssl.SSLError) -> str:
    return exc.reason or str(exc)

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
body); a refusal is never reported as a clean close. What the operator can
mend is named with what to do: a connection refused or unanswered, a
control-plane certificate without the address dialed (with the names it
holds, read over a second handshake that checks the CA only), or from another
CA. The backoff is reset only when a registration was accepted, so an agent
the control plane keeps refusing backs off to the ceiling instead of
hammering it; after a registered stream ends it stays within a couple of
seconds for a minute (``Backoff.lost``), so a restarted control plane hears
from every node within seconds.

What the supervisor killed (a stray, an engine that outlived its stop grace)
goes up on a heartbeat sent at once for it; a kill made while no session is
registered waits for the next one. A field of ``Heartbeat`` and not a message
of its own, so that a control plane from before kills were reported does not
close the stream on a type it does not know.

The read side blocks until the control plane sends something, which may be
never; a WebSocket ping with a deadline on every heartbeat bounds how long a
dead peer goes unnoticed. Cancellation (SIGTERM) unblocks every wait at once;
the stream is then closed with 1001 under a short shielded deadline.
"""

from __future__ import annotations

import errno
import logging
import secrets
import socket
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

from llmgw.addr import join_hostport
from llmgw.agent.backoff import Backoff
from llmgw.agent.inventory import InventorySource, same_inventory
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.supervisor import Supervisor
from llmgw.protocol import SUBPROTOCOL, CloseCode, ProtocolError, Role, Session
from llmgw.protocol.messages import (
    FETCH,
    SLEEP,
    DrainShard,
    FetchWeights,
    Heartbeat,
    Inventory,
    Register,
    RegisterAck,
    ShardReport,
    SleepShard,
    StartShard,
    StopShard,
    WakeShard,
)
from llmgw.tls.contexts import NAME_MISMATCH, NOT_FROM_OUR_CA, certificate_names
from llmgw.version import describe
from llmgw.wsio import close_quietly, close_ws, single_error, split_cancelled

log = logging.getLogger("llmgw.agent")

X509_CERT_HAS_EXPIRED = 10  # OpenSSL's X509_V_ERR_CERT_HAS_EXPIRED
KILLS_PER_HEARTBEAT = 100  # bounds the message; the rest follow at once


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
    ca_file: str = ""  # named when the control plane's certificate is not from that CA
    # checks the chain but not the name: reads which names a certificate holds
    # when it failed the name check (``client_context(check_name=False)``)
    name_probe_context: ssl.SSLContext | None = None


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
        self.metrics_address = ""  # "host:port" once its listener is open (serve.agent)
        self.backoff = Backoff(settings.backoff_initial, settings.backoff_max)
        # one per process: the control plane tells this agent reconnecting from a second
        # agent for the same node, which it refuses while this one's stream is live
        self.instance = secrets.token_hex(8)
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
            now = trio.current_time()
            if registered:
                self.backoff.lost(now)  # most likely back within moments: look soon
            delay = self.backoff.next_delay(now)
            # the attempt's end was said in one line already; this is detail
            log.debug("reconnecting in %.2f s (attempt %d)", delay, self.backoff.attempt)
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
        if isinstance(exc, _Explained):
            log.error("%s", exc)
        elif isinstance(exc, ConnectionClosed):
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
        try:
            with trio.fail_after(s.connect_timeout):
                tcp = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise _Explained(
                f"no answer from {where} within {s.connect_timeout:g} s:"
                " a firewall, or a wrong address?"
            ) from None
        except OSError as exc:
            raise _Explained(connect_problem(host, where, exc)) from None
        # engines listening on "auto" listen where this node reaches the control plane
        self.supervisor.stream_address = str(tcp.socket.getsockname()[0])
        tls = trio.SSLStream(tcp, s.ssl_context, server_hostname=host)
        try:
            state.stage = "TLS handshake"
            try:
                with trio.fail_after(s.handshake_timeout):
                    await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                refused = exc.__cause__
                if not isinstance(refused, ssl.SSLCertVerificationError):
                    raise
                names = None
                if refused.verify_code in NAME_MISMATCH:
                    names = await self._certificate_names(host, port)
                raise _Explained(
                    certificate_problem(where, host, refused, names, s.ca_file)
                ) from None
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

    async def _certificate_names(self, host: str, port: int) -> list[str] | None:
        """The names and addresses in the control plane's certificate, read over a
        second handshake that checks the CA but not the name; None if it cannot be."""
        ctx = self.settings.name_probe_context
        if ctx is None:
            return None
        return await read_certificate_names(host, port, ctx, self.settings.handshake_timeout)

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
            agent_version=describe(),
            metrics_address=self.metrics_address,
            agent_instance=self.instance,
            can=[SLEEP, FETCH],
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
        """Every ``interval``, and at once when the supervisor killed something: the
        control plane hears of each kill on the heartbeat that carries it."""
        seq = 0
        kills = self.supervisor.kills
        while True:
            with trio.move_on_after(interval):
                while not kills.items:
                    await kills.changed.wait()
            seq += 1
            current = self.source.inventory()
            changed: Inventory | None = None
            if not same_inventory(current, sent):
                changed = sent = current
            batch = kills.items[:KILLS_PER_HEARTBEAT]
            hb = Heartbeat(
                seq=seq,
                sent_at=time.time(),
                memory=current.memory,
                inventory=changed,
                kills=batch,
                fetching=current.fetching or None,
            )
            await ws.send_message(session.send(hb))
            kills.sent(batch)
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
            sup.stop(command.shard_id, None if command.agent_grace else command.grace_s)
        elif isinstance(command, DrainShard):
            sup.drain(command.shard_id, command.grace_s)
        elif isinstance(command, SleepShard):
            sup.sleep(command.shard_id, command.grace_s)
        elif isinstance(command, WakeShard):
            sup.wake(command.shard_id)
        elif isinstance(command, FetchWeights):
            sup.spawn(sup.fetcher.prefetch, command)

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


async def read_certificate_names(
    host: str, port: int, ctx: ssl.SSLContext, within: float
) -> list[str] | None:
    """The names and addresses in the certificate at ``host:port``, read over a
    handshake with ``ctx`` (one that checks the CA but not the name) within
    ``within`` seconds; None if it cannot be."""
    with trio.move_on_after(within):
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError:
            return None
        tls = trio.SSLStream(tcp, ctx, server_hostname=host)
        try:
            await tls.do_handshake()
            return certificate_names(tls.getpeercert())
        except (trio.BrokenResourceError, ssl.SSLError, OSError):
            return None
        finally:
            await close_quietly(tls)
    return None


class _Explained(Exception):
    """A failure to reach the control plane, already in the words an operator acts on."""


def connect_problem(host: str, where: str, exc: OSError) -> str:
    """Why a TCP connection to the control plane failed, and what to look at."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {host!r} ({exc.strerror or exc}): is control_plane right?"
    cause = exc.__cause__
    errors = list(cause.exceptions) if isinstance(cause, BaseExceptionGroup) else [exc]
    codes = {e.errno for e in errors if isinstance(e, OSError)}
    if codes == {errno.ECONNREFUSED}:
        return (
            f"connection refused by {where}: is llmgw server running there"
            " and listening on that port?"
        )
    if errno.ETIMEDOUT in codes:
        return f"no answer from {where}: a firewall, or a wrong address?"
    if codes & {errno.EHOSTUNREACH, errno.ENETUNREACH}:
        return f"no route to {where}: a wrong address, or is that network down?"
    first = next((e for e in errors if isinstance(e, OSError)), exc)
    return f"cannot connect to control plane {where}: {first.strerror or first}"


def certificate_problem(
    where: str,
    host: str,
    exc: ssl.SSLCertVerificationError,
    names: list[str] | None,
    ca_file: str,
) -> str:
    """Why this agent refused the control plane's certificate, and which command mends it."""
    issue = "llmgw ctl cert server {} --dir pki"
    if exc.verify_code in NAME_MISMATCH:
        if names is None:
            holds = "its names could not be read"
        elif names:
            holds = "it holds " + ", ".join(names)
        else:
            holds = "it holds no names or addresses at all (agents ignore its common name)"
        wanted = " ".join([host, *(n for n in names or () if n != host)])
        return (
            f"control plane {where} presented a certificate that is not valid for {host}"
            f" ({holds}): issue one that holds every name and address agents dial,"
            f" with {issue.format(wanted)}"
        )
    if exc.verify_code in NOT_FROM_OUR_CA:
        ca = f"the CA in {ca_file} (this agent's ca)" if ca_file else "the CA this agent trusts"
        return (
            f"control plane {where} presented a certificate that is not signed by {ca}:"
            " give the agent the ca.pem of the CA that issued the server's certificate,"
            f" or issue the server one from this CA with {issue.format(host)}"
        )
    reason = exc.verify_message or _ssl_reason(exc)
    if exc.verify_code == X509_CERT_HAS_EXPIRED:
        return (
            f"control plane {where} presented a certificate that has expired:"
            f" issue it a new one with {issue.format(host)}"
        )
    return f"control plane {where} presented a certificate this agent refuses: {reason}"


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

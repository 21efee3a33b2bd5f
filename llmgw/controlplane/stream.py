"""The agent stream listener: TLS, WebSocket and session, in a thin trio shell.

Theory of operation
-------------------
Each accepted TCP connection gets its own handler and its own nursery (the
WebSocket reader lives there), so ending the handler ends every task of the
connection. The handler:

1. does the TLS handshake itself, bounded by ``handshake_timeout`` (a
   plaintext client or one that offers no certificate would otherwise hang
   the handler), and reads the verified client certificate's common name.
   A failure says which side refused what: a client that closes half-way,
   having been sent our certificate, is most likely an agent that does not
   trust it (trio sends no alert), not one this server refused;
2. reads the WebSocket upgrade and negotiates the subprotocol (the protocol
   version); a mismatch is rejected during the upgrade with the reason in the
   body, and a connection that ends before asking is let go at once;
3. feeds every binary message to a sans-I/O ``Session`` and hands the result to
   the ``ControlPlane``. A protocol error closes the stream with the error's
   code and reason, logged here too, so both sides can say why.

Every wait is bounded: the handshake and the first message by
``handshake_timeout``, every later message by the lost-node timeout (an agent
that stays silent that long is closed), every send by ``send_timeout``.
Whatever happens, the connection is closed within ``CLOSE_TIMEOUT`` of the
handler ending, shielded, so a shutdown is never held up by a slow peer.
"""

from __future__ import annotations

import logging
import ssl

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_server_stream

from llmgw.addr import join_hostport
from llmgw.controlplane.dispatcher import AgentConnection
from llmgw.controlplane.service import ControlPlane
from llmgw.protocol import CloseCode, ProtocolError, Role, Session, negotiate
from llmgw.protocol.errors import OutOfOrder, VersionMismatch
from llmgw.protocol.messages import Heartbeat, Register, ShardStatus
from llmgw.tls.contexts import NOT_FROM_OUR_CA, peer_common_name
from llmgw.wsio import CLOSE_TIMEOUT, close_quietly, close_ws, single_error, split_cancelled

log = logging.getLogger("llmgw.controlplane.stream")


@attrs.frozen
class StreamLimits:
    handshake_timeout: float = 10.0
    idle_timeout: float = 60.0  # the lost-node timeout
    send_timeout: float = 10.0
    max_message_bytes: int = 1024 * 1024


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port, *_ = stream.socket.getpeername()
    except OSError:
        return "?"
    return join_hostport(host, port)


class AgentStreamServer:
    def __init__(
        self, control: ControlPlane, ssl_context: ssl.SSLContext, limits: StreamLimits
    ) -> None:
        self.control = control
        self.ssl_context = ssl_context
        self.limits = limits

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self.handle, listeners)
            task_status.started(listeners)

    async def handle(self, tcp: trio.SocketStream) -> None:
        """Serve one connection; nothing it does can take the listener down."""
        try:
            await self._handle(tcp)
        except BaseException as exc:
            failure, cancelled = split_cancelled(exc)
            if failure is not None:
                if not isinstance(failure, Exception | BaseExceptionGroup):
                    raise
                log.error(
                    "agent stream from %s failed unexpectedly",
                    _peer(tcp),
                    exc_info=(type(failure), failure, failure.__traceback__),
                )
            if cancelled is not None:
                raise cancelled from None

    async def _handle(self, tcp: trio.SocketStream) -> None:
        peer = _peer(tcp)
        heard = _Noting(tcp)
        tls = trio.SSLStream(heard, self.ssl_context, server_side=True)
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                await tls.do_handshake()
        except trio.TooSlowError:
            self._refused(
                peer,
                "tls_timeout",
                f"no TLS handshake within {self.limits.handshake_timeout:g} s "
                "(a plaintext client, or one that offered no certificate?)",
            )
            await close_quietly(tls)
            return
        except (trio.BrokenResourceError, ssl.SSLError) as exc:
            self._handshake_failed(peer, exc, heard.anything)
            await close_quietly(tls)
            return
        identity = peer_common_name(tls)
        try:
            with single_error():
                async with trio.open_nursery() as nursery:
                    await self._upgrade_and_run(nursery, _Noting(tls), peer, identity)
                    nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, ConnectionClosed, ssl.SSLError) as exc:
            log.info("agent stream from %s broke: %s", peer, exc)
        finally:
            await close_quietly(tls)

    async def _upgrade_and_run(
        self,
        nursery: trio.Nursery,
        tls: _Noting,
        peer: str,
        identity: str | None,
    ) -> None:
        limits = self.limits
        # a client that closes before asking for the stream (an agent that read
        # this server's certificate after refusing it) would otherwise hold the
        # upgrade until its deadline: trio-websocket waits on for the request
        upgrade = trio.CancelScope()

        async def abandon_when_closed() -> None:
            await tls.ended.wait()
            upgrade.cancel()

        nursery.start_soon(abandon_when_closed)
        try:
            with upgrade, trio.fail_after(limits.handshake_timeout):
                request = await wrap_server_stream(
                    nursery, tls, max_message_size=limits.max_message_bytes
                )
        except trio.TooSlowError:
            self._refused(peer, "upgrade_timeout", "no WebSocket upgrade in time")
            return
        if upgrade.cancelled_caught:
            log.debug("connection from %s closed after TLS, before asking for the stream", peer)
            return
        try:
            subprotocol = negotiate(request.proposed_subprotocols)
        except VersionMismatch as exc:
            self._refused(peer, "version", f"{exc.reason} (certificate {identity!r})")
            with trio.move_on_after(CLOSE_TIMEOUT):
                await request.reject(400, body=f"version mismatch: {exc.reason}".encode())
            return
        ws = await request.accept(subprotocol=subprotocol)
        session = Session(
            Role.CONTROL_PLANE, peer_identity=identity, max_message_bytes=limits.max_message_bytes
        )
        opened: list[AgentConnection] = []
        try:
            await self._run(ws, session, peer, opened)
        except ProtocolError as exc:
            self._refused(peer, type(exc).__name__, exc.reason, identity=identity)
            await close_ws(ws, exc.code, exc.close_reason)
        except ConnectionClosed as exc:
            r = exc.reason
            if r is not None and r.code == CloseCode.MESSAGE_TOO_BIG:
                # the WebSocket layer enforces the limit before the session sees the message
                detail = f"message larger than the limit of {limits.max_message_bytes} bytes"
                self._refused(peer, "MessageTooLarge", detail, identity=identity)
                return
            log.info(
                "agent %s (%s) closed its stream: %s %s",
                session.node_id or identity,
                peer,
                r.code if r else "",
                (r.reason or r.name) if r else "",
            )
        finally:
            # asked to close (replaced, stalled), or the server is shutting down
            if opened and ws.closed is None:
                await close_ws(ws, opened[0].close_code, opened[0].close_reason)

    async def _run(
        self,
        ws: WebSocketConnection,
        session: Session,
        peer: str,
        opened: list[AgentConnection],
    ) -> None:
        """Run one registered session; cancelling ``conn.cancel_scope`` ends it."""
        limits = self.limits
        with trio.move_on_after(limits.handshake_timeout) as waiting:
            first = session.receive(await ws.get_message())
        if waiting.cancelled_caught:
            raise OutOfOrder(f"no Register within {limits.handshake_timeout:g} s of connecting")
        assert isinstance(first, Register)  # the session allows nothing else first
        conn = AgentConnection(
            node_id=first.node_id,
            generation=self.control.new_generation(),
            peer=peer,
            ws=ws,
            session=session,
            send_timeout=limits.send_timeout,
            cancel_scope=trio.CancelScope(),
        )
        opened.append(conn)
        self.control.metrics.messages.labels("Register").inc()
        try:
            with conn.cancel_scope:
                await conn.send(self.control.registered(conn, first))
                if first.check_only:  # a preflight: acked, closed, nothing changed
                    await close_ws(ws, CloseCode.NORMAL, "check only")
                    return
                while True:
                    with trio.move_on_after(limits.idle_timeout):
                        message = session.receive(await ws.get_message())
                        self.control.metrics.messages.labels(type(message).__name__).inc()
                        if isinstance(message, Heartbeat):
                            self.control.heartbeat(conn, message)
                        elif isinstance(message, ShardStatus):
                            self.control.shard_status(conn, message)
                        continue
                    raise _Silent(limits.idle_timeout)
        except _Silent as exc:
            conn.close_code, conn.close_reason = CloseCode.SILENT, str(exc)
            log.warning("node %s: %s; closing its stream", conn.node_id, exc)
            await close_ws(ws, conn.close_code, conn.close_reason)
        finally:
            self.control.disconnected(conn)

    def _handshake_failed(self, peer: str, exc: BaseException, heard: bool) -> None:
        """One line on a failed TLS handshake, saying which side refused what."""
        cause = exc if isinstance(exc, ssl.SSLError) else (exc.__cause__ or exc.__context__)
        reason = (cause.reason or "") if isinstance(cause, ssl.SSLError) else ""
        dropped = isinstance(cause, ssl.SSLEOFError | ConnectionResetError) or (
            reason == "UNEXPECTED_EOF_WHILE_READING"
        )
        if dropped and heard:
            # an agent refusing our certificate closes without a word (trio sends no alert)
            self.control.metrics.refusals.labels("tls").inc()
            log.warning(
                "agent from %s dropped the TLS handshake: it probably does not trust this"
                " server's certificate (see the agent's log)",
                peer,
            )
        elif reason.startswith(("SSLV3_ALERT_", "TLSV1_ALERT_")) and (
            "CERTIFICATE" in reason or "UNKNOWN_CA" in reason
        ):
            self.control.metrics.refusals.labels("tls").inc()
            alert = reason.split("_ALERT_", 1)[1].lower().replace("_", " ")
            log.warning(
                "agent from %s refused this server's certificate (%s); see the agent's log",
                peer,
                alert,
            )
        elif isinstance(cause, ssl.SSLCertVerificationError):
            if cause.verify_code in NOT_FROM_OUR_CA:
                why = "its certificate is not signed by the CA in agent_stream.ca"
            else:
                why = f"its certificate is refused: {cause.verify_message or reason}"
            self._refused(peer, "tls", why)
        elif reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            self._refused(
                peer, "tls", "it offered no certificate (an agent needs its cert and key)"
            )
        elif dropped:
            self._refused(peer, "tls", "it closed the connection before any TLS handshake")
        else:
            self._refused(peer, "tls", f"TLS handshake failed: {_tls_reason(exc)}")

    def _refused(self, peer: str, reason: str, detail: str, *, identity: str | None = None) -> None:
        self.control.metrics.refusals.labels(reason).inc()
        who = f"{peer} (certificate {identity!r})" if identity else peer
        log.warning("refused agent stream from %s: %s", who, detail)


class _Noting(trio.abc.Stream):
    """A stream, noting whether the peer sent anything and when it ended.

    Around the TCP stream: a client that closes having said nothing is not one
    that dropped the TLS handshake half-way. Around the TLS stream: the end of
    a connection that never asked for the WebSocket upgrade.
    """

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.anything = False
        self.ended = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self.inner.receive_some(max_bytes)
        except trio.BrokenResourceError:
            self.ended.set()
            raise
        if data:
            self.anything = True
        else:
            self.ended.set()
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Silent(Exception):
    def __init__(self, timeout: float) -> None:
        super().__init__(f"nothing received for {timeout:g} s")


def _tls_reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    for e in (exc, cause):
        if isinstance(e, ssl.SSLError):
            return e.reason or str(e)
    return str(cause or exc) or type(exc).__name__

"""The dispatcher: the only way anything in the control plane talks to a node.

It holds the open agent streams because only the holder of a stream can
deliver a command on it. Sends are encoded by the connection's session
(which refuses an illegal move) under no await, so commands leave in the
order they were issued.
"""

from __future__ import annotations

import logging

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from llmgw.controlplane.metrics import ControlPlaneMetrics
from llmgw.protocol import CloseCode, LocalProtocolError, Session
from llmgw.protocol.messages import Message

log = logging.getLogger("llmgw.controlplane")


class NodeNotConnected(Exception):
    """The node has no open agent stream (or it broke while sending)."""


@attrs.define(eq=False)
class AgentConnection:
    node_id: str
    generation: int
    peer: str
    ws: WebSocketConnection
    session: Session
    send_timeout: float
    cancel_scope: trio.CancelScope
    close_code: CloseCode = CloseCode.GOING_AWAY
    close_reason: str = "control plane shutting down"
    instance: str = ""  # its agent's Register.agent_instance, once accepted

    async def send(self, message: Message) -> None:
        try:
            data = self.session.send(message)
        except LocalProtocolError as exc:
            # the session failed (a bad message from the agent) and its handler has
            # not detached it yet: for a sender, that node is not connected
            raise NodeNotConnected(f"stream to {self.node_id} is closing ({exc})") from None
        try:
            with trio.fail_after(self.send_timeout):
                await self.ws.send_message(data)
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise NodeNotConnected(f"stream to {self.node_id} closed while sending") from exc
        except trio.TooSlowError:
            self.close_soon(CloseCode.POLICY_VIOLATION, "agent stopped reading the stream")
            raise NodeNotConnected(
                f"{self.node_id} did not take a message within {self.send_timeout:g} s"
            ) from None

    def close_soon(self, code: CloseCode, reason: str) -> None:
        """Ask the connection's handler to close it with this code and reason."""
        self.close_code, self.close_reason = code, reason
        self.cancel_scope.cancel()


class Dispatcher:
    def __init__(self, metrics: ControlPlaneMetrics) -> None:
        self._metrics = metrics
        self.connections: dict[str, AgentConnection] = {}

    def attach(self, conn: AgentConnection) -> None:
        old = self.connections.get(conn.node_id)
        if old is not None and old is not conn:
            log.warning(
                "node %s connected again from %s; closing its older stream from %s",
                conn.node_id,
                conn.peer,
                old.peer,
            )
            old.close_soon(CloseCode.REPLACED, "replaced by a newer stream from the same node")
        self.connections[conn.node_id] = conn

    def detach(self, conn: AgentConnection) -> None:
        if self.connections.get(conn.node_id) is conn:
            del self.connections[conn.node_id]

    def connected(self, node_id: str) -> bool:
        return node_id in self.connections

    async def send(self, node_id: str, message: Message) -> None:
        """Deliver one command to a node.

        Raises:
            NodeNotConnected: no stream, or it broke or stalled while sending.
        """
        conn = self.connections.get(node_id)
        if conn is None:
            raise NodeNotConnected(f"node {node_id} has no open agent stream")
        await conn.send(message)
        self._metrics.commands.labels(type(message).__name__).inc()

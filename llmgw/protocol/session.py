"""The per-connection session state machine of the agent stream (sans-I/O).

Theory of operation
-------------------
Each side of a connection owns one ``Session``. The I/O layer hands it every
received binary message (``receive``) and asks it to encode every message it
wants to send (``send``); the session decodes, checks the move against the
transition table below, advances, and returns the message or the bytes. It
never touches a socket, so it is tested and fuzzed without one.

All legal moves are in ``TRANSITIONS``, one table for both roles: a reader
sees at once that an agent must register before heartbeating and that the
control plane acknowledges a registration before it sends any command.
A move that is not in the table is a protocol error: ``LocalProtocolError``
when this side tried it, ``RemoteProtocolError`` when the peer did. Either
moves the session to ``ERROR``; the I/O layer then closes the connection with
the error's code and reason.

On the control plane the session also proves identity: the node id claimed
in ``Register`` must equal the common name of the client certificate that
the TLS layer verified (``peer_identity``).
"""

from __future__ import annotations

from enum import Enum

from llmgw.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode
from llmgw.protocol.errors import (
    IdentityMismatch,
    LocalProtocolError,
    MalformedMessage,
    OutOfOrder,
)
from llmgw.protocol.messages import (
    AnyMessage,
    DrainShard,
    FetchWeights,
    Heartbeat,
    Message,
    Register,
    RegisterAck,
    ShardStatus,
    SleepShard,
    StartShard,
    StopShard,
    WakeShard,
)


class Role(Enum):
    AGENT = "agent"
    CONTROL_PLANE = "control plane"


class State(Enum):
    AWAITING_REGISTER = "awaiting register"  # control plane: nothing received yet
    REGISTERING = "registering"  # control plane: Register received, ack not sent
    UNREGISTERED = "unregistered"  # agent: nothing sent yet
    AWAITING_ACK = "awaiting ack"  # agent: Register sent
    REGISTERED = "registered"
    CLOSED = "closed"
    ERROR = "error"


class Direction(Enum):
    SEND = "send"
    RECEIVE = "receive"


SEND, RECEIVE = Direction.SEND, Direction.RECEIVE

# (role, state, direction, message type) -> next state. Nothing else is legal.
TRANSITIONS: dict[tuple[Role, State, Direction, type[Message]], State] = {
    # the agent registers, waits for the ack, then heartbeats and reports
    (Role.AGENT, State.UNREGISTERED, SEND, Register): State.AWAITING_ACK,
    (Role.AGENT, State.AWAITING_ACK, RECEIVE, RegisterAck): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, SEND, Heartbeat): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, SEND, ShardStatus): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, RECEIVE, StartShard): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, RECEIVE, StopShard): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, RECEIVE, DrainShard): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, RECEIVE, SleepShard): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, RECEIVE, WakeShard): State.REGISTERED,
    (Role.AGENT, State.REGISTERED, RECEIVE, FetchWeights): State.REGISTERED,
    # the control plane proves the registration, acks it, then commands
    (Role.CONTROL_PLANE, State.AWAITING_REGISTER, RECEIVE, Register): State.REGISTERING,
    (Role.CONTROL_PLANE, State.REGISTERING, SEND, RegisterAck): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, RECEIVE, Heartbeat): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, RECEIVE, ShardStatus): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, SEND, StartShard): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, SEND, StopShard): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, SEND, DrainShard): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, SEND, SleepShard): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, SEND, WakeShard): State.REGISTERED,
    (Role.CONTROL_PLANE, State.REGISTERED, SEND, FetchWeights): State.REGISTERED,
}

INITIAL_STATE = {Role.AGENT: State.UNREGISTERED, Role.CONTROL_PLANE: State.AWAITING_REGISTER}
TERMINAL_STATES = frozenset({State.CLOSED, State.ERROR})


class Session:
    """One side of one agent stream connection."""

    def __init__(
        self,
        role: Role,
        *,
        peer_identity: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.role = role
        self.state = INITIAL_STATE[role]
        self.peer_identity = peer_identity
        self.max_message_bytes = max_message_bytes
        self.node_id: str | None = None

    def receive(self, data: bytes | str) -> AnyMessage:
        """Decode one received WebSocket message and advance.

        Raises:
            RemoteProtocolError: (a subclass naming what was wrong) the peer
                sent a text frame, a malformed, unknown, oversized, misplaced or
                misattributed message. The session is then in ``ERROR``.
        """
        self._require_open("receive")
        try:
            if isinstance(data, str):
                raise MalformedMessage("text frame received; the agent stream speaks binary only")
            message = decode(data, max_bytes=self.max_message_bytes)
            self._advance(RECEIVE, message)
            if isinstance(message, Register):
                self._check_identity(message)
        except Exception:
            self.state = State.ERROR
            raise
        return message

    def send(self, message: Message) -> bytes:
        """Advance for a message this side wants to send, and encode it.

        Raises:
            LocalProtocolError: the move is not legal now (the session is then
                in ``ERROR``: sending it anyway would desynchronise the peer).
        """
        self._require_open("send")
        try:
            self._advance(SEND, message)
        except Exception:
            self.state = State.ERROR
            raise
        if isinstance(message, Register):
            self.node_id = message.node_id
        return encode(message)

    def close(self) -> None:
        if self.state is not State.ERROR:
            self.state = State.CLOSED

    @property
    def registered(self) -> bool:
        return self.state is State.REGISTERED

    def _advance(self, direction: Direction, message: Message) -> None:
        key = (self.role, self.state, direction, type(message))
        nxt = TRANSITIONS.get(key)
        if nxt is None:
            what = type(message).__name__
            if direction is SEND:
                raise LocalProtocolError(
                    f"{self.role.value} may not send {what} while {self.state.value}"
                )
            peer = Role.AGENT if self.role is Role.CONTROL_PLANE else Role.CONTROL_PLANE
            raise OutOfOrder(f"{peer.value} sent {what} while this side is {self.state.value}")
        self.state = nxt

    def _check_identity(self, message: Register) -> None:
        claim = message.node_id
        if not claim:
            raise IdentityMismatch("Register carries an empty node id")
        if self.peer_identity is not None and claim != self.peer_identity:
            raise IdentityMismatch(
                f"certificate is for {self.peer_identity!r} but agent claims node id {claim!r}"
            )
        self.node_id = claim

    def _require_open(self, what: str) -> None:
        if self.state in TERMINAL_STATES:
            raise LocalProtocolError(f"cannot {what} on a session that is {self.state.value}")

"""Errors of the agent stream protocol.

Every error names who was wrong (``Local...``: this side tried something
illegal; ``Remote...``: the peer sent something illegal) and carries the
WebSocket close code and a reason the other side can print. Any protocol
error moves the session to ``ERROR``, a terminal state.
"""

from __future__ import annotations

from enum import IntEnum

# RFC 6455 limits a close reason to 123 bytes of UTF-8.
MAX_REASON_BYTES = 123


class CloseCode(IntEnum):
    """Close codes on the agent stream: RFC 6455's where they fit, 4xxx for ours."""

    NORMAL = 1000
    GOING_AWAY = 1001  # a daemon is shutting down
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003  # a text frame where only binary is spoken
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    IDENTITY_MISMATCH = 4001  # certificate common name != claimed node id
    VERSION_MISMATCH = 4002
    OUT_OF_ORDER = 4003
    MALFORMED = 4004
    UNKNOWN_TYPE = 4005
    REPLACED = 4006  # a newer connection from the same node took over
    SILENT = 4007  # nothing received for longer than the lost timeout
    NODE_TAKEN = 4008  # the node's stream is live: a second agent for it is refused


def clip_reason(reason: str) -> str:
    """Shorten a reason so that it fits in a WebSocket close frame."""
    data = reason.encode()
    if len(data) <= MAX_REASON_BYTES:
        return reason
    return data[: MAX_REASON_BYTES - 3].decode(errors="ignore") + "..."


class ProtocolError(Exception):
    """Base of every agent stream protocol error."""

    code: CloseCode = CloseCode.PROTOCOL_ERROR

    def __init__(self, reason: str, *, code: CloseCode | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if code is not None:
            self.code = code

    @property
    def close_reason(self) -> str:
        return clip_reason(self.reason)


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class MalformedMessage(RemoteProtocolError):
    code = CloseCode.MALFORMED


class UnknownMessageType(RemoteProtocolError):
    code = CloseCode.UNKNOWN_TYPE


class MessageTooLarge(RemoteProtocolError):
    code = CloseCode.MESSAGE_TOO_BIG


class OutOfOrder(RemoteProtocolError):
    code = CloseCode.OUT_OF_ORDER


class IdentityMismatch(RemoteProtocolError):
    code = CloseCode.IDENTITY_MISMATCH


class VersionMismatch(RemoteProtocolError):
    code = CloseCode.VERSION_MISMATCH


class NodeTaken(RemoteProtocolError):
    """A second agent for a node whose stream is live and heartbeating; the log line
    says more than the close frame has room for."""

    code = CloseCode.NODE_TAKEN

    def __init__(self, reason: str, close_reason: str) -> None:
        super().__init__(reason)
        self._close_reason = close_reason

    @property
    def close_reason(self) -> str:
        return clip_reason(self._close_reason)

"""The agent stream protocol: wire types, codec and session state machine.

Sans-I/O: nothing here imports trio or touches a socket (see protocol.md).
Import the wire types from ``llmgw.protocol.messages``.
"""

from llmgw.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode
from llmgw.protocol.errors import (
    CloseCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    clip_reason,
)
from llmgw.protocol.session import TRANSITIONS, Role, Session, State
from llmgw.protocol.version import PROTOCOL_VERSION, SUBPROTOCOL, negotiate

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "SUBPROTOCOL",
    "TRANSITIONS",
    "CloseCode",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "Role",
    "Session",
    "State",
    "clip_reason",
    "decode",
    "encode",
    "negotiate",
]

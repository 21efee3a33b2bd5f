"""Encoding and decoding of stream messages, with the size limit applied first."""

from __future__ import annotations

import msgspec

from llmgw.protocol.errors import MalformedMessage, MessageTooLarge, UnknownMessageType
from llmgw.protocol.messages import MESSAGE_TYPES, AnyMessage, Message

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)
_KNOWN_TAGS = frozenset(t.__name__ for t in MESSAGE_TYPES)


class _TagOnly(msgspec.Struct):
    type: str


_tag_decoder = msgspec.msgpack.Decoder(_TagOnly)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> AnyMessage:
    """Decode one message.

    Raises:
        MessageTooLarge: before any decoding, so a huge message costs nothing.
        UnknownMessageType: the ``type`` tag names no message of this version.
        MalformedMessage: anything else that is not a well-formed message (one
            nested too deep included).
    """
    if len(data) > max_bytes:
        raise MessageTooLarge(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        tag = _peek_tag(data)
        if tag is not None and tag not in _KNOWN_TAGS:
            raise UnknownMessageType(f"unknown message type {tag[:40]!r}") from None
        raise MalformedMessage(f"malformed message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"not MessagePack: {exc}") from None
    except RecursionError:  # the decoder's own bound on nesting, hundreds of levels deep
        raise MalformedMessage("malformed message: it nests too deep to decode") from None


def _peek_tag(data: bytes) -> str | None:
    try:
        return _tag_decoder.decode(data).type
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None

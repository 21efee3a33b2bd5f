"""What a stream used, asked of its engine: ``stream_options.include_usage``.

A streamed reply says nothing of its tokens unless the request asked for a usage
event (OpenAI's ``stream_options: {"include_usage": true}``, which vLLM and
llama.cpp honour). A tenant's limits settle on what the engine reports, so the
router asks for it on every stream it sends (``ask``) and, where the client did not
ask, takes it out of what the client gets (``Unasked``): the event that carries
nothing but usage (``"choices": []``) is dropped, and a ``usage`` an engine put on
a choice's event (llama.cpp's completions) is taken off it. A client that asked
gets the usage as the engine sent it.

Without a usage event the router counts the events that carried text (one token
each on llama.cpp and vLLM) and the prompt as estimated (``quota``).
"""

from __future__ import annotations

from typing import Any

import msgspec

_OPTIONS = b'"stream_options"'
_ASK = b'"stream_options":{"include_usage":true},'
_USAGE = b'"usage"'
_END = b"\n\n"
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def asked(body: dict[str, Any]) -> bool:
    """Whether the client asked for its stream's usage."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def ask(body: bytes) -> tuple[bytes, bool]:
    """The body to send for a stream, asking its engine for the usage; and whether the
    client had not asked (its usage is to be taken out of what it gets). A body that
    is not a JSON object goes as it came (the engine will say what is wrong)."""
    if _OPTIONS not in body:  # the common case: no decoding
        start = body.find(b"{")
        if start < 0 or body[start + 1 :].lstrip()[:1] in (b"}", b""):
            return body, False
        return body[: start + 1] + _ASK + body[start + 1 :], True
    try:
        decoded = _decoder.decode(body)
    except msgspec.DecodeError:
        return body, False
    if not isinstance(decoded, dict) or asked(decoded):
        return body, False
    ask_of(decoded)
    return _encoder.encode(decoded), True


def ask_of(body: dict[str, Any]) -> None:
    """Set a decoded request's ``stream_options.include_usage``, keeping its other
    stream options."""
    options = body.get("stream_options")
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }


def unasked(obj: dict[str, Any]) -> bool:
    """Take the usage off a decoded event the client did not ask it of; True when
    nothing is left of the event for the client (it carried only usage)."""
    if obj.pop("usage", None) is None:
        return False
    return not obj.get("choices")


class Unasked:
    """Takes the usage out of a stream relayed as it comes (``relay.Relay``), where
    the client did not ask for it: whole events pass as they are, a part of one is
    held until the rest comes."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (and what was held) the client gets now; may be empty."""
        data = self._held + chunk if self._held else chunk
        end = data.rfind(_END)
        if end < 0:
            self._held = data
            return b""
        whole, self._held = data[: end + 2], data[end + 2 :]
        if _USAGE not in whole:
            return whole
        return b"".join(_shown(event) for event in whole.split(_END) if event)

    def rest(self) -> bytes:
        """What was held when the stream ended (an event never finished)."""
        held, self._held = self._held, b""
        return held


def _shown(event: bytes) -> bytes:
    """One whole event (without its blank line) as the client gets it, blank line
    included; empty where it carried only usage."""
    if _USAGE not in event or not event.startswith(b"data: {"):
        return event + _END
    try:
        obj = _decoder.decode(event[6:])
    except msgspec.DecodeError:
        return event + _END
    if not isinstance(obj, dict) or "usage" not in obj:
        return event + _END
    if unasked(obj):
        return b""
    return b"data: " + _encoder.encode(obj) + _END

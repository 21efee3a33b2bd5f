"""What a stream used, asked of its engine: ``stream_options.include_usage``.

A streamed reply says nothing of its tokens unless the request asked for a usage
event (OpenAI's ``stream_options: {"include_usage": true}``, which vLLM and
llama.cpp honour). A tenant's limits settle on what the engine reports, so the
router asks for it on every stream it sends (``ask``) and, where the client did not
ask, takes it out of what the client gets (``Unasked``): the event that carries
nothing but usage (``"choices": []``) is dropped, and a ``usage`` an engine put on
a choice's event (llama.cpp's completions) is taken off it. A client that asked
gets the usage as the engine sent it.

What else the dropped event carried goes where the engine puts it when not asked:
llama.cpp's chat streams put their ``timings`` (``cache_n``, ``prompt_n``, the
speeds) on the usage event when asked for usage, and on the choice's last event
(its ``finish_reason``) when not. So a choice's last event is held (``Last``) until
the next event says whether the usage event follows, and gets its extras.

Without a usage event the router counts the events that carried text (one token
each on llama.cpp and vLLM) and the prompt as estimated (``quota``).
"""

from __future__ import annotations

from typing import Any

import msgspec

_OPTIONS = b'"stream_options"'
_ASK = b'"stream_options":{"include_usage":true},'
_USAGE = b'"usage"'
_FINISH = b'"finish_reason":"'  # a choice's last event (compact JSON, as engines write it)
_END = b"\n\n"
# what every event of a stream carries: the rest of a usage event is the engine's own
_ENVELOPE = frozenset(("id", "object", "created", "model", "system_fingerprint", "choices"))
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
        asking = lead(body, _ASK)
        return asking, asking is not body
    try:
        decoded = _decoder.decode(body)
    except msgspec.DecodeError:
        return body, False
    if not isinstance(decoded, dict) or asked(decoded):
        return body, False
    ask_of(decoded)
    return _encoder.encode(decoded), True


def lead(body: bytes, member: bytes) -> bytes:
    """``body`` with ``member`` (``"name":value,``) first in its JSON object, undecoded;
    a body that is not a JSON object with members goes as it came. A member of the same
    name in the body still counts: the last one read wins."""
    start = body.find(b"{")
    if start < 0 or body[start + 1 :].lstrip()[:1] in (b"}", b""):
        return body
    return body[: start + 1] + member + body[start + 1 :]


def ask_of(body: dict[str, Any]) -> None:
    """Set a decoded request's ``stream_options.include_usage``, keeping its other
    stream options."""
    options = body.get("stream_options")
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }


def unasked(obj: dict[str, Any]) -> dict[str, Any] | None:
    """Take the usage off a decoded event the client did not ask it of. None: something
    is left of the event for the client. Else the event carried only usage (nothing of
    it is for the client), and what it is returned is what else it carried, for the
    choice's last event (llama.cpp's ``timings``; empty where nothing)."""
    if obj.pop("usage", None) is None or obj.get("choices"):
        return None
    return {k: v for k, v in obj.items() if k not in _ENVELOPE}


def carried(event: bytes, extra: dict[str, Any]) -> bytes:
    """A choice's last event (``data: {...}``, its blank line after) with ``extra`` on
    it, where it does not say those already."""
    if not extra or not event.startswith(b"data: {"):
        return event
    try:
        obj = _decoder.decode(event[6:].rstrip(b"\n"))
    except msgspec.DecodeError:
        return event
    if not isinstance(obj, dict):
        return event
    for name, value in extra.items():
        obj.setdefault(name, value)
    return b"data: " + _encoder.encode(obj) + _END


class Last:
    """A stream's events as the client gets them, where it did not ask for usage: a
    choice's last event is held until the next event, and gets what the usage event
    between carried for it (``unasked``)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = b""  # the choice's last event held, its blank line included

    def next(self, shown: bytes, extra: dict[str, Any] | None = None) -> bytes:
        """What the client gets now, for the next event: ``shown`` (its blank line
        included; empty where it was the usage event, ``extra`` what that carried)."""
        held = self.event
        if held and extra:
            held = self.event = carried(held, extra)
        if not shown:
            return b""
        if _FINISH in shown:  # this one is held in turn (a stream of several choices)
            self.event = shown
            return held
        self.event = b""
        return held + shown if held else shown

    def flush(self) -> bytes:
        """The event held, when nothing follows it (the stream ended, or broke)."""
        held, self.event = self.event, b""
        return held


class Unasked:
    """Takes the usage out of a stream relayed as it comes (``relay.Relay``), where
    the client did not ask for it: whole events pass as they are (a choice's last
    one held for its extras, ``Last``), a part of one is held until the rest comes."""

    __slots__ = ("_held", "_last")

    def __init__(self) -> None:
        self._held = b""
        self._last = Last()

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (and what was held) the client gets now; may be empty."""
        data = self._held + chunk if self._held else chunk
        end = data.rfind(_END)
        if end < 0:
            self._held = data
            return b""
        whole, self._held = data[: end + 2], data[end + 2 :]
        if _USAGE not in whole and _FINISH not in whole and not self._last.event:
            return whole
        last = self._last
        return b"".join(last.next(*_shown(event)) for event in whole.split(_END) if event)

    def rest(self) -> bytes:
        """What was held when the stream ended (an event never finished)."""
        held, self._held = self._held, b""
        return self._last.flush() + held

    def broke(self) -> None:
        """The stream broke: its part-event is dropped (the error event that follows
        is fed, after what whole events are held)."""
        self._held = b""


def _shown(event: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """One whole event (without its blank line) as the client gets it, blank line
    included (empty where it carried only usage), and what else a usage event carried
    (``unasked``)."""
    if _USAGE not in event or not event.startswith(b"data: {"):
        return event + _END, None
    try:
        obj = _decoder.decode(event[6:])
    except msgspec.DecodeError:
        return event + _END, None
    if not isinstance(obj, dict) or "usage" not in obj:
        return event + _END, None
    extra = unasked(obj)
    if extra is not None:
        return b"", extra
    return b"data: " + _encoder.encode(obj) + _END, None

"""A replica's response body, passed to the client chunk by chunk as it arrives.

However the relay ends (finished, failed upstream, cancelled, or closed by
the server before it was ever read), the upstream connection is closed, the
replica told and the request's record ended, once. An async generator could
not promise the last: one never started runs no ``finally``.

A streamed (SSE) body is also watched, cheaply, for the time to its first
event (the first token: an engine sends its head before the prompt is even
read) and for how many tokens it carried.

A stream whose replica fails after its head (a reset, a killed engine, a stall
past ``idle_timeout_s``, a replica found wedged) is carried on from another
replica when it has a ``Transcript`` (``llmgw.router.resume``): the relay then
reads the stream event by event, passes each on as the transcript rewrites it,
and on a break asks ``carry_on`` for a continuation, whose events it relays in
the original's shape. A stream that cannot be carried on ends with an error
event in OpenAI's format, which the openai client raises as an ``APIError``
with its words, never a silent cut (the connection itself stays whole).

A stream's last event (``data: [DONE]``) ends the request on its replica at
once, before it is passed on: a client that starts its next request the moment
it reads it must find this one no longer counted, or the balancer, seeing one
more in flight than there is, sends the next request elsewhere (or, with every
replica at its slots, sheds it).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import msgspec
import trio

from llmgw.engines.base import REUSE_MARKERS, prompt_reuse
from llmgw.http.client import UpstreamError, UpstreamReset, UpstreamResponse
from llmgw.router import attempt
from llmgw.router.attempt import Lease
from llmgw.router.breaker import Outcome
from llmgw.router.record import ENDED, Record
from llmgw.router.resume import NotResumed, Transcript
from llmgw.router.verdict import verdict

# Streamed tokens: the usage a stream reports (``stream_options.include_usage``),
# else the events that carry generated text, one token each on llama.cpp and vLLM
# (chat ``content``/``reasoning_content``, completions ``text``; empty ones not).
_STREAM_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_USAGE = b'"completion_tokens"'
_TEXT, _EMPTY_TEXT = b'content":"', b'content":""'  # chat: content, reasoning_content
_COMPLETION_TEXT, _EMPTY_COMPLETION = b'"text":"', b'"text":""'
_DONE = b"data: [DONE]"
_TIMINGS, _CACHED = REUSE_MARKERS
_END = b"\n\n"

# A continuation of a broken stream: the new replica's response and its lease, the
# last event of a stream that needs no more tokens, or why there is none
Continuation = tuple[UpstreamResponse, Lease] | bytes | NotResumed
CarryOn = Callable[[Transcript], Awaitable[Continuation]]
_OFF = NotResumed("off", "")


class Relay:
    """The body of ``upstream``, relayed; ``outcome``: the breaker's, if it completes.

    With a ``transcript`` and ``carry_on``, a stream that breaks goes on from another
    replica (see the module docstring)."""

    __slots__ = (
        "_broke_at",
        "_buf",
        "_carry_on",
        "_cut",
        "_ended",
        "_first",
        "_lease",
        "_out",
        "_outcome",
        "_over",
        "_record",
        "_resumed",
        "_sent_at",
        "_stream",
        "_text_events",
        "_transcript",
        "_translating",
        "_upstream",
        "_usage",
        "_why_not",
    )

    def __init__(
        self,
        upstream: UpstreamResponse,
        lease: Lease,
        outcome: Outcome,
        record: Record,
        stream: bool,
        transcript: Transcript | None = None,
        carry_on: CarryOn | None = None,
        why_not: NotResumed = _OFF,
    ) -> None:
        self._upstream = upstream
        self._lease = lease
        self._outcome = outcome
        self._record = record
        self._stream = stream
        self._first = True
        self._ended = False
        self._text_events = 0
        self._usage = 0
        self._transcript = transcript
        self._carry_on = carry_on
        self._buf = b""  # an event not yet whole
        self._out: list[bytes] = []  # events ready for the client
        self._over = False  # nothing more comes from upstream
        self._translating = False  # the events come from a continuation
        self._resumed = False
        self._sent_at = 0.0  # when the last event was made ready for the client
        self._broke_at: float | None = None  # when the events stopped, until they go on
        self._cut = ""  # why the stream was cut from outside (a wedged replica)
        self._why_not = why_not  # why a stream without a transcript cannot go on
        if stream:
            lease.endpoint.streams.add(self)

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._transcript is not None:
            return await self._next_events()
        try:
            chunk = await self._upstream.body_iter.__anext__()
        except StopAsyncIteration:
            self._end(self._outcome)
            raise
        except UpstreamError as exc:
            self._record.upstream_error(self._lease.endpoint.key, attempt.kind(exc))
            self._end(verdict(attempt.failure(exc), started=True).outcome)
            if not self._stream:
                raise
            self._record.not_resumed(self._why_not.label)
            # then the body is over
            return cut_short(self._lease.endpoint.key, self._cut or str(exc), self._why_not.words)
        except BaseException:
            self._end(None)
            raise
        self._lease.endpoint.chunks += 1  # heard from (see ``balancer.silent``)
        if self._stream:
            self._watch(chunk)
        return chunk

    def cut(self, why: str) -> None:
        """End the stream's read from its replica now (a replica found wedged): the
        stream goes on elsewhere, or ends with an error event that says ``why``."""
        if not self._cut:
            self._cut = why
            self._upstream.body_iter.close()

    def _watch(self, chunk: bytes) -> None:
        # The fewest scans for the common chunk, one token of content: about 0.5 µs.
        if self._first and b"data:" in chunk:
            self._first = False
            self._record.first_token(trio.current_time())
        n = chunk.count(_TEXT)
        if n:
            if _EMPTY_TEXT in chunk:
                n -= chunk.count(_EMPTY_TEXT)
            self._text_events += n
        elif _COMPLETION_TEXT in chunk:
            self._text_events += chunk.count(_COMPLETION_TEXT) - chunk.count(_EMPTY_COMPLETION)
        elif _USAGE in chunk and (found := _STREAM_USAGE.search(chunk)):
            self._usage = int(found[1])  # a usage event carries no text
        # what the engine reused: llama.cpp's last event (which may come in one read with
        # the last token's), or a usage event (no text)
        if _TIMINGS in chunk or (not n and _CACHED in chunk):
            self._reuse(chunk)
        if _DONE in chunk[-16:]:  # the last event: done on the replica
            self._lease.finish(trio.current_time(), self._outcome)

    def _reuse(self, data: bytes) -> None:
        """Note what the engine said it reused of the prompt, when ``data`` says it."""
        if _TIMINGS in data or _CACHED in data:
            found = prompt_reuse(data)
            if found is not None:
                self._record.reused(*found)

    async def _next_events(self) -> bytes:
        """The events ready for the client, read from upstream (and its successors)."""
        out = self._out
        while not out:
            if self._over:
                self._end(self._outcome)
                raise StopAsyncIteration
            try:
                chunk = await self._upstream.body_iter.__anext__()
            except StopAsyncIteration:
                if self._transcript is not None and self._transcript.finished:
                    self._over = True  # ended as a stream ends (its [DONE] relayed)
                    if self._buf:
                        out.append(self._buf)
                    continue
                await self._broke(
                    UpstreamReset("the stream ended before its last event", "body", False)
                )
                continue
            except UpstreamError as exc:
                await self._broke(exc)
                continue
            except BaseException:
                self._end(None)
                raise
            self._feed(chunk)
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data

    def _feed(self, chunk: bytes) -> None:
        """Split what arrived into events, and make each ready as the client gets it."""
        transcript = self._transcript
        assert transcript is not None
        self._lease.endpoint.chunks += 1  # heard from (see ``balancer.silent``)
        events = (self._buf + chunk).split(_END)
        self._buf = events.pop()
        now = trio.current_time()
        for event in events:
            if not event:
                continue
            if event.startswith(_DONE):
                transcript.finished = True
                self._lease.finish(now, self._outcome)  # done on the replica
                self._out.append(_DONE + _END)
                continue
            if not self._translating:
                self._reuse(event)
            try:
                shown = (
                    transcript.translate(event) if self._translating else transcript.observe(event)
                )
            except (msgspec.DecodeError, TypeError, KeyError, AttributeError):
                shown = event  # not the JSON it should be: passed on as it came
            if shown is None:
                continue
            if self._first:
                self._first = False
                self._record.first_token(now)
            if self._broke_at is not None:
                self._record.resumed(now - self._broke_at)
                self._broke_at = None
            self._sent_at = now
            self._out.append(shown + _END)

    async def _broke(self, exc: UpstreamError) -> None:
        """The stream's replica failed: carry the stream on elsewhere, or end it with
        an error event that says why."""
        transcript = self._transcript
        assert transcript is not None
        lease = self._lease
        failed = lease.endpoint
        self._record.upstream_error(failed.key, attempt.kind(exc))
        if isinstance(exc, UpstreamReset) and not self._cut:  # its engine died (poison)
            self._record.died(failed.key, answered=True, alone=lease.alone())
        self._upstream.body_iter.close()
        failed.streams.discard(self)
        lease.finish(trio.current_time(), verdict(attempt.failure(exc), started=True).outcome)
        self._buf = b""
        why = self._cut or str(exc)
        self._cut = ""
        if transcript.finished:  # all but the [DONE]
            self._out.append(_DONE + _END)
            self._over = True
            return
        found = transcript.refused() or (
            await self._carry_on(transcript) if self._carry_on is not None else _OFF
        )
        if isinstance(found, NotResumed):
            self._record.not_resumed(found.label)
            self._out.append(cut_short(failed.key, why, found.words))
            self._outcome = "upstream_fault"
            self._over = True
            return
        opening = transcript.opening()  # it broke before its first event
        if opening is not None:
            self._out.append(opening + _END)
        if isinstance(found, bytes):  # it had reached its max_tokens
            self._out += (found + _END, _DONE + _END)
            self._over = True
            return
        self._upstream, self._lease = found
        self._lease.endpoint.streams.add(self)
        self._translating = True
        self._resumed = True
        self._broke_at = self._sent_at or trio.current_time()

    async def aclose(self) -> None:
        self._end(None)

    def _end(self, outcome: Outcome | None) -> None:
        if not self._ended:
            self._ended = True
            self._upstream.body_iter.close()
            self._lease.endpoint.streams.discard(self)
            now = trio.current_time()
            self._lease.finish(now, outcome)
            record = self._record
            transcript = self._transcript
            if transcript is not None:
                record.tokens = len(transcript.ids) or len(transcript.text)
                ended = "resumed" if self._resumed and outcome == "success" else ENDED[outcome]
            else:
                record.tokens = self._usage or self._text_events
                ended = ENDED[outcome]
            record.end(now, ended)


def cut_short(replica: str, failure: str, why_not: str) -> bytes:
    """The last event of a stream whose replica failed mid-way: OpenAI's error shape
    (``why_not``: why it could not go on from another replica, "" to say nothing)."""
    because = f" and could not go on elsewhere: {why_not}" if why_not else ""
    error = {
        "message": f"the reply was cut short: replica {replica} failed mid-stream ({failure})"
        f"{because}; what was sent stands, the rest is lost: ask again",
        "type": "server_error",
        "param": None,
        "code": "upstream_failed",
    }
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"

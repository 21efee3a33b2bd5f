"""A replica's response body, passed to the client chunk by chunk as it arrives.

However the relay ends (finished, failed upstream, cancelled, or closed by
the server before it was ever read), the upstream connection is closed, the
replica told and the request's record ended, once. An async generator could
not promise the last: one never started runs no ``finally``.

A streamed (SSE) body is also watched, cheaply, for the time to its first
event (the first token: an engine sends its head before the prompt is even
read) and for how many tokens it carried.

``Relay`` passes the body on as it comes, each chunk as it was read. A stream
whose replica fails after its head (a reset, a killed engine, a stall past
``idle_timeout_s``, a replica found wedged) ends with an error event in
OpenAI's format, which the openai client raises as an ``APIError`` with its
words, never a silent cut (the connection itself stays whole). A stream that
can be carried on from another replica is relayed event by event by the
resumable relay instead (``llmgw.router.resumer``), which shares all of this
but the reading.

A stream's last event (``data: [DONE]``) ends the request on its replica at
once, before it is passed on: a client that starts its next request the moment
it reads it must find this one no longer counted, or the balancer, seeing one
more in flight than there is, sends the next request elsewhere (or, with every
replica at its slots, sheds it).
"""

from __future__ import annotations

import re

import msgspec
import trio

from llmgw.engines.base import REUSE_MARKERS
from llmgw.http.client import UpstreamResponse
from llmgw.http.upstream_errors import UpstreamError
from llmgw.router import attempt
from llmgw.router.attempt import Lease
from llmgw.router.breaker import Outcome
from llmgw.router.record import ENDED, Ended, Record
from llmgw.router.resume import NotResumed
from llmgw.router.usage import Unasked
from llmgw.router.verdict import verdict

# Streamed tokens: the usage a stream reports (``stream_options.include_usage``),
# else the events that carry generated text, one token each on llama.cpp and vLLM
# (chat ``content``/``reasoning_content``, completions ``text``; empty ones not).
_STREAM_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_USAGE = b'"completion_tokens"'
_TEXT, _EMPTY_TEXT = b'content":"', b'content":""'  # chat: content, reasoning_content
_COMPLETION_TEXT, _EMPTY_COMPLETION = b'"text":"', b'"text":""'
DONE = b"data: [DONE]"
_TIMINGS, _CACHED = REUSE_MARKERS
_OFF = NotResumed("off", "")


class Relay:
    """The body of ``upstream``, relayed as it comes; ``outcome``: the breaker's, if it
    completes. ``why_not``: why a stream that breaks cannot go on elsewhere."""

    __slots__ = (
        "_cut",
        "_ended",
        "_first",
        "_lease",
        "_outcome",
        "_record",
        "_stream",
        "_text_events",
        "_unasked",
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
        why_not: NotResumed = _OFF,
        unasked: bool = False,
    ) -> None:
        """``unasked``: the engine was asked for the stream's usage and the client
        was not (``usage``): it is taken out of what the client gets."""
        self._upstream = upstream
        self._lease = lease
        self._outcome = outcome
        self._record = record
        self._stream = stream
        self._first = True
        self._ended = False
        self._text_events = 0
        self._usage = 0
        self._cut = ""  # why the stream was cut from outside (a wedged replica)
        self._why_not = why_not
        self._unasked = Unasked() if unasked else None
        if stream:
            lease.endpoint.streams.add(self)

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        unasked = self._unasked
        if unasked is None:
            return await self._read()
        while True:  # never an empty chunk: that would end the body
            try:
                shown = unasked.feed(await self._read())
            except StopAsyncIteration:
                if rest := unasked.rest():
                    return rest
                raise
            if shown:
                return shown

    async def _read(self) -> bytes:
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
            if self._unasked is not None:
                self._unasked.broke()  # a part of an event: the error event follows
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
            now = trio.current_time()
            self._record.first_token(now)
            self._lease.first_token(now)
        n = chunk.count(_TEXT)
        if n:
            if _EMPTY_TEXT in chunk:
                n -= chunk.count(_EMPTY_TEXT)
            self._text_events += n
        elif _COMPLETION_TEXT in chunk:
            self._text_events += chunk.count(_COMPLETION_TEXT) - chunk.count(_EMPTY_COMPLETION)
        # the usage event (which may come in one read with the last token's)
        if _USAGE in chunk and (found := _STREAM_USAGE.search(chunk)):
            self._usage = int(found[1])
            self._record.reply_says(chunk)  # the prompt's tokens, and what was reused
        elif _TIMINGS in chunk or (not n and _CACHED in chunk):
            self._record.reply_says(chunk)  # what the engine reused: llama.cpp's last event
        if DONE in chunk[-16:]:  # the last event: done on the replica
            self._lease.finish(trio.current_time(), self._outcome)

    def _reuse(self, data: bytes) -> None:
        """Note what the engine said of the prompt, when ``data`` says it."""
        if _TIMINGS in data or _CACHED in data or _USAGE in data:
            self._record.reply_says(data)

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
            record.tokens = self._tokens()
            record.end(now, self._ended_as(outcome))

    def _tokens(self) -> int:
        """The tokens the body carried, as the record counts them."""
        return self._usage or self._text_events

    def _ended_as(self, outcome: Outcome | None) -> Ended:
        """How the body ended, for the access log."""
        return ENDED[outcome]


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

"""Never drop a stream: a broken stream goes on from another replica of its engine.

Theory of operation
-------------------
A streamed chat or completion that can be carried on (``resume.plan``) is
relayed by a ``ResumableRelay`` with its ``Transcript`` (``llmgw.router.resume``)
and the router's ``Resumer``. The relay reads the stream event by event and
passes each on as the transcript rewrites it: the token ids the engine was asked
for are taken out again, and the transcript keeps what a continuation needs.

When the stream's replica fails after its head (a reset, a killed engine, a
stall past ``idle_timeout_s``, a replica found wedged), the relay tells the
replica and its breaker as ``Relay`` would, and asks the ``Resumer`` for a
continuation. The resumer picks another Ready replica of the same engine family
that the request has not tried (by load, past the admission thresholds: the
client is already waiting mid-stream), has it render the request
(``llmgw.router.render``) and asks its ``/v1/completions`` for the rest, all
within ``RESUME_TIMEOUT_S``; it tries at most ``max_attempts`` replicas. The
relay then reads the continuation's events, which the transcript rewrites into
the original's shape (``translate``), and the client reads one unbroken stream
under one id. A continuation that breaks in turn is carried on the same way.

What cannot be carried on ends with an error event in OpenAI's format that
says why (``cut_short``), and ``llmgw_router_streams_not_resumed`` counts it by
why: the transcript refuses (``Transcript.refused``), no other replica runs the
engine, the ones tried refused or failed, or the request is poison (its
continuation's engine died too: ``llmgw.router.poison``). A stream that broke
with its ``max_tokens`` reached is ended as the engine would have ended it.

The transcript changes only through its own methods; the relay feeds it what
arrives and the resumer what the new engine read.
"""

from __future__ import annotations

import logging

import msgspec
import trio

from llmgw import engines
from llmgw.http.client import UpstreamPool, UpstreamResponse
from llmgw.http.upstream_errors import UpstreamError, UpstreamReset
from llmgw.router import attempt, poison, resume
from llmgw.router.attempt import Lease, hostport
from llmgw.router.balancer import Admission, Endpoint, RetryBudget, choose
from llmgw.router.breaker import Outcome
from llmgw.router.record import ENDED, Ended, Record
from llmgw.router.relay import DONE, Relay, cut_short
from llmgw.router.render import Refused, render, said
from llmgw.router.resume import NotResumed, Transcript
from llmgw.router.table import RoutingTable
from llmgw.router.verdict import verdict

log = logging.getLogger("llmgw.router")

# rendering a broken stream's request on another replica, and that replica's head
RESUME_TIMEOUT_S = 10.0
# A continuation of a broken stream: the new replica's response and its lease, the
# last event of a stream that needs no more tokens, or why there is none
Continuation = tuple[UpstreamResponse, Lease] | bytes | NotResumed
_END = b"\n\n"
_JSON = ("content-type", "application/json")
_NO_THRESHOLDS = Admission()


class Resumer:
    """Finds broken streams their continuations, for every stream of one router."""

    __slots__ = ("_budget", "_poison", "_pool", "_table")

    def __init__(
        self, table: RoutingTable, pool: UpstreamPool, budget: RetryBudget, watch: poison.Watch
    ) -> None:
        self._table = table
        self._pool = pool
        self._budget = budget
        self._poison = watch

    async def carry_on(
        self, t: Transcript, record: Record, tried: set[str], body: bytes
    ) -> Continuation:
        """A broken stream's continuation from another Ready replica of its engine (one
        not ``tried`` yet, which it joins), or why there is none. ``body``: the client's
        request, remembered if it is found poison."""
        if record.poison:
            return self._crashed(body, record)
        if t.remaining() == 0:
            return t.ending()
        model = record.model
        same = [
            e for e in self._table.endpoints.get(model, []) if resume.family(e.engine) == t.family
        ]
        room = self._table.rooms(model)
        failures: list[str] = []
        for _ in range(self._budget.max_attempts):
            now = trio.current_time()
            suspect = record.suspect
            choice = choose(
                same,
                now,
                admission=_NO_THRESHOLDS,
                exclude=frozenset(tried),
                model=model,
                apart=suspect,
            )
            ep = choice.endpoint
            if ep is None:
                break
            tried.add(ep.key)
            lease = Lease(ep, now, room, suspect=suspect)
            try:
                found = await self._continue_on(ep, t)
            except BaseException:
                lease.finish(trio.current_time(), None)
                raise
            crashed = False
            if isinstance(found, UpstreamError):  # its engine died under it too?
                if attempt.failure(found) in poison.DEATHS:
                    crashed = record.died(ep.key, answered=t.id is not None, alone=lease.alone())
                found = f"failed: {type(found).__name__}: {found}"
            if isinstance(found, UpstreamResponse):
                log.info(
                    "stream %s of %s broke mid-way on replica %s; replica %s carries it on "
                    "from token %d",
                    t.id or "(not begun)",
                    model,
                    record.replica,
                    ep.key,
                    len(t.ids),
                )
                record.replica = ep.key
                return found, lease
            lease.finish(trio.current_time(), "upstream_fault")
            record.upstream_error(ep.key, "resume")
            failures.append(f"replica {ep.key} {found}")
            if crashed:
                return self._crashed(body, record)
        if failures:
            return NotResumed("refused", "; ".join(failures))
        return NotResumed("no_replica", f"no other Ready replica of {model} runs {t.family}")

    def _crashed(self, body: bytes, record: Record) -> NotResumed:
        why = self._poison.crashed(body, record, "its stream broke", trio.current_time())
        return NotResumed("poison", why)

    async def _continue_on(
        self, ep: Endpoint, t: Transcript
    ) -> UpstreamResponse | str | UpstreamError:
        """Ask ``ep`` for the rest of ``t``: its response, or what went wrong (in words,
        or the pool's exception)."""
        tokens = engines.tokens(ep.engine)
        if tokens is None:  # not so: ``carry_on`` asks only replicas of the stream's family
            return f"runs {ep.engine or 'an unknown engine'}, which gives no token ids"
        host, port = hostport(ep.url)
        headers = [_JSON]
        if ep.engine_key:
            headers.append(("authorization", f"Bearer {ep.engine_key}"))
        pool = self._pool

        async def ask(path: str, body: dict[str, object]) -> dict[str, object]:
            up = await pool.request("POST", host, port, path, headers, msgspec.json.encode(body))
            data = await up.read()
            if up.status != 200:
                raise Refused(f"answered {path} with {up.status}: {said(data)}")
            found = msgspec.json.decode(data)
            if not isinstance(found, dict):
                raise Refused(f"answered {path} with no JSON object")
            return found

        with trio.move_on_after(RESUME_TIMEOUT_S):
            try:
                prompt, ids = await render(ask, t, tokens)
                up = await pool.request(
                    "POST", host, port, "/v1/completions", headers, t.continuation(prompt, ids)
                )
            except UpstreamError as exc:
                return exc
            except Refused as exc:
                return str(exc)
            except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                return f"answered what it should not: {type(exc).__name__}: {exc}"
            if up.status == 200:
                return up
            data = await up.read()
            return f"refused the continuation with {up.status}: {said(data)}"
        return f"did not take the continuation within {RESUME_TIMEOUT_S:g} s"


class ResumableRelay(Relay):
    """A stream relayed event by event through its ``transcript``; when its replica
    fails, carried on by ``resumer`` from a replica the request has not ``tried``
    (see the module docstring). ``body``: the client's request."""

    __slots__ = (
        "_body",
        "_broke_at",
        "_buf",
        "_out",
        "_over",
        "_resumed",
        "_resumer",
        "_sent_at",
        "_transcript",
        "_translating",
        "_tried",
    )

    def __init__(
        self,
        upstream: UpstreamResponse,
        lease: Lease,
        outcome: Outcome,
        record: Record,
        transcript: Transcript,
        resumer: Resumer,
        tried: set[str],
        body: bytes,
    ) -> None:
        super().__init__(upstream, lease, outcome, record, stream=True)
        self._transcript = transcript
        self._resumer = resumer
        self._tried = tried
        self._body = body
        self._buf = b""  # an event not yet whole
        self._out: list[bytes] = []  # events ready for the client
        self._over = False  # nothing more comes from upstream
        self._translating = False  # the events come from a continuation
        self._resumed = False
        self._sent_at = 0.0  # when the last event was made ready for the client
        self._broke_at: float | None = None  # when the events stopped, until they go on

    async def __anext__(self) -> bytes:
        """The events ready for the client, read from upstream (and its successors)."""
        out = self._out
        while not out:
            if self._over:
                self._end(self._outcome)
                raise StopAsyncIteration
            try:
                chunk = await self._upstream.body_iter.__anext__()
            except StopAsyncIteration:
                if self._transcript.finished:
                    self._over = True  # ended as a stream ends (its [DONE] relayed)
                    if held := self._transcript.held() + self._buf:
                        out.append(held)
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
        self._lease.endpoint.chunks += 1  # heard from (see ``balancer.silent``)
        events = (self._buf + chunk).split(_END)
        self._buf = events.pop()
        now = trio.current_time()
        for event in events:
            if not event:
                continue
            if event.startswith(DONE):
                transcript.done()
                self._lease.finish(now, self._outcome)  # done on the replica
                self._out.append(transcript.held() + DONE + _END)
                continue
            if not self._translating:
                self._reuse(event)
            try:
                shown = (
                    transcript.translate(event) if self._translating else transcript.observe(event)
                )
            except (msgspec.DecodeError, TypeError, KeyError, AttributeError):
                shown = event  # not the JSON it should be: passed on as it came
            if shown is None and not transcript.holding:
                continue  # the usage the client did not ask for
            if self._first:  # (a stream whose first event is its last: held, but here)
                self._first = False
                self._record.first_token(now)
            if self._broke_at is not None:
                self._record.resumed(now - self._broke_at)
                self._broke_at = None
            self._sent_at = now
            if shown is not None:
                self._out.append(shown + _END)

    async def _broke(self, exc: UpstreamError) -> None:
        """The stream's replica failed: carry the stream on elsewhere, or end it with
        an error event that says why."""
        transcript = self._transcript
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
            self._out.append(transcript.held() + DONE + _END)
            self._over = True
            return
        found = transcript.refused() or await self._resumer.carry_on(
            transcript, self._record, self._tried, self._body
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
            self._out += (found + _END, DONE + _END)
            self._over = True
            return
        self._upstream, self._lease = found
        self._lease.endpoint.streams.add(self)
        self._translating = True
        self._resumed = True
        self._broke_at = self._sent_at or trio.current_time()

    def _tokens(self) -> int:
        return self._transcript.tokens

    def _ended_as(self, outcome: Outcome | None) -> Ended:
        return "resumed" if self._resumed and outcome == "success" else ENDED[outcome]

"""Sending a request to a replica of its model, and to another when the verdict allows.

Theory of operation
-------------------
A replica is chosen by load (``balancer.choose``) among those the request
has not tried yet, and the request goes to its engine over the lean
keep-alive pool, the body forwarded as it came. Each attempt ends in a
``verdict``, and the verdict alone says what the replica's breaker is told,
whether another replica may be tried (then within the per-request attempt
cap and, unless the verdict says the replica is gone or wedged, the router's
``RetryBudget``) and what the client gets. A response the verdict relays is
passed on as it arrives: a streamed body chunk by chunk (``Relay``), a whole
reply read first.

A suspect fault (one the request may have caused) is held, not told to the
breaker, until the next attempt ends: if that one fails the same way on
another replica the request is poison and gets its error, counted against
neither; otherwise, or when there is no next attempt, the held fault counts.
A client that leaves mid-way settles nothing: the held fault is dropped. An
engine's death is judged by who was in flight (``poison``): a request in
flight at two is poison, goes to no third replica, and its body is refused
for a while.

The client's ``Authorization`` (its key to the gateway) is never sent on; a
replica whose engine has a key of its own gets that one. An engine that
refuses it (401) has failed, as one that answers 502 has, and the request
may go to another replica: the client's key was good.

A chat or a completion of a model that routes by affinity has its prompt read
first (``prefix.prompt_key``): the balancer then prefers the replica holding the
most of it, within a load bound (``affinity``), and the prompt is recorded in the
index of the replica it is sent to. What the engine says it reused (a reply's
``timings`` or ``usage``) is noted on the record, which checks the index's
estimate against it.

When every replica's breaker refuses, the balancer picks the least bad one
(panic); the model's entering and leaving panic is logged once each, and
counted in ``llmgw_router_panic`` and ``llmgw_router_panic_routed``.

When every replica is above its admission thresholds the request waits up
to ``queue_timeout_s`` for room in its model's ``Room``, woken to choose again
the moment a request on one of the model's replicas ends, a replica's gauges
are read or the table changes (``llmgw.router.room``), then is shed with a 429
and Retry-After. When no replica can take it at all, the answer is a 503, or
the last failed attempt's 502 or 504.

A streamed chat or completion that can be carried on is relayed with a
``Transcript`` by a ``ResumableRelay`` (see ``llmgw.router.resumer``): when its
replica fails after the head, the router's ``Resumer`` has another Ready replica
of the same engine continue it, and the client reads one unbroken stream. A
whole reply whose body breaks is asked again, whole, of another replica, within
the retry budget (the verdict retries it). A replica found wedged cuts what it
holds: its streams go on elsewhere, and an attempt still waiting on it fails
over, as the verdict judges a cut (``Failure.WEDGED``).

A client that leaves mid-attempt cancels the handler: the pool has closed
the upstream connection, and the replica stops counting the request, with
no verdict for its breaker.
"""

from __future__ import annotations

import logging
import math

import msgspec
import trio

from llmgw.engines import adapter
from llmgw.http import Request, Response
from llmgw.http.client import UpstreamPool
from llmgw.http.upstream_errors import UpstreamError, UpstreamTimeout
from llmgw.router import attempt, poison, resume, usage, waits
from llmgw.router.affinity import placed
from llmgw.router.attempt import Lease, hostport
from llmgw.router.balancer import Admission, Choice, Endpoint, RetryBudget, choose
from llmgw.router.breaker import BreakerState
from llmgw.router.computing import Entry
from llmgw.router.errors import openai_error
from llmgw.router.fair import Shares
from llmgw.router.hold import Holds
from llmgw.router.pace import FLEET, fleet, held_bytes
from llmgw.router.prefix import PromptKey, prompt_key
from llmgw.router.record import Record
from llmgw.router.relay import Relay
from llmgw.router.resume import NotResumed, Transcript
from llmgw.router.resumer import ResumableRelay, Resumer
from llmgw.router.room import Room
from llmgw.router.table import RoutingTable
from llmgw.router.verdict import Failure, Verdict, poisoned, verdict

log = logging.getLogger("llmgw.router")

_STREAMED = {"/v1/chat/completions": True, "/v1/completions": False}  # path: chat?
_OFF = NotResumed("off", "resuming streams is off (router.resume_streams)")
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}
)
_NO_THRESHOLDS = Admission()


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Reply(msgspec.Struct):
    usage: _Usage | None = None


_reply_decoder = msgspec.json.Decoder(_Reply)


class _Attempt:
    """An attempt waiting on its replica, which a wedged replica cuts."""

    __slots__ = ("scope", "why")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.why = ""

    def cut(self, why: str) -> None:
        self.why = why
        self.scope.cancel()


class _Failed:
    """An attempt that gave the client nothing: its verdict, and why in words."""

    __slots__ = ("verdict", "why")

    def __init__(self, verdict: Verdict, why: str) -> None:
        self.verdict = verdict
        self.why = why


class Proxy:
    """Routes requests to the replicas in ``table`` (see the module docstring)."""

    def __init__(
        self,
        table: RoutingTable,
        pool: UpstreamPool,
        budget: RetryBudget,
        queue_timeout_s: float = 0.0,
        *,
        resume_streams: bool = True,
        holds: Holds | None = None,
    ) -> None:
        self.table = table
        self.holds = holds or Holds(table)  # requests for a model with no replica yet
        self.pool = pool
        self.budget = budget
        self.queue_timeout_s = queue_timeout_s
        self.resume_streams = resume_streams
        self._panicking: set[str] = set()  # models whose last pick was in panic
        self.poison = poison.Watch()  # bodies that crashed engines lately
        self.shares = Shares()  # tenants' recent tokens: who goes first in a full model
        table.rooms.value = lambda owner: self.shares.value(owner, table.weight(owner))
        self.resumer = Resumer(table, pool, budget, self.poison)  # broken streams go on

    async def __call__(self, request: Request, stream: bool, record: Record) -> Response:
        """The response to a routed request (``record.model``, ``record.started`` set).

        Sets ``record.replica`` when a replica's answer, or its failure, is the response.
        """
        model = record.model
        started = record.started
        assert started is not None
        if refused := self.poison.refuse(request.body, record, started):
            return refused
        endpoints = self.table.endpoints.get(model, [])
        admission = self.table.admission.get(model, _NO_THRESHOLDS)
        room = self.table.rooms(model)
        self.holds.arrived(model)  # a model that scales is in use
        tried: set[str] = set()
        headers = [
            (k, v)
            for k, v in request.headers
            if k not in _HOP and k != "authorization" and k != "host"
        ]
        self.budget.on_request(trio.current_time())
        plan: Transcript | NotResumed | None = None
        chat = _STREAMED.get(request.path)
        if stream and chat is not None:
            plan = resume.plan(request.body, chat) if self.resume_streams else _OFF
        mode = self.table.affinity.get(model, "off")
        key = None
        if chat is not None and mode != "off":
            key = prompt_key(request.body, mode, request.headers.get("x-session-id"))
        failed: _Failed | None = None
        held: Endpoint | None = None  # where ``failed``, a suspect fault, waits to be settled
        attempts = 0
        apart_until: float | None = None  # a suspect waits this long for a replica of its own
        place: int | None = None  # where it came among those waiting (``room``)
        while True:
            now = trio.current_time()
            suspect = record.suspect
            if len(room) and not suspect:  # others wait for room: those before it first
                if place is None:
                    place = room.place()
                if room.ahead(record.owner, place) and now < started + self.queue_timeout_s:
                    await _wait(room, record, started + self.queue_timeout_s, place)
                    endpoints = self.table.endpoints.get(model, [])
                    admission = self.table.admission.get(model, _NO_THRESHOLDS)
                    continue
            choice = choose(
                endpoints,
                now,
                admission=admission,
                exclude=frozenset(tried),
                model=model,
                key=key,
                apart=suspect,
                only=self.table.only,
            )
            if choice.crowded:
                if apart_until is None:
                    apart_until = now + poison.APART_S
                if now < apart_until:
                    await _wait(room, record, apart_until, None)
                    endpoints = self.table.endpoints.get(model, [])  # as it is now
                    continue
            ep = choice.endpoint
            if ep is None and failed is None:
                until = self.holds.until(model, endpoints, started)
                if until is not None:  # none started yet: held until one is (``hold``)
                    if now >= until or (not record.held and self.holds.full(model)):
                        return self.holds.refusal(model, now - started if record.held else 0.0)
                    if place is None:
                        place = room.place()
                    self.holds.begin(model, first=not record.held)
                    record.held = True
                    try:
                        await _wait(room, record, until, place)
                    finally:
                        self.holds.end(model)
                    endpoints = self.table.endpoints.get(model, [])
                    admission = self.table.admission.get(model, _NO_THRESHOLDS)
                    continue
            if ep is None:
                deadline = started + self.queue_timeout_s
                if choice.shed and trio.current_time() < deadline:
                    if place is None:
                        place = room.place()
                    elif tried:  # the room may be where it already failed: those after look
                        room.wake(after=place)
                    await _wait(room, record, deadline, place)  # a bounded time, in turn
                    endpoints = self.table.endpoints.get(model, [])  # as it is now
                    admission = self.table.admission.get(model, _NO_THRESHOLDS)
                    continue
                if choice.shed:
                    record.shed()
                    r = openai_error(
                        429,
                        f"every replica of {model} is busy: {choice.reason}",
                        "rate_limit_error",
                    )
                    r.headers.append(("retry-after", str(max(1, round(choice.retry_after_s)))))
                    return r
                if failed is not None:
                    _count(held, trio.current_time())  # no other replica to check it against
                    return _upstream_failed(model, failed)
                why = f"no replica of {model} can take requests now: {choice.reason}"
                return openai_error(503, why, "server_error")
            if choice.panic:
                self._panic(model, choice, record)
            elif self._panicking and ep.breaker.state is BreakerState.CLOSED:
                self._calm(model, record)
            attempts += 1
            tried.add(ep.key)
            if key is not None and choice.affinity is not None:
                record.affinity(ep, key, choice.affinity, first=attempts == 1)
                if key.blocks:
                    ep.prefix.record(key.blocks)
                if choice.affinity.work and attempts == 1:
                    placed(endpoints, ep, choice.affinity.work)
            lease = Lease(ep, now, room, suspect=suspect)
            record.sent_to(ep.key, now)
            if place is not None and len(room):
                room.wake()  # it took room: the next in turn looks (there may be more)
            try:
                if key is not None and choice.affinity is not None:
                    held_blocks = choice.affinity.held
                    lease.entry = await _enter(
                        lease, endpoints, key, held_blocks, stream, record, pin=self.table.only
                    )
                result = await self._attempt(request, headers, stream, lease, record, plan, tried)
            except BaseException:
                # The client left (or the server is stopping) mid-attempt. The pool
                # has closed the upstream; the replica must not go on counting this
                # request, nor its breaker a probe that will never end.
                lease.finish(trio.current_time(), None)
                raise
            now = trio.current_time()
            if isinstance(result, Response):
                _count(held, now)  # another replica answered: the held fault was its replica's
                return result
            if record.poison:  # in flight at a second engine's death
                record.replica = ep.key
                return self.poison.answer(request.body, record, result.why, now)
            if failed is not None and held is not None:
                if poisoned(failed.verdict, result.verdict):
                    record.replica = ep.key
                    return _upstream_failed(model, result, poison=(held.key, ep.key), record=record)
                _count(held, now)
            failed = result
            held = ep if failed.verdict.suspect is not None else None
            judged = failed.verdict
            if judged.retry and self.budget.can_retry(
                now, attempts=attempts, failover=judged.failover
            ):
                if not judged.failover:
                    self.budget.on_retry(now)
                record.retry()
                continue
            _count(held, now)  # no other replica to check it against
            record.replica = ep.key
            return _upstream_failed(model, failed)

    def _panic(self, model: str, choice: Choice, record: Record) -> None:
        record.metrics.panic_routed.labels(model).inc()
        if model not in self._panicking:
            self._panicking.add(model)
            record.metrics.panic.labels(model).set(1)
            log.warning(
                "%s; sending the model's requests there anyway until a breaker closes "
                "(see `llmgw ctl replicas` for why they opened)",
                choice.reason,
            )

    def _calm(self, model: str, record: Record) -> None:
        if model in self._panicking:
            self._panicking.discard(model)
            record.metrics.panic.labels(model).set(0)
            log.warning("model %s left panic: a replica's breaker is closed again", model)

    async def _attempt(
        self,
        request: Request,
        headers: list[tuple[str, str]],
        stream: bool,
        lease: Lease,
        record: Record,
        plan: Transcript | NotResumed | None,
        tried: set[str],
    ) -> Response | _Failed:
        """One try on one replica: the response, or the failure to judge.

        The lease is finished here or handed to the relay; an exception leaves
        it open for the caller."""
        ep = lease.endpoint
        if ep.engine_key:  # the client's authorization was its own, and is not sent on
            headers = [*headers, ("authorization", f"Bearer {ep.engine_key}")]
        body = request.body
        transcript: Transcript | None = None
        why_not = plan if isinstance(plan, NotResumed) else _OFF
        if isinstance(plan, Transcript):
            asking = plan.request(ep.engine)
            if asking is None:
                why_not = NotResumed(
                    "engine", f"its engine ({ep.engine or 'unknown'}) gives no token ids"
                )
            else:
                body, transcript = asking, plan  # asking for the usage too (``usage``)
        unasked = False
        if transcript is None and stream and request.path in _STREAMED:
            body, unasked = usage.ask(body)  # what it used, for its tenant's limits
        pin = lease.pin  # the slot the router chose, if it did (``llmgw.router.slotmap``)
        field = engine.slot_field if (engine := adapter(ep.engine)) is not None else None
        if pin is not None and pin.slot is not None and field:
            body = usage.lead(body, b'"%s":%d,' % (field.encode(), pin.slot))
        waiting = _Attempt()
        ep.streams.add(waiting)
        try:
            with waiting.scope:
                return await self._exchange(
                    request,
                    headers,
                    body,
                    stream,
                    lease,
                    record,
                    transcript,
                    why_not,
                    tried,
                    unasked,
                )
            return _fault(  # cut: the replica is wedged
                lease, record, UpstreamTimeout(waiting.why, "head"), Failure.WEDGED
            )
        except UpstreamError as exc:
            return _fault(lease, record, exc, attempt.failure(exc))
        finally:
            ep.streams.discard(waiting)

    async def _exchange(
        self,
        request: Request,
        headers: list[tuple[str, str]],
        body: bytes,
        stream: bool,
        lease: Lease,
        record: Record,
        transcript: Transcript | None,
        why_not: NotResumed,
        tried: set[str],
        unasked: bool,
    ) -> Response | _Failed:
        ep = lease.endpoint
        host, port = hostport(ep.url)
        upstream = await self.pool.request(request.method, host, port, request.path, headers, body)
        now = trio.current_time()
        record.first_byte(now)
        status = upstream.status
        if status == 401 and ep.engine_key:
            # the engine refused the key the router holds for it (an engine started
            # again under a new key the router has not heard of yet): the replica's
            # fault, tried elsewhere; never the client's 401, whose key was good
            upstream.body_iter.close()
            judged = verdict(502)
            _end(lease, judged)
            record.upstream_error(ep.key, "status_401")
            return _Failed(judged, f"replica {ep.key} refused the router's key for its engine")
        judged = verdict(status)
        if not judged.relayed:
            upstream.body_iter.close()
            _end(lease, judged)
            record.upstream_error(ep.key, f"status_{status}")
            return _Failed(judged, f"replica {ep.key} answered {status}")
        record.replica = ep.key
        out_headers = [(k, v) for k, v in upstream.headers if k not in _HOP]
        if stream or status >= 300:
            relay = (
                ResumableRelay(
                    upstream,
                    lease,
                    judged.outcome,
                    record,
                    transcript,
                    self.resumer,
                    tried,
                    request.body,
                )
                if transcript is not None and status < 300
                else Relay(upstream, lease, judged.outcome, record, stream, why_not, unasked)
            )
            return Response(status, out_headers, relay)
        try:
            data = await upstream.read()
        except UpstreamError as exc:
            return _fault(lease, record, exc, attempt.failure(exc), started=True)
        lease.finish(trio.current_time(), judged.outcome)
        record.tokens = _completion_tokens(data)
        record.reply_says(data)
        return Response(status, out_headers, data)


async def _wait(room: Room, record: Record, deadline: float, place: int | None) -> None:
    """Wait in the model's room (``Room.wait``) at ``place`` in its owner's line (None:
    in none), the time counted in the access log."""
    began = trio.current_time()
    try:
        if place is None:
            await room.wait(deadline)
        else:
            await room.wait(deadline, record.owner, place)
    finally:
        record.queued += trio.current_time() - began


async def _enter(
    lease: Lease,
    endpoints: list[Endpoint],
    key: PromptKey,
    held: int,
    stream: bool,
    record: Record,
    *,
    pin: bool,
) -> Entry | None:
    """Send the request to the lease's replica once a copy of the prompt it holds
    ``held`` blocks of there is idle (``llmgw.router.computing``), waiting at most as
    long as computing that again would cost by the replica's pace (its own, else its
    model's). None: its engine shares what is cached between running requests (or is
    not known), and the request goes at once. ``pin``: this router sends every request
    the replica has, and where its engine takes a slot for a request, the slot
    ``llmgw.router.slotmap`` chooses is named in it (``lease.pin``)."""
    ep = lease.endpoint
    engine = adapter(ep.engine)
    if engine is None or not engine.slot_cache:
        return None
    slots = math.floor(ep.load.slots) if ep.load is not None and ep.load.slots else 0
    entry: Entry | None = None
    waited = 0.0
    if not key.blocks:  # a prompt shorter than a block: nothing to wait for, or to hold
        idle = True
    elif ep.computing.free(key.blocks, held):  # the common case: nothing to wait for
        now = trio.current_time()
        entry, idle = ep.computing.enter(key.blocks, held, now, streamed=stream, slots=slots), True
    else:
        pace = fleet(ep.pace, (e.pace for e in endpoints))
        budget = FLEET * pace.saved_s(held_bytes(held, key.size, ep.prefix.kept))
        entry, waited, idle = await waits.enter(
            ep.computing, key.blocks, held, budget, streamed=stream, slots=slots
        )
        if waited:
            ep.computing.waits += 1
            record.waited(ep.key, waited, idle=idle)
    if pin and engine.slot_field and slots > 1:
        lease.pin = ep.slot_map.choose(
            key.blocks, slots, trio.current_time(), again=not idle, awaited=ep.computing.awaited
        )
        record.pinned(ep.key, lease.pin.slot, lease.pin.outcome)
        # in the engine (``ctl replicas``), once: a request that gave up waiting in the
        # router, and waits in the engine for its prompt's slot, counted when it waited
        ep.computing.waits += lease.pin.outcome == "waits" and not waited
    return entry


def _fault(
    lease: Lease, record: Record, exc: UpstreamError, failure: Failure, *, started: bool = False
) -> _Failed:
    """An attempt that ended in ``failure`` (the pool's ``exc``, or a cut of a replica
    found wedged): the replica and the metrics told, the verdict made."""
    judged = verdict(failure, started=started)
    _end(lease, judged)
    record.upstream_error(lease.endpoint.key, attempt.kind(exc))
    if failure in poison.DEATHS:  # the engine died with the request in flight
        answered = started or failure is Failure.RESET
        record.died(lease.endpoint.key, answered=answered, alone=lease.alone())
    return _Failed(judged, f"{type(exc).__name__}: {exc}")


def _end(lease: Lease, judged: Verdict) -> None:
    """A failed attempt's end; a suspect fault is held for the next attempt to settle."""
    lease.finish(trio.current_time(), None if judged.suspect is not None else judged.outcome)


def _count(held: Endpoint | None, now: float) -> None:
    """A held suspect fault is settled as its replica's."""
    if held is not None:
        held.breaker.on_upstream_fault(now)


def _upstream_failed(
    model: str,
    failed: _Failed,
    *,
    poison: tuple[str, str] | None = None,
    record: Record | None = None,
) -> Response:
    if poison is not None:
        suspect = failed.verdict.suspect
        if record is not None and suspect is not None:
            record.metrics.poisoned.labels(model, suspect.value).inc()
        log.warning(
            "request for %s failed the same way on replicas %s and %s (%s): taken for the "
            "request's own fault, counted against neither",
            model,
            *poison,
            failed.why,
        )
        return openai_error(
            failed.verdict.status,
            f"the request failed the same way on two replicas of {model}: {failed.why}",
            "server_error",
        )
    log.warning("request for %s failed upstream: %s", model, failed.why)
    return openai_error(
        failed.verdict.status,
        f"the replicas of {model} did not answer: {failed.why}",
        "server_error",
    )


def _completion_tokens(data: bytes) -> int:
    """The completion tokens a whole reply reports in its usage (0: none)."""
    try:
        usage = _reply_decoder.decode(data).usage
    except msgspec.DecodeError:
        return 0
    return 0 if usage is None else usage.completion_tokens

"""Tenants' limits at this router, spent from leases of the control plane's.

Theory of operation
-------------------
A key that belongs to a tenant (``llmgw.controlplane.tenants``) is held to its
tenant's limits and to its own, each optional (``llmgw.routing.Limits``):
every key of a tenant counts against the tenant's. The control plane holds
each limit for every router at once (``llmgw.controlplane.leases``); this
router spends leases of it, each limit of each owner a ``_Pot`` here:

- ``rpm``: one unit a request, from grants this router may spend for their
  ``ttl_s`` (what is left then goes back);
- ``tpm``, ``budget_day``, ``budget_month``: tokens, prompt and completion.
  Reserve, then settle: once the body is read (``Ticket.reserve``) the request
  reserves its worst case, its prompt (a third of its body's bytes, more than a
  tokenizer makes of any text but a few scripts) and its
  ``max_completion_tokens`` or ``max_tokens`` (``UNBOUNDED`` without either),
  so that concurrent requests see each other and a burst cannot overspend. At
  its end (``Ticket.settle``) what the engine said it used (a stream cut or
  carried on elsewhere: what was generated) replaces the reservation, and
  what was reserved and not used returns to the pot;
- ``in_flight``: slots this router holds, one taken by each request until it
  ends.

``Quotas.admit`` judges a request by its head, ``Ticket.reserve`` by its body:
each takes what it needs from every pot at once (no await, so the next
request sees it), or says which limit refuses it (a ``Refusal``: the control
plane denied what it needed), or that a pot is ``Short``: the request waits
for the next exchange with the control plane (``router.leases``) and is
judged again. ``exchange_out`` says what this router asks (what waiting
requests need, and what it will spend in the next ``AHEAD_S`` at the rate of
the last ``RATE_S``, or of as long as it has been spending: ``_Pot.rate``) and
gives back (grants past their time, slots it no longer uses, a budget its
tenant has not touched for ``IDLE_S``);
``exchange_in`` takes the answer. Keys of a config file belong to no tenant
and are held to nothing here.

Pure: no I/O, no trio; time comes in as ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence

import attrs

from llmgw.router.keys import ApiKey
from llmgw.router.tally import Tally
from llmgw.routing import (
    BUDGETS,
    LIMIT_NAMES,
    LeaseAnswer,
    LeaseAsk,
    LeaseBack,
    LeaseExchange,
    LeaseHold,
    Limits,
)

MINUTE = 60.0
# completion tokens reserved for a request that bounds neither max_tokens nor
# max_completion_tokens (the engine's context is not known here)
UNBOUNDED = 4096
BYTES_PER_TOKEN = 3  # the prompt's reservation: its body's bytes over this
AHEAD_S = 2.0  # ask for what this router will spend this far ahead
RATE_S = 5.0  # at the rate it spent over this long
RATE_MIN_S = 0.25  # or over as long as it has been spending, this long at least
IDLE_S = 5.0  # a pot untouched this long gives back what it holds
SPARE_SLOTS = 1  # in flight: slots held beyond those in use, while busy
CONTENDED_S = 3.0  # keep nothing ahead of a limit the control plane says is contended
# a need the control plane denied for good is refused here without asking again for
# this long (what other routers give back, or a window that empties, may meet it after)
DENIED_S = 1.0
_TOKENS = ("tpm", *BUDGETS)


def prompt_estimate(body_bytes: int) -> int:
    """A prompt's tokens as told before any engine has read it: at most its body's
    bytes over ``BYTES_PER_TOKEN``, plus one (never fewer than it has)."""
    return body_bytes // BYTES_PER_TOKEN + 1


@attrs.define(eq=False)
class _Chunk:
    grant: int  # the control plane's id for it
    units: int  # left to spend
    expires: float


@attrs.define(eq=False)
class _Pot:
    """One limit of one owner at this router: what it holds, spends and needs."""

    scope: str
    owner: str
    kind: str
    chunks: deque[_Chunk] = attrs.Factory(deque)
    slots: int = 0  # in flight: held
    in_use: int = 0  # in flight: taken by requests
    reserved: int = 0  # tokens: reserved by requests in flight (what they do not use returns)
    needed: int = 0  # units requests wait on now
    spent: deque[tuple[float, int]] = attrs.Factory(deque)  # recent spending
    touched: float = -math.inf
    left: int | None = None  # what the limit had left at the last grant
    denied: float = -math.inf  # until when the control plane said there is no room
    retry_after: float = 0.0
    asked: int = 0  # the need beyond what it held, as last asked
    denied_units: int = 0  # the need it said no room for (a smaller one may fit)
    # the control plane said another router waits on this limit: keep nothing ahead
    contended: float = -math.inf  # until
    # it denied a need while others held enough unspent: the limit and when
    soft: tuple[float, float] | None = None  # (when, retry_after)
    back: list[tuple[int, int]] = attrs.Factory(list)  # (grant, units) to give back
    peaks: deque[tuple[float, int]] = attrs.Factory(deque)  # in flight: (when, in use)

    def have(self, now: float) -> int:
        """Units spendable now (grants past their time set aside to give back)."""
        if self.kind == "in_flight":
            return self.slots - self.in_use
        while self.chunks and self.chunks[0].expires <= now:
            gone = self.chunks.popleft()
            if gone.units:
                self.back.append((gone.grant, gone.units))
        return sum(c.units for c in self.chunks)

    def take(self, units: int, now: float) -> list[tuple[_Chunk, int]]:
        """Spend ``units`` (as many as there are, beyond: a request that used more
        than it reserved), the oldest grants first: what was taken from which."""
        self.touched = now
        self.spent.append((now, units))
        if self.kind == "in_flight":
            self.in_use += units
            if not self.peaks or self.peaks[-1][1] < self.in_use or self.peaks[-1][0] < now - 1:
                self.peaks.append((now, self.in_use))
            return []
        taken = []
        for chunk in self.chunks:
            n = min(chunk.units, units)
            if n:
                chunk.units -= n
                units -= n
                taken.append((chunk, n))
            if not units:
                break
        return taken

    def refund(self, units: int, now: float, taken: Sequence[tuple[_Chunk, int]] = ()) -> None:
        """Reserved and not used: back to the grants it was taken from, where they are
        still live (a grant past its time was given back without it: it stays spent),
        so that what a router gives back of a grant is never more than it was."""
        if self.kind == "in_flight":
            self.in_use = max(0, self.in_use - units)
            self.touched = now
            return
        for chunk, n in reversed(taken):
            if units <= 0:
                return
            if chunk.expires > now and chunk in self.chunks:
                chunk.units += min(n, units)
            units -= n

    def ask(self, now: float) -> LeaseAsk | None:
        while self.spent and self.spent[0][0] < now - RATE_S:
            self.spent.popleft()
        have = self.have(now)
        calm = now >= self.contended
        if self.kind == "in_flight":
            busy = (self.in_use or self.needed) and calm
            peak = self.peak(now) if calm else 0
            spare = SPARE_SLOTS if busy else 0
            want = max(self.in_use + self.needed, peak) + spare - self.slots
        else:
            ahead = math.ceil(self.rate(now) * AHEAD_S) if calm else 0
            want = self.needed + ahead - have
        needed = max(0, self.needed - max(have, 0))
        if (want <= 0 and not needed) or (not needed and now < self.denied):
            return None
        self.asked = needed
        return LeaseAsk(
            scope=self.scope,
            owner=self.owner,
            kind=self.kind,
            units=max(want, needed),
            needed=needed,
        )

    def rate(self, now: float) -> float:
        """Units spent a second lately: over the last ``RATE_S``, or over as long as it
        has been spending, when that is shorter (``RATE_MIN_S`` at least), so that a
        tenant that starts to send is not judged by the idle seconds before it."""
        if not self.spent:
            return 0.0
        span = min(RATE_S, max(RATE_MIN_S, now - self.spent[0][0]))
        return sum(n for _, n in self.spent) / span

    def backs(self, now: float) -> Iterator[LeaseBack]:
        """What to give back: grants past their time, slots not in use, and what an
        idle pot holds."""
        have = self.have(now)
        idle = now - self.touched >= IDLE_S and not self.needed
        calm = now >= self.contended
        if self.kind == "in_flight":
            spare = SPARE_SLOTS if not idle and self.in_use and calm else 0
            peak = self.peak(now) if calm and not idle else 0
            keep = max(self.in_use + self.needed, peak) + spare
            if self.slots > keep:
                self.back.append((0, self.slots - keep))
                self.slots = keep
        elif idle:
            self.back += [(c.grant, c.units) for c in self.chunks if c.units]
            self.chunks.clear()
        elif not calm and have > self.needed:  # another router waits: keep only the need
            extra = have - self.needed
            for chunk in reversed(self.chunks):
                n = min(chunk.units, extra)
                if n:
                    chunk.units -= n
                    extra -= n
                    self.back.append((chunk.grant, n))
        for grant, units in self.back:
            yield LeaseBack(
                scope=self.scope, owner=self.owner, kind=self.kind, units=units, grant=grant
            )
        self.back = []

    def peak(self, now: float) -> int:
        """In flight: the most requests in use at once over the last ``RATE_S`` (slots
        held for them, so that a steady load does not ask for a slot each request)."""
        while self.peaks and self.peaks[0][0] < now - RATE_S:
            self.peaks.popleft()
        return max((n for _, n in self.peaks), default=0)

    def unspent(self, now: float) -> LeaseHold | None:
        have = self.have(now)
        if have <= 0 and not self.reserved:
            return None
        return LeaseHold(
            scope=self.scope,
            owner=self.owner,
            kind=self.kind,
            units=max(have, 0),
            reserved=self.reserved,
        )

    def holds(self) -> bool:
        return bool(
            self.slots or self.chunks or self.back or self.needed or self.in_use or self.reserved
        )


@attrs.frozen
class Refusal:
    """Why a request is refused: the limit, whose, and in how long to try again."""

    limit: str  # a field of ``Limits``
    scope: str  # "tenant" or "key"
    owner: str  # the tenant's or key's name
    value: int  # the limit
    retry_after_s: float
    tenant: str
    asked: int = 0  # tokens the request reserved
    why: str = ""  # said instead of the limit's words (the control plane away)
    # not spent but held for now: by other routers, or reserved by requests in flight
    # (what they do not use comes back); a budget so held is not said to be used up
    held: bool = False

    @property
    def budget(self) -> bool:
        """A budget used up: OpenAI's ``insufficient_quota``."""
        return self.limit in BUDGETS and not self.held

    @property
    def message(self) -> str:
        if self.why:
            return self.why
        what = LIMIT_NAMES[self.limit]
        about = f"{self.scope} {self.owner!r}"
        if self.limit in _TOKENS and self.asked > self.value:
            return (
                f"the request may use up to {self.asked} tokens (its prompt and max_tokens), "
                f"more than {about}'s limit of {self.value} {what}: lower max_tokens"
            )
        show = f"(llmgw ctl tenant show {self.tenant} shows its limits)"
        if self.held:  # a budget's requests in flight give back too (``leases``)
            noun, by = (
                ("budget", "other routers and by its requests in flight")
                if self.limit in BUDGETS
                else ("limit", "other routers")
            )
            return (
                f"{about}: its {noun} of {self.value} {what} is held for now by {by}, "
                f"which give back what they do not use: try again in a second {show}"
            )
        if self.budget:
            return (
                f"{about} has used its budget of {self.value} {what}: it resets in "
                f"{_duration(self.retry_after_s)} {show}"
            )
        when = (
            "try again when one of them ends"
            if self.limit == "in_flight"
            else f"it resets in {self.retry_after_s:.0f} s"
        )
        return f"{about} is at its limit of {self.value} {what}: {when} {show}"


def _duration(s: float) -> str:
    if s >= 5400:
        return f"{s / 3600:.0f} h"
    if s >= 90:
        return f"{s / 60:.0f} min"
    return f"{s:.0f} s"


@attrs.frozen
class Short:
    """What a request needs that this router does not hold yet: (pot, units, the
    limit) each."""

    needs: tuple[tuple[_Pot, int, int], ...]
    tenant: str

    def waits(self) -> bool:
        """Whether a need was denied while other routers give back what would meet it:
        ask again in a moment rather than refuse."""
        return any(pot.soft is not None for pot, _, _ in self.needs)

    def denied(self) -> Refusal | None:
        """Out of time, waiting for other routers to give back: the limit refuses it,
        for now (what they hold, or requests in flight reserved, may come back)."""
        for pot, units, limit in self.needs:
            if pot.soft is not None:
                return Refusal(
                    pot.kind, pot.scope, pot.owner, limit, 1.0, self.tenant, units, held=True
                )
        return None

    def refusal(self, failure: str) -> Refusal:
        """No exchange went through (``failure`` says why): the request cannot be
        admitted without spending what this router was not granted."""
        pot, units, limit = self.needs[0]
        return Refusal(
            pot.kind,
            pot.scope,
            pot.owner,
            limit,
            5.0,
            self.tenant,
            units,
            why=(
                f"this router holds no more of {pot.scope} {pot.owner!r}'s limit of {limit} "
                f"{LIMIT_NAMES[pot.kind]} and cannot ask for more: {failure}; try again in a "
                "few seconds"
            ),
        )


@attrs.define
class Ticket:
    """What an admitted request holds until it ends: its tokens settled, and
    ``release`` once, at its end."""

    scopes: list[tuple[str, str, Limits]]  # (scope, owner, limits) it is held to
    tenant: str = ""
    slots: list[_Pot] = attrs.Factory(list)  # in flight: one slot taken in each
    released: bool = False
    reserved: list[tuple[_Pot, list[tuple[_Chunk, int]]]] = attrs.Factory(list)
    asked: int = 0  # tokens reserved
    prompt: int = 0  # of which, the prompt's estimate
    headers_: list[tuple[str, str]] = attrs.Factory(list)
    # where what it used is counted, once it was sent to an engine of ``model``
    tally: Tally | None = None
    model: str = ""

    def settle(self, prompt: int, completion: int, now: float) -> None:
        """What the request used (``prompt`` 0: the engine did not say; the estimate
        stands) replaces what it reserved."""
        used = (prompt or self.prompt) + completion
        if self.tally is not None and self.model:
            self.tally.answered(self.tenant, self.model, prompt or self.prompt, completion)
            self.tally = None
        for pot, taken in self.reserved:
            pot.reserved = max(0, pot.reserved - self.asked)
            if used < self.asked:
                pot.refund(self.asked - used, now, taken)
            elif used > self.asked:
                pot.take(used - self.asked, now)
        self.reserved = []

    def release(self, now: float) -> None:
        if not self.released:
            self.released = True
            for pot in self.slots:
                pot.refund(1, now)

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's rate-limit headers, for the per-minute limits it is held to."""
        return self.headers_


_NAMES = {
    what: (
        f"x-ratelimit-limit-{what}",
        f"x-ratelimit-remaining-{what}",
        f"x-ratelimit-reset-{what}",
    )
    for what in ("requests", "tokens")
}
_RESET = f"{MINUTE:.0f}s"


def _headers(what: str, limit: int, remaining: int) -> list[tuple[str, str]]:
    limit_, remaining_, reset = _NAMES[what]  # every request's: made once
    return [(limit_, str(limit)), (remaining_, str(max(0, remaining))), (reset, _RESET)]


def ratelimit_headers(refusal: Refusal) -> list[tuple[str, str]]:
    """The headers of a per-minute refusal: nothing left, and when there is."""
    what = {"rpm": "requests", "tpm": "tokens"}.get(refusal.limit)
    if what is None:
        return []
    return [
        (f"x-ratelimit-limit-{what}", str(refusal.value)),
        (f"x-ratelimit-remaining-{what}", "0"),
        (f"x-ratelimit-reset-{what}", f"{max(0.0, refusal.retry_after_s):.3g}s"),
    ]


class Quotas:
    """Every tenant's and tenant key's pots at this router."""

    def __init__(self) -> None:
        self._pots: dict[tuple[str, str, str], _Pot] = {}  # (scope, owner, kind)

    def _pot(self, scope: str, owner: str, kind: str) -> _Pot:
        pot = self._pots.get((scope, owner, kind))
        if pot is None:
            pot = self._pots[scope, owner, kind] = _Pot(scope, owner, kind)
        return pot

    def _judge(
        self, ticket: Ticket, kinds: tuple[str, ...], units: int, now: float
    ) -> Refusal | Short | list[_Pot]:
        """The pots that take ``units`` now, or why not."""
        pots: list[_Pot] = []
        short: list[tuple[_Pot, int, int]] = []
        for scope, owner, limits in ticket.scopes:
            for kind in kinds:
                limit = getattr(limits, kind)
                if limit is None:
                    continue
                pot = self._pot(scope, owner, kind)
                if kind in _TOKENS and units > limit:  # it can never fit
                    return Refusal(kind, scope, owner, limit, 0.0, ticket.tenant, units)
                have = pot.have(now)
                if have >= units:
                    pots.append(pot)
                elif now < pot.denied and units - have >= pot.denied_units:
                    return Refusal(kind, scope, owner, limit, pot.retry_after, ticket.tenant, units)
                else:
                    short.append((pot, units, limit))
        return Short(tuple(short), ticket.tenant) if short else pots

    def admit(
        self, key: ApiKey, tenants: Mapping[str, Limits], now: float
    ) -> Ticket | Refusal | Short:
        """Count a request of ``key`` (``tenants``: each tenant's limits, as the control
        plane says now), or say which limit refuses it, or what it waits on."""
        if not key.tenant:  # a config file's key: nothing counted
            return Ticket([])
        scopes = [("tenant", key.tenant, tenants.get(key.tenant)), ("key", key.name, key.limits)]
        ticket = Ticket([(s, o, lim) for s, o, lim in scopes if lim is not None], key.tenant)
        judged = self._judge(ticket, ("in_flight", "rpm"), 1, now)
        if not isinstance(judged, list):
            return judged
        for pot in judged:
            pot.take(1, now)
            if pot.kind == "in_flight":
                ticket.slots.append(pot)
        ticket.headers_ += self._shown(ticket, "rpm", "requests", now)
        return ticket

    def reserve(
        self, ticket: Ticket, prompt_bytes: int, completion: int | None, now: float
    ) -> Refusal | Short | None:
        """Reserve the request's worst case against every token limit it is held to,
        or say which refuses it or what it waits on (nothing reserved then)."""
        ticket.prompt = prompt_estimate(prompt_bytes)
        ticket.asked = ticket.prompt + (UNBOUNDED if completion is None else max(completion, 0))
        judged = self._judge(ticket, _TOKENS, ticket.asked, now)
        if not isinstance(judged, list):
            return judged
        ticket.reserved = [(pot, pot.take(ticket.asked, now)) for pot in judged]
        for pot in judged:
            pot.reserved += ticket.asked
        ticket.headers_ += self._shown(ticket, "tpm", "tokens", now)
        return None

    def _shown(self, ticket: Ticket, kind: str, what: str, now: float) -> list[tuple[str, str]]:
        """The headers of the tightest of ``kind`` the ticket is held to."""
        tightest: tuple[int, int] | None = None
        for scope, owner, limits in ticket.scopes:
            limit = getattr(limits, kind)
            if limit is not None:
                pot = self._pot(scope, owner, kind)
                left = pot.have(now) + (limit if pot.left is None else pot.left)
                if tightest is None or left < tightest[1]:
                    tightest = (limit, min(left, limit))
        return [] if tightest is None else _headers(what, *tightest)

    def wait(self, short: Short, by: int) -> None:
        """Requests start (``by`` 1) or stop (-1) waiting on what ``short`` needs."""
        for pot, units, _ in short.needs:
            pot.needed = max(0, pot.needed + by * units)

    def exchange_out(self, router: str, now: float) -> LeaseExchange:
        """What this router asks and gives back now."""
        asks = [a for pot in self._pots.values() if (a := pot.ask(now)) is not None]
        backs = [b for pot in self._pots.values() for b in pot.backs(now)]
        holds = [h for pot in self._pots.values() if (h := pot.unspent(now)) is not None]
        for key in [k for k, pot in self._pots.items() if not pot.holds() and not pot.spent]:
            del self._pots[key]
        return LeaseExchange(router=router, asks=asks, backs=backs, holds=holds)

    def exchange_in(self, answer: LeaseAnswer, sent: float) -> bool:
        """What the control plane answered an exchange sent at ``sent``; True when
        another router waits on a limit this one holds more of than it needs: give
        it back now, rather than at the next exchange."""
        for g in answer.grants:
            pot = self._pot(g.scope, g.owner, g.kind)
            pot.left = g.left
            pot.denied, pot.soft = -math.inf, None
            if g.kind == "in_flight":
                pot.slots += g.units
            else:
                pot.chunks.append(_Chunk(g.grant, g.units, sent + g.ttl_s))
        for d in answer.denied:
            pot = self._pot(d.scope, d.owner, d.kind)
            pot.left = 0
            if d.final:  # remembered a moment: others give back, windows empty
                pot.denied = sent + min(d.retry_after_s, DENIED_S)
                pot.retry_after, pot.denied_units = d.retry_after_s, pot.asked
            else:  # others hold it unspent, and give it back: ask again in a moment
                pot.soft = (sent, d.retry_after_s)
        again = False
        for c in answer.contended:
            pot = self._pot(c.scope, c.owner, c.kind)
            calm = sent >= pot.contended
            pot.contended = sent + CONTENDED_S
            again |= calm and pot.have(sent) > pot.needed
        return again

    def unsent(self, ex: LeaseExchange) -> None:
        """An exchange that did not reach the control plane: what it gave back is
        given back with the next."""
        for b in ex.backs:
            pot = self._pot(b.scope, b.owner, b.kind)
            if b.kind == "in_flight":
                pot.slots += b.units  # still held there: given back again next time
            else:
                pot.back.append((b.grant, b.units))

    def holding(self) -> bool:
        """Whether this router holds anything the control plane counts."""
        return any(pot.holds() for pot in self._pots.values())

    def everything_back(self, router: str, now: float) -> LeaseExchange:
        """All it holds, given back (a router stopping)."""
        for pot in self._pots.values():
            pot.touched = -math.inf
            pot.needed = 0
        return LeaseExchange(
            router=router, backs=[b for pot in self._pots.values() for b in pot.backs(now)]
        )

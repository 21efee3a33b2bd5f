"""Tenants' limits, held exactly by this router: requests in flight, requests and
tokens a minute.

Theory of operation
-------------------
A key that belongs to a tenant (``llmgw.controlplane.tenants``) is held to its
tenant's limits and to its own, each optional (``llmgw.routing.Limits``):
every key of a tenant counts against the tenant's. ``Quotas.admit`` judges a
request as it arrives, before its body is read: within every limit it gets a
``Ticket`` and counts at once (the next request sees it, under no await), and
the ticket is handed back when the request ends, whatever the end; past one, a
``Refusal`` that names the limit, whose it is, and when to try again.

- ``in_flight``: requests at once; a ticket holds one until it is handed back.
- ``rpm``: requests begun in the last 60 s (a sliding minute, kept as the
  times they began); the oldest leaving the window is when there is room.
- ``tpm``: tokens, prompt and completion, in the last 60 s. Reserve, then
  settle: once the body is read (``Ticket.reserve``) the request reserves its
  worst case, its prompt (a third of its body's bytes, more than a tokenizer
  makes of any text but a few scripts) and its ``max_completion_tokens`` or
  ``max_tokens`` (``UNBOUNDED`` without either); concurrent requests see each
  other's reservations, so a burst cannot overspend. At its end
  (``Ticket.settle``) the reservation becomes what the engine said it used
  (its prompt tokens and the tokens it generated, as the record holds them: a
  stream cut or carried on from another replica counts what was generated), the
  prompt as estimated where the engine did not say.

What a router counts is its own: a tenant sending through two routers is held
to its limits at each (leases of a shared allowance are the next step). Keys
of a config file belong to no tenant and have no limits here.

Pure: no I/O, no trio; time comes in as ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import attrs

from llmgw.router.keys import ApiKey
from llmgw.router.tally import Tally
from llmgw.routing import LIMIT_NAMES, Limits

MINUTE = 60.0
# completion tokens reserved for a request that bounds neither max_tokens nor
# max_completion_tokens (the engine's context is not known here)
UNBOUNDED = 4096
BYTES_PER_TOKEN = 3  # the prompt's reservation: its body's bytes over this


@attrs.define(eq=False)
class _Spent:
    """Tokens counted at ``when``: a reservation until settled."""

    when: float
    tokens: int
    counted: bool = True  # still in the window's total


@attrs.define
class _Usage:
    in_flight: int = 0
    begun: deque[float] = attrs.Factory(deque)  # when each request of the last minute began
    spent: deque[_Spent] = attrs.Factory(deque)  # tokens of the last minute
    tokens: int = 0  # their sum

    def prune(self, now: float) -> None:
        while self.begun and self.begun[0] <= now - MINUTE:
            self.begun.popleft()
        while self.spent and self.spent[0].when <= now - MINUTE:
            gone = self.spent.popleft()
            gone.counted = False
            self.tokens -= gone.tokens

    def room_in(self, tokens: int, limit: int, now: float) -> float:
        """Seconds until ``tokens`` more fit under ``limit``, as the window empties."""
        over = self.tokens + tokens - limit
        for s in self.spent:
            over -= s.tokens
            if over <= 0:
                return max(s.when + MINUTE - now, 0.001)
        return MINUTE


@attrs.frozen
class Refusal:
    """Why a request is refused: the limit, whose, and in how long to try again."""

    limit: str  # "rpm", "tpm", "in_flight"
    scope: str  # "tenant" or "key"
    owner: str  # the tenant's or key's name
    value: int  # the limit
    retry_after_s: float
    tenant: str
    asked: int = 0  # tokens the request reserved (tpm)

    @property
    def message(self) -> str:
        what = LIMIT_NAMES[self.limit]
        about = f"{self.scope} {self.owner!r}"
        if self.limit == "tpm" and self.asked > self.value:
            return (
                f"the request may use up to {self.asked} tokens (its prompt and max_tokens), "
                f"more than {about}'s limit of {self.value} {what}: lower max_tokens"
            )
        when = (
            "try again when one of them ends"
            if self.limit == "in_flight"
            else f"it resets in {self.retry_after_s:.0f} s"
        )
        return (
            f"{about} is at its limit of {self.value} {what}: {when} "
            f"(llmgw ctl tenant show {self.tenant} shows its limits)"
        )


@attrs.define
class Ticket:
    """What an admitted request holds until it ends: its tokens settled, and
    ``release`` once, at its end."""

    usages: list[tuple[_Usage, Limits, str, str]]  # with its limits, scope and owner
    tenant: str = ""
    released: bool = False
    reserved: list[tuple[_Usage, _Spent]] = attrs.Factory(list)
    asked: int = 0  # tokens reserved
    prompt: int = 0  # of which, the prompt's estimate
    headers_: list[tuple[str, str]] = attrs.Factory(list)
    # where what it used is counted, once it was sent to an engine of ``model``
    tally: Tally | None = None
    model: str = ""

    def reserve(self, prompt_bytes: int, completion: int | None, now: float) -> Refusal | None:
        """Reserve the request's worst case against every tokens-per-minute limit it is
        held to, or say which refuses it (nothing reserved then)."""
        self.prompt = prompt_bytes // BYTES_PER_TOKEN + 1
        self.asked = self.prompt + (UNBOUNDED if completion is None else max(completion, 0))
        for usage, limits, scope, owner in self.usages:
            if limits.tpm is None:
                continue
            usage.prune(now)
            if usage.tokens + self.asked > limits.tpm:
                wait = usage.room_in(self.asked, limits.tpm, now)
                return Refusal("tpm", scope, owner, limits.tpm, wait, self.tenant, self.asked)
        tightest: tuple[int, int, float] | None = None
        for usage, limits, _, _ in self.usages:
            if limits.tpm is None:
                continue
            spent = _Spent(now, self.asked)
            usage.spent.append(spent)
            usage.tokens += self.asked
            self.reserved.append((usage, spent))
            left = limits.tpm - usage.tokens
            if tightest is None or left < tightest[1]:
                tightest = (limits.tpm, left, usage.spent[0].when + MINUTE - now)
        if tightest is not None:
            limit, left, reset = tightest
            self.headers_ += _headers("tokens", limit, left, reset)
        return None

    def settle(self, prompt: int, completion: int) -> None:
        """What the request used (``prompt`` 0: the engine did not say; the estimate
        stands) replaces what it reserved."""
        used = (prompt or self.prompt) + completion
        if self.tally is not None and self.model:
            self.tally.answered(self.tenant, self.model, prompt or self.prompt, completion)
            self.tally = None
        for usage, spent in self.reserved:
            if spent.counted:  # still in the window: its total moves with it
                usage.tokens += used - spent.tokens
            spent.tokens = used
        self.reserved = []

    def release(self) -> None:
        if not self.released:
            self.released = True
            for usage, _, _, _ in self.usages:
                usage.in_flight -= 1

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's rate-limit headers, for the per-minute limits it is held to."""
        return self.headers_


def _headers(what: str, limit: int, remaining: int, reset_s: float) -> list[tuple[str, str]]:
    return [
        (f"x-ratelimit-limit-{what}", str(limit)),
        (f"x-ratelimit-remaining-{what}", str(max(0, remaining))),
        (f"x-ratelimit-reset-{what}", f"{max(0.0, reset_s):.3g}s"),
    ]


def ratelimit_headers(refusal: Refusal) -> list[tuple[str, str]]:
    """The headers of a per-minute refusal: nothing left, and when there is."""
    what = {"rpm": "requests", "tpm": "tokens"}.get(refusal.limit)
    return [] if what is None else _headers(what, refusal.value, 0, refusal.retry_after_s)


class Quotas:
    """Every tenant's and tenant key's usage at this router, against their limits."""

    def __init__(self) -> None:
        self._usage: dict[tuple[str, str], _Usage] = {}  # (scope, name)

    def admit(self, key: ApiKey, tenants: Mapping[str, Limits], now: float) -> Ticket | Refusal:
        """Count a request of ``key`` (``tenants``: each tenant's limits, as the control
        plane says now), or say which limit refuses it."""
        if not key.tenant:  # a config file's key: nothing counted
            return Ticket([])
        scopes = [("tenant", key.tenant, tenants.get(key.tenant)), ("key", key.name, key.limits)]
        held: list[tuple[_Usage, Limits, str, str]] = []
        for scope, owner, limits in scopes:
            if limits is None:
                continue
            usage = self._usage.setdefault((scope, owner), _Usage())
            usage.prune(now)
            if limits.in_flight is not None and usage.in_flight >= limits.in_flight:
                return Refusal("in_flight", scope, owner, limits.in_flight, 1.0, key.tenant)
            if limits.rpm is not None and len(usage.begun) >= limits.rpm:
                wait = usage.begun[len(usage.begun) - limits.rpm] + MINUTE - now
                return Refusal("rpm", scope, owner, limits.rpm, max(wait, 0.001), key.tenant)
            held.append((usage, limits, scope, owner))
        ticket = Ticket(held, key.tenant)
        tightest: tuple[int, int, float] | None = None
        for usage, limits, _, _ in held:
            usage.in_flight += 1
            if limits.rpm is not None:
                usage.begun.append(now)
                left = limits.rpm - len(usage.begun)
                if tightest is None or left < tightest[1]:
                    tightest = (limits.rpm, left, usage.begun[0] + MINUTE - now)
        if tightest is not None:
            ticket.headers_ += _headers("requests", *tightest)
        return ticket

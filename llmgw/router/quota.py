"""Tenants' limits, held exactly by this router: requests in flight, requests a minute.

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

What a router counts is its own: a tenant sending through two routers is held
to its limits at each (leases of a shared allowance are the next step, see
``docs``). Keys of a config file belong to no tenant and have no limits here.

Pure: no I/O, no trio; time comes in as ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import attrs

from llmgw.router.keys import ApiKey
from llmgw.routing import LIMIT_NAMES, Limits

MINUTE = 60.0


@attrs.define
class _Usage:
    in_flight: int = 0
    begun: deque[float] = attrs.Factory(deque)  # when each request of the last minute began

    def prune(self, now: float) -> None:
        while self.begun and self.begun[0] <= now - MINUTE:
            self.begun.popleft()


@attrs.frozen
class Refusal:
    """Why a request is refused: the limit, whose, and in how long to try again."""

    limit: str  # "rpm", "in_flight"
    scope: str  # "tenant" or "key"
    owner: str  # the tenant's or key's name
    value: int  # the limit
    retry_after_s: float
    tenant: str

    @property
    def message(self) -> str:
        what = LIMIT_NAMES[self.limit]
        when = (
            f"it resets in {self.retry_after_s:.0f} s"
            if self.limit == "rpm"
            else "try again when one of them ends"
        )
        return (
            f"{self.scope} {self.owner!r} is at its limit of {self.value} {what}: {when} "
            f"(llmgw ctl tenant show {self.tenant} shows its limits)"
        )


@attrs.define
class Ticket:
    """What an admitted request holds until it ends: ``release`` once, at its end."""

    usages: list[_Usage]
    tenant: str = ""
    # the tightest requests-per-minute limit and what is left of it, for the headers
    rpm: int | None = None
    remaining: int = 0
    reset_s: float = 0.0
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            for usage in self.usages:
                usage.in_flight -= 1

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's rate-limit headers, for the requests-per-minute limit it is held to."""
        if self.rpm is None:
            return []
        return ratelimit_headers(self.rpm, self.remaining, self.reset_s)


def ratelimit_headers(limit: int, remaining: int, reset_s: float) -> list[tuple[str, str]]:
    return [
        ("x-ratelimit-limit-requests", str(limit)),
        ("x-ratelimit-remaining-requests", str(max(0, remaining))),
        ("x-ratelimit-reset-requests", f"{max(0.0, reset_s):.3g}s"),
    ]


FREE = Ticket([])  # a key of no tenant: nothing counted


class Quotas:
    """Every tenant's and tenant key's usage at this router, against their limits."""

    def __init__(self) -> None:
        self._usage: dict[tuple[str, str], _Usage] = {}  # (scope, name)

    def admit(self, key: ApiKey, tenants: Mapping[str, Limits], now: float) -> Ticket | Refusal:
        """Count a request of ``key`` (``tenants``: each tenant's limits, as the control
        plane says now), or say which limit refuses it."""
        if not key.tenant:
            return FREE
        scopes = [("tenant", key.tenant, tenants.get(key.tenant)), ("key", key.name, key.limits)]
        held: list[tuple[_Usage, Limits]] = []
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
            held.append((usage, limits))
        ticket = Ticket([u for u, _ in held], key.tenant)
        for usage, limits in held:
            usage.in_flight += 1
            if limits.rpm is not None:
                usage.begun.append(now)
                left = limits.rpm - len(usage.begun)
                if ticket.rpm is None or left < ticket.remaining:
                    ticket.rpm, ticket.remaining = limits.rpm, left
                    ticket.reset_s = usage.begun[0] + MINUTE - now
        return ticket

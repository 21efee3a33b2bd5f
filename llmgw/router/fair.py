"""Who goes first when a model is full: tenants in turn by their share of recent tokens.

Theory of operation
-------------------
When every replica of a model is above its admission thresholds, requests
wait in the model's ``Room`` (``router.room``) for up to the router's
``queue_timeout_s``. First come, first served would let a tenant that floods
the router fill the queue, and everyone else wait behind it. Instead, room that
frees goes to the waiting tenant whose recent tokens (``Shares``: what its
requests used here, decaying with a half-life of ``HALF_LIFE_S``) over its
weight are the fewest *at that moment*, and each tenant's own requests go in the
order they came. A tenant sending ten times its share therefore waits behind
everyone who sent less: it fills its own queue, not everyone's (a
virtual-token-counter rule, as in weighted fair queueing).

A request counts for its tenant from the moment it is sent, not only when it
ends: its prompt as estimated (``charge``) when sent, the rest of what it used
when it ends (``settle``). Ninety requests of a tenant new to this router that
arrive at once are not all first because none has ended yet: after the first is
sent, the tenant has used something, and the others wait their turn.

The order is judged when room frees, not when a request began to wait, so a
tenant that has waited while others were served is not stuck behind a rank it
was given when it was busy, and one that flooded a minute ago is not ahead of
one that floods now.

Keys of no tenant (the config's ``[[router.keys]]``) count as tenants of their
own name. Bounded: tenants not heard from for ``FORGET_S`` are dropped.

Pure: no I/O, no trio; time comes in as ``now``.
"""

from __future__ import annotations

import itertools
import math

HALF_LIFE_S = 60.0
FORGET_S = 10 * HALF_LIFE_S
_DECAY = math.log(2) / HALF_LIFE_S


class Shares:
    """Each tenant's recent tokens at this router, decaying over time."""

    def __init__(self) -> None:
        self._used: dict[str, tuple[float, float]] = {}  # tenant: (tokens, as of)
        self._order = itertools.count()

    def _now(self, tenant: str, now: float) -> float:
        used = self._used.get(tenant)
        if used is None:
            return 0.0
        tokens, at = used
        return tokens * math.exp(-_DECAY * max(0.0, now - at))

    def charge(self, tenant: str, tokens: int, now: float) -> None:
        """A request of ``tenant`` is counted: ``tokens`` (its prompt as estimated when
        sent; the rest of what it used when it ends, which may be less than nothing
        where the estimate was more). A count never goes below zero."""
        self._used[tenant] = (max(0.0, self._now(tenant, now) + tokens), now)
        if len(self._used) > 64 and next(self._order) % 64 == 0:
            self._forget(now)

    def value(self, tenant: str, weight: float = 1.0) -> float:
        """Where ``tenant`` stands in a full model's queue: the lower, the sooner. Its
        recent tokens over its weight, compared as they stand at one common moment, as
        ``log(tokens / weight) + decay * as_of`` (the same order as their values now,
        for every tenant at once, without computing any decay); ``-inf`` for one that
        used nothing lately."""
        used = self._used.get(tenant)
        if used is None or used[0] <= 0:
            return -math.inf
        tokens, at = used
        return math.log(tokens / max(weight, 1e-6)) + _DECAY * at

    def _forget(self, now: float) -> None:
        for tenant in [t for t, (_, at) in self._used.items() if at < now - FORGET_S]:
            del self._used[tenant]

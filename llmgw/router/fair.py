"""Who goes first when a model is full: tenants in turn by their share of recent tokens.

Theory of operation
-------------------
When every replica of a model is above its admission thresholds, requests
wait in the model's ``Room`` (``router.room``) for up to the router's
``queue_timeout_s``. First come, first served would let a tenant that floods
the router fill the queue, and everyone else wait behind it. Instead each
waiting request has a ``rank``: its tenant's recent tokens (``Shares``: what
the tenant's requests used here, decaying with a half-life of ``HALF_LIFE_S``)
over the tenant's weight, then its arrival. Only the best-ranked waiter of a
room may take room that frees; a request that arrives while better-ranked ones
wait queues behind them, and one that takes room wakes the room again so that
the next in rank looks at once. A tenant sending ten times its share therefore
waits behind everyone who sent less, and its own requests queue among
themselves: it fills its own queue, not everyone's (a virtual-token-counter
rule, as in weighted fair queueing).

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

    def spent(self, tenant: str, tokens: int, now: float) -> None:
        """A request of ``tenant`` ended having used ``tokens``."""
        self._used[tenant] = (self._now(tenant, now) + max(tokens, 0), now)
        if len(self._used) > 64 and next(self._order) % 64 == 0:
            self._forget(now)

    def rank(self, tenant: str, weight: float = 1.0) -> tuple[float, int]:
        """A waiting request's place: its tenant's recent tokens over its weight, then
        the order it came in (the lower, the sooner).

        The tokens are compared as they stand at one common moment, as
        ``log(tokens / weight) + decay * as_of`` (the same order as their values now,
        for every tenant at once): a tenant's place does not improve while its
        requests wait, so its own requests keep the order they came in."""
        used = self._used.get(tenant)
        if used is None or used[0] <= 0:
            return -math.inf, next(self._order)
        tokens, at = used
        return math.log(tokens / max(weight, 1e-6)) + _DECAY * at, next(self._order)

    def _forget(self, now: float) -> None:
        for tenant in [t for t, (_, at) in self._used.items() if at < now - FORGET_S]:
            del self._used[tenant]

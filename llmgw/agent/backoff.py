"""Reconnect delays: exponential backoff with full jitter.

Full jitter (a delay drawn uniformly from zero to the exponential ceiling)
spreads a fleet that lost its control plane at the same instant, so it does
not come back in lockstep and knock the control plane over again.

A stream that worked and then ended (the control plane restarting, a reset)
is most likely back within moments: for ``quick_for_s`` after such an end the
ceiling grows no higher than ``quick_cap_s``, so an agent notices a restarted
control plane within seconds whatever the outage, jittered all the same. Past
that minute the ceiling grows to ``cap`` as usual; an agent that was never let
in (refused, unreachable from the start) backs off from its first attempt.
"""

from __future__ import annotations

import math
import random

import attrs


@attrs.define
class Backoff:
    initial: float
    cap: float
    rng: random.Random = attrs.Factory(random.Random)
    attempt: int = 0
    quick_cap_s: float = 2.0
    quick_for_s: float = 60.0
    quick_until: float = -math.inf  # when the quick reconnects after a lost stream end

    def ceiling(self, now: float = -math.inf) -> float:
        """The most the next delay may be, at ``now`` (the same clock as ``lost``)."""
        ceiling = float(min(self.cap, self.initial * 2 ** min(self.attempt, 62)))
        if now < self.quick_until:
            ceiling = min(ceiling, max(self.quick_cap_s, self.initial))
        return ceiling

    def next_delay(self, now: float = -math.inf) -> float:
        """The delay before the next attempt; each call without a reset doubles the ceiling."""
        delay = self.rng.uniform(0, self.ceiling(now))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """Only after a registration was accepted; a refusal must keep backing off."""
        self.attempt = 0

    def lost(self, now: float) -> None:
        """A stream that was registered ended at ``now``: back off from the start, and
        no further than ``quick_cap_s`` for ``quick_for_s``."""
        self.reset()
        self.quick_until = now + self.quick_for_s

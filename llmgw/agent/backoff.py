"""Reconnect delays: exponential backoff with full jitter.

Full jitter (a delay drawn uniformly from zero to the exponential ceiling)
spreads a fleet that lost its control plane at the same instant, so it does
not come back in lockstep and knock the control plane over again.
"""

from __future__ import annotations

import random

import attrs


@attrs.define
class Backoff:
    initial: float
    cap: float
    rng: random.Random = attrs.Factory(random.Random)
    attempt: int = 0

    def ceiling(self) -> float:
        return float(min(self.cap, self.initial * 2 ** min(self.attempt, 62)))

    def next_delay(self) -> float:
        """The delay before the next attempt; each call without a reset doubles the ceiling."""
        delay = self.rng.uniform(0, self.ceiling())
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """Only after a registration was accepted; a refusal must keep backing off."""
        self.attempt = 0

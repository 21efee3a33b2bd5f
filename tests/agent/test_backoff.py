"""Reconnect backoff: exponential ceiling, full jitter, reset only on acceptance."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.backoff import Backoff


def test_ceiling_doubles_to_the_cap_and_resets() -> None:
    b = Backoff(0.5, 30, random.Random(1))
    ceilings = []
    for _ in range(10):
        ceilings.append(b.ceiling())
        b.next_delay()
    assert ceilings[:7] == [0.5, 1, 2, 4, 8, 16, 30]
    assert ceilings[-1] == 30
    b.reset()
    assert b.ceiling() == 0.5


@given(st.integers(min_value=0, max_value=200), st.integers())
def test_delays_stay_within_zero_and_the_ceiling(attempts: int, seed: int) -> None:
    b = Backoff(0.25, 10, random.Random(seed))
    for _ in range(attempts):
        ceiling = b.ceiling()
        assert 0 <= b.next_delay() <= ceiling <= 10


def test_full_jitter_spreads_a_fleet() -> None:
    """A thousand agents that lost the control plane together do not return together."""
    rng = random.Random(7)
    delays = []
    for _ in range(1000):
        b = Backoff(0.5, 30, rng)
        for _ in range(5):
            b.next_delay()
        delays.append(b.next_delay())  # the sixth attempt: ceiling 16 s
    buckets = [0] * 16
    for d in delays:
        buckets[min(int(d), 15)] += 1
    assert max(buckets) < 120  # roughly uniform: 62.5 per one-second bucket
    assert min(delays) < 1 and max(delays) > 15

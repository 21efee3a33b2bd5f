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


def test_after_a_stream_that_worked_the_ceiling_stays_low_for_a_minute() -> None:
    """A control plane that restarts is noticed within seconds however long it was
    away, jittered all the same; a minute on, the ceiling grows as before."""
    b = Backoff(0.5, 30, random.Random(3))
    for _ in range(8):
        b.next_delay(0.0)
    assert b.ceiling(0.0) == 30  # an agent never let in backs off to the cap
    b.lost(100.0)
    ceilings, delays = [], []
    now = 100.0
    while now < 160.0:
        ceilings.append(b.ceiling(now))
        delays.append(b.next_delay(now))
        now += delays[-1] + 0.1  # the failed attempt's own time
    assert ceilings[:3] == [0.5, 1, 2] and max(ceilings) == 2
    assert all(0 <= d <= 2 for d in delays) and len(set(delays)) == len(delays)
    assert b.ceiling(now) == 30  # past the minute: as before
    b.reset()
    assert b.ceiling(now) == 0.5


def test_a_first_delay_longer_than_the_quick_cap_is_kept() -> None:
    b = Backoff(5, 30, random.Random(1))
    b.lost(0.0)
    assert b.ceiling(1.0) == 5

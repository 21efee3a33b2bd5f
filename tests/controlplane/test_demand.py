"""The scaling rule (``llmgw.controlplane.demand``): a model's count follows its load
within its range, up at once on a sustained need, down one at a time, to zero after
idle and back from zero on the first held request, without flapping."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.controlplane.demand import (
    DOWN_COOL_S,
    DOWN_S,
    UP_COOL_S,
    UP_S,
    Change,
    Demand,
    Range,
    Reading,
)

RANGE = Range(min=0, max=4, target=4.0, idle_s=300.0)


def feed(demand: Demand, loads: list[tuple[float, int, int]]) -> list[tuple[float, Change]]:
    """Readings (at, in flight, waiting) in order; the changes, with when."""
    out = []
    for at, in_flight, waiting in loads:
        change = demand.observe(Reading(at, in_flight, waiting))
        if change is not None:
            out.append((at, change))
    return out


def every(seconds: float, until: float, start: float = 0.0) -> list[float]:
    n = int((until - start) / seconds)
    return [start + i * seconds for i in range(n)]


def test_an_idle_model_goes_to_zero_and_its_first_request_brings_one_back() -> None:
    demand = Demand(RANGE, count=1)
    changes = feed(demand, [(t, 0, 0) for t in every(1.0, 299.0)])
    assert changes == [] and demand.count == 1  # not before idle_s
    changes = feed(demand, [(t, 0, 0) for t in every(1.0, 310.0, 299.0)])
    assert [c.after for _, c in changes] == [0] and "no request for 300 s" in str(changes[0][1])
    assert feed(demand, [(t, 0, 0) for t in every(1.0, 400.0, 310.0)]) == []  # stays
    [(at, back)] = feed(demand, [(400.0, 0, 3)])  # three requests held: one starts now
    assert (at, back.before, back.after) == (400.0, 0, 1)
    assert str(back) == "0 → 1: 3 requests held with no replica"


def test_a_burst_that_finds_the_model_at_zero_starts_what_it_needs_at_once() -> None:
    demand = Demand(RANGE, count=0)
    [(_, back)] = feed(demand, [(0.0, 0, 0), (1.0, 0, 14)])  # 14 held, 4 each: four
    assert str(back) == "0 → 4: 14 requests held with no replica"
    demand = Demand(RANGE, count=0)
    [(_, back)] = feed(demand, [(1.0, 0, 1)])
    assert back.after == 1


def test_a_sustained_load_raises_the_count_at_once_and_a_spike_does_not() -> None:
    demand = Demand(RANGE, count=1)
    feed(demand, [(t, 2, 0) for t in every(1.0, 60.0)])
    spike = feed(demand, [(t, 14, 6) for t in every(1.0, 70.0, 60.0)])  # 10 s: shorter than UP_S
    assert spike == [] and demand.count == 1
    feed(demand, [(t, 2, 0) for t in every(1.0, 80.0, 70.0)])
    changes = feed(demand, [(t, 10, 4) for t in every(1.0, 120.0, 80.0)])
    [(at, up)] = changes
    assert (up.before, up.after) == (1, 4)  # 14 at once, 4 each: all four at once
    assert 80.0 + UP_S <= at <= 80.0 + UP_S + 1.0, at
    assert str(up) == "1 → 4: 14 requests at once for 15 s, 4 each at most"


def test_a_load_that_falls_lets_one_replica_go_at_a_time() -> None:
    demand = Demand(RANGE, count=4)
    changes = feed(demand, [(t, 2, 0) for t in every(1.0, 1000.0)])  # half a replica's worth
    assert [(c.before, c.after) for _, c in changes] == [(4, 3), (3, 2), (2, 1)]
    times = [at for at, _ in changes]
    assert times[0] >= DOWN_S
    assert all(b - a >= DOWN_COOL_S for a, b in itertools.pairwise(times))
    said = str(changes[0][1])
    assert (
        said == "4 → 3: at most 2 requests at once for 120 s: 3 carry them at 70% of their target"
    )
    # 3 at once: one replica would carry it at 75% of its target, past 70%: two stay
    demand = Demand(RANGE, count=2)
    assert feed(demand, [(t, 3, 0) for t in every(1.0, 1000.0)]) == []


def test_a_load_that_rises_and_falls_every_minute_starts_engines_once() -> None:
    """A sine-like sawtooth: 30 s at 14 requests, 30 s at 2, for twenty minutes. The
    count rises with the first rise and stays: no start and stop each minute."""
    demand = Demand(RANGE, count=1)
    loads = [(t, 14 if int(t // 30) % 2 == 0 else 2, 0) for t in every(1.0, 1200.0)]
    changes = feed(demand, loads)
    assert [(c.before, c.after) for _, c in changes] == [(1, 4)], changes


def test_a_pin_holds_the_count_until_released() -> None:
    demand = Demand(RANGE, count=1)
    pinned = demand.pin(3, 0.0)
    assert pinned is not None and (pinned.before, pinned.after) == (1, 3)
    assert feed(demand, [(t, 0, 0) for t in every(1.0, 1000.0)]) == []  # idle: still 3
    assert demand.pin(None, 1000.0) is None
    changes = feed(demand, [(t, 0, 0) for t in every(1.0, 1200.0, 1000.0)])
    assert changes and changes[-1][1].after == 0  # released: idle since long ago


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 3),
    st.integers(1, 6),
    st.lists(st.tuples(st.floats(0.2, 20.0), st.integers(0, 40), st.integers(0, 20)), max_size=300),
)
def test_the_count_stays_in_its_range_and_never_swings_faster_than_its_cool_downs(
    low: int, span: int, readings: list[tuple[float, int, int]]
) -> None:
    """Whatever the load: the count stays within the range (zero only from idle, and
    left only for a held request); a rise from a running count comes at least
    UP_COOL_S after the change before it, a fall at least DOWN_COOL_S."""
    r = Range(min=low, max=low + span, target=3.0, idle_s=120.0)
    demand = Demand(r, count=max(low, 1))
    now, last = 0.0, -1e9
    for gap, in_flight, waiting in readings:
        now += gap
        change = demand.observe(Reading(now, in_flight, waiting))
        assert r.min <= demand.count <= r.max
        if change is None:
            continue
        if change.before == 0:
            assert change.after == 1 and waiting > 0
        elif change.after == 0:
            assert r.min == 0
        elif change.after > change.before:
            assert now - last >= UP_COOL_S, (change, now, last)
        else:
            assert change.after == change.before - 1 and now - last >= DOWN_COOL_S
        last = now


def test_a_count_just_raised_is_given_time_to_start_before_the_next_rise() -> None:
    demand = Demand(RANGE, count=1)
    [(first, up)] = feed(demand, [(t, 6, 0) for t in every(1.0, 20.0)])  # 6: two replicas
    assert (up.before, up.after) == (1, 2)
    changes = feed(demand, [(t, 16, 0) for t in every(1.0, 100.0, 20.0)])  # now four
    [(second, more)] = changes
    assert (more.before, more.after) == (2, 4)
    assert second - first >= 30.0, (first, second)  # UP_COOL_S, as documented


def test_a_burst_still_arriving_after_a_start_from_zero_raises_the_count_at_once() -> None:
    demand = Demand(RANGE, count=0)
    changes = feed(demand, [(0.0, 0, 1), (1.0, 0, 9), (2.0, 1, 14), (3.0, 2, 15)])
    assert [(at, str(c)) for at, c in changes] == [
        (0.0, "0 → 1: 1 request held with no replica"),
        (1.0, "1 → 3: 9 requests at once while its first replicas start"),
        (2.0, "3 → 4: 15 requests at once while its first replicas start"),
    ]
    # past UP_S from the start, the usual patience again
    demand = Demand(RANGE, count=0)
    feed(demand, [(0.0, 0, 1), *[(t, 4, 0) for t in every(1.0, 20.0, 1.0)]])
    assert demand.count == 1
    assert feed(demand, [(21.0, 12, 0)]) == []


def test_a_replica_that_takes_long_to_start_is_given_that_long_before_another_rise() -> None:
    for start_s, second_rise in ((0.0, 15.0 + UP_COOL_S), (90.0, 15.0 + 90.0)):
        demand = Demand(Range(min=1, max=4, target=4.0, start_s=start_s), count=1)
        loads = [(t, 10, 0) for t in every(1.0, 20.0)]  # up at UP_S to what 10 needs
        loads += [(t, 10, 10) for t in every(1.0, 200.0, 20.0)]  # queued behind the starts
        changes = feed(demand, loads)
        assert [(at, c.after) for at, c in changes] == [(UP_S, 3), (second_rise, 4)]

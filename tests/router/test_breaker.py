"""The breaker counts the replica's faults, never the request's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.router.breaker import TRANSITIONS, Breaker, BreakerState, IllegalMove, classify


def state(b: Breaker) -> BreakerState:
    # a call, so mypy does not narrow the attribute across the calls that change it
    return b.state


def trip(breaker: Breaker, now: float) -> None:
    for _ in range(breaker.failure_threshold):
        assert breaker.allows(now)
        breaker.on_start(now)
        breaker.on_upstream_fault(now)


def test_opens_after_threshold_consecutive_faults() -> None:
    b = Breaker(failure_threshold=3, cooldown_s=10)
    for _ in range(2):
        b.on_start(0)
        b.on_upstream_fault(0)
    assert state(b) is BreakerState.CLOSED and b.allows(0)
    b.on_start(0)
    b.on_upstream_fault(1.0)
    assert state(b) is BreakerState.OPEN
    assert b.opened_at == 1.0
    assert not b.allows(1.0)
    assert b.reason == TRANSITIONS[(BreakerState.CLOSED, BreakerState.OPEN)]


def test_success_resets_the_streak() -> None:
    b = Breaker(failure_threshold=3)
    for _ in range(10):
        b.on_upstream_fault(0)
        b.on_upstream_fault(0)
        b.on_success(0)
    assert state(b) is BreakerState.CLOSED
    assert b.consecutive_faults == 0


def test_client_errors_never_open_it() -> None:
    # SGLang's lesson: one client sending bad requests must not take replicas out
    b = Breaker(failure_threshold=2)
    for _ in range(1000):
        assert b.allows(0)
        b.on_start(0)
        b.on_client_error(0)
    assert state(b) is BreakerState.CLOSED
    assert b.consecutive_faults == 0


def test_client_errors_neither_count_nor_reset_the_streak() -> None:
    b = Breaker(failure_threshold=3)
    b.on_upstream_fault(0)
    b.on_client_error(0)
    b.on_upstream_fault(0)
    assert b.consecutive_faults == 2
    b.on_client_error(0)
    b.on_upstream_fault(0)
    assert state(b) is BreakerState.OPEN


def test_half_open_after_cooldown_one_probe_at_a_time() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=10, half_open_probes=1)
    trip(b, 100)
    assert not b.allows(109.9)
    assert state(b) is BreakerState.OPEN
    assert b.allows(110)
    assert state(b) is BreakerState.HALF_OPEN
    b.on_start(110)
    assert not b.allows(110.5)  # the probe is in flight
    assert not b.allows(500)  # however long it takes: the probe decides


def test_half_open_allows_configured_number_of_probes() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=1, half_open_probes=2)
    trip(b, 0)
    assert b.allows(1)
    b.on_start(1)
    assert b.allows(1)
    b.on_start(1)
    assert not b.allows(1)


def test_probe_success_closes() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=5)
    trip(b, 0)
    assert b.allows(5)
    b.on_start(5)
    b.on_success(6)
    assert state(b) is BreakerState.CLOSED
    assert b.consecutive_faults == 0
    assert b.allows(6)


def test_probe_fault_reopens_and_restarts_cooldown() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=5)
    trip(b, 0)
    assert b.allows(5)
    b.on_start(5)
    b.on_upstream_fault(7)
    assert state(b) is BreakerState.OPEN
    assert b.opened_at == 7
    assert not b.allows(11)  # 5 s after the first opening, but only 4 after the second
    assert b.allows(12)


def test_probe_client_error_frees_the_slot_without_deciding() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=5)
    trip(b, 0)
    assert b.allows(5)
    b.on_start(5)
    b.on_client_error(6)
    assert state(b) is BreakerState.HALF_OPEN
    assert b.allows(6)  # another probe may decide


def test_cancelled_probe_frees_the_slot() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=5)
    trip(b, 0)
    assert b.allows(5)
    b.on_start(5)
    assert not b.allows(5)
    b.on_cancel(6)
    assert state(b) is BreakerState.HALF_OPEN
    assert b.allows(6)


def test_late_outcomes_while_open_do_not_move_it() -> None:
    b = Breaker(failure_threshold=1, cooldown_s=10)
    trip(b, 0)
    b.on_success(1)  # a request sent before it opened
    assert state(b) is BreakerState.OPEN
    b.on_upstream_fault(2)
    assert b.opened_at == 0  # the cool-down is not restarted by old news
    assert b.allows(10)


def test_illegal_move_is_refused() -> None:
    b = Breaker()
    with pytest.raises(IllegalMove):
        b._move(BreakerState.HALF_OPEN)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, "success"),
        (204, "success"),
        (301, "success"),
        (400, "client_error"),
        (401, "client_error"),
        (404, "client_error"),
        (408, "client_error"),
        (413, "client_error"),
        (422, "client_error"),
        # an engine's own answers say nothing about the replica, whatever the status:
        (429, "client_error"),  # its admission; the balancer follows its load
        (500, "client_error"),  # llama.cpp's answer to an image part it cannot read
        (501, "client_error"),
        (507, "client_error"),
    ],
)
def test_classify(status: int, expected: str) -> None:
    assert classify(status) == expected


def test_no_answer_of_an_engine_ever_opens_it() -> None:
    b = Breaker(failure_threshold=1)
    for status in range(100, 600):
        b.on_start(0.0)
        outcome = classify(status)
        assert outcome != "upstream_fault"
        if outcome == "success":
            b.on_success(0.0)
        else:
            b.on_client_error(0.0)
    assert b.state is BreakerState.CLOSED


@given(st.lists(st.sampled_from(["start", "ok", "fault", "client", "cancel", "tick"]), max_size=80))
def test_only_legal_states_and_probe_bound(ops: list[str]) -> None:
    """Any sequence of events: the state is legal, half-open never admits more than
    its probes, and client errors alone never open it."""
    b = Breaker(failure_threshold=3, cooldown_s=2, half_open_probes=1)
    now = 0.0
    opened_by: list[str] = []
    last_faulty = False
    for op in ops:
        before = b.state
        if op == "tick":
            now += 1.0
        elif op == "start":
            if b.allows(now):
                b.on_start(now)
            assert b.state is not BreakerState.HALF_OPEN or b.probes_in_flight <= 1
        elif op == "ok":
            b.on_success(now)
        elif op == "fault":
            b.on_upstream_fault(now)
        elif op == "client":
            b.on_client_error(now)
        else:
            b.on_cancel(now)
        last_faulty = op == "fault"
        if before is not b.state:
            assert (before, b.state) in TRANSITIONS
            if state(b) is BreakerState.OPEN:
                opened_by.append(op)
                assert last_faulty
    assert all(op == "fault" for op in opened_by)

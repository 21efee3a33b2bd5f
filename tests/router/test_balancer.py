"""Choosing a replica: only admissible ones, by load, and unknown load is not saturation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.engines.base import LoadSignals
from llmgw.router.balancer import (
    Admission,
    Endpoint,
    RetryBudget,
    choose,
    score,
)
from llmgw.router.breaker import Breaker, BreakerState

NOW = 1000.0
OPEN = Admission()
STRICT = Admission(target_waiting=4, kv_ceiling=0.9, retry_after_s=2.5)


def ep(key: str, **kw: object) -> Endpoint:
    """An endpoint; with ``load``, read when this router had its ``in_flight`` there
    (nothing sent since) unless ``in_flight_at_load`` says otherwise."""
    if "load" in kw:
        kw.setdefault("in_flight_at_load", kw.get("in_flight", 0))
    return Endpoint(key=key, model="m", url=f"http://{key}:8000", **kw)  # type: ignore[arg-type]


def fresh(
    waiting: float | None = 0, running: float | None = 0, kv: float | None = None
) -> dict[str, object]:
    return {"load": LoadSignals(waiting=waiting, running=running, kv_usage=kv), "load_at": NOW - 1}


def open_breaker() -> Breaker:
    b = Breaker(failure_threshold=1, cooldown_s=60)
    b.on_upstream_fault(NOW)
    return b


# --- who may take traffic -----------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"ready": False}, "not Ready"),
        ({"draining": True}, "draining"),
        ({"breaker": "open"}, "breaker open"),
    ],
)
def test_inadmissible_replica_never_chosen_even_when_idle(bad: dict[str, object], why: str) -> None:
    tripped = bad.get("breaker") == "open"
    if tripped:
        bad = {"breaker": open_breaker()}
    idle = ep("idle", **bad)
    busy = ep("busy", in_flight=50)
    for r in (0.0, 0.5, 0.99):
        choice = choose([idle, busy], NOW, admission=OPEN, rng_value=r)
        assert choice.endpoint is busy and not choice.panic
    alone = choose([idle], NOW, admission=OPEN)
    assert not alone.shed
    if tripped:  # the only one left: panic sends it there rather than refuse everyone
        assert alone.endpoint is idle and alone.panic
        assert "panic: every replica of model m is refused by its breaker" in alone.reason
        return
    assert alone.endpoint is None and not alone.panic
    assert "no Ready replica for model m" in alone.reason
    assert why in alone.reason


def test_panic_picks_the_least_bad_of_the_open_breakers() -> None:
    worse = Breaker(failure_threshold=1, cooldown_s=60)
    for _ in range(3):
        worse.on_upstream_fault(NOW)
    later = Breaker(failure_threshold=1, cooldown_s=60)
    later.on_upstream_fault(NOW + 5)
    a, b, c = ep("a", breaker=worse), ep("b", breaker=open_breaker()), ep("c", breaker=later)
    off = ep("off", ready=False)
    choice = choose([a, b, c, off], NOW + 10, admission=OPEN)
    assert choice.panic and choice.endpoint is b  # fewest faults, then the longest open
    assert choose([a, c], NOW + 10, admission=OPEN).endpoint is c  # fewer faults
    # a replica the request already tried, not Ready or draining is no panic pick
    tried = choose([b], NOW + 10, admission=OPEN, exclude=frozenset({"b"}))
    assert tried.endpoint is None and not tried.panic
    assert choose([off], NOW, admission=OPEN).endpoint is None
    # a retry after a replica whose breaker is closed is no panic: the model is not down
    healthy = ep("healthy")
    retry = choose([healthy, b], NOW + 10, admission=OPEN, exclude=frozenset({"healthy"}))
    assert retry.endpoint is None and not retry.panic
    assert "breaker open" in retry.reason
    # one closed breaker is enough: no panic
    assert choose([a, b, ep("ok", in_flight=99)], NOW, admission=OPEN).endpoint.key == "ok"  # type: ignore[union-attr]


def test_half_open_breaker_takes_a_probe_after_cooldown() -> None:
    e, other = ep("r1", breaker=open_breaker()), ep("r2", in_flight=9)
    assert choose([e, other], NOW + 59, admission=OPEN).endpoint is other
    choice = choose([e, other], NOW + 60, admission=OPEN)
    assert choice.endpoint is e and not choice.panic
    e.start(NOW + 60)
    assert e.breaker.state is BreakerState.HALF_OPEN
    again = choose([e, other], NOW + 61, admission=OPEN)
    assert again.endpoint is other
    alone = choose([e], NOW + 61, admission=OPEN)
    assert alone.panic and "probe in flight" not in alone.reason


def test_exclude_sends_the_retry_elsewhere() -> None:
    a, b = ep("a"), ep("b", in_flight=10)
    assert choose([a, b], NOW, admission=OPEN).endpoint is a
    retry = choose([a, b], NOW, admission=OPEN, exclude=frozenset({"a"}))
    assert retry.endpoint is b
    none_left = choose([a, b], NOW, admission=OPEN, exclude=frozenset({"a", "b"}))
    assert none_left.endpoint is None and not none_left.shed
    assert "already tried" in none_left.reason


def test_a_suspect_goes_where_no_other_suspect_is_however_loaded() -> None:
    """``apart``: a request in flight at an engine's death is not sent where another
    such is in flight while some replica holds none; where all do, it is ``crowded``."""
    eps = [ep("a", in_flight=1, suspects=1), ep("b", in_flight=5)]
    assert choose(eps, NOW, admission=OPEN).endpoint is eps[0]  # by load
    apart = choose(eps, NOW, admission=OPEN, apart=True)
    assert apart.endpoint is eps[1] and not apart.crowded
    eps[1].suspects = 2
    crowded = choose(eps, NOW, admission=OPEN, apart=True)
    assert crowded.endpoint is eps[0] and crowded.crowded


def test_no_replicas_at_all() -> None:
    choice = choose([], NOW, admission=STRICT, model="llama")
    assert choice.endpoint is None
    assert not choice.shed
    assert choice.reason.startswith("no Ready replica for model llama")


def test_model_filter() -> None:
    other = Endpoint(key="x", model="other", url="http://x")
    mine = ep("mine", in_flight=9)
    assert choose([other, mine], NOW, admission=OPEN, model="m").endpoint is mine


# --- load ------------------------------------------------------------------------


def test_least_loaded_by_fresh_signals() -> None:
    # a has fewer of *our* requests, but the engine says it is busier (other routers)
    a = ep("a", in_flight=1, **fresh(waiting=3, running=6))
    b = ep("b", in_flight=2, **fresh(waiting=0, running=2))
    choice = choose([a, b], NOW, admission=OPEN)
    assert choice.endpoint is b
    assert choice.reason.startswith("least loaded: b")


def test_in_flight_counts_when_scrape_lags() -> None:
    # the engine has not yet seen our latest sends: in-flight is the better lower bound
    a = ep("a", in_flight=8, **fresh(waiting=0, running=1))
    b = ep("b", in_flight=3, **fresh(waiting=0, running=2))
    assert score(a, a.load) == 8
    assert choose([a, b], NOW, admission=OPEN).endpoint is b


def test_a_request_ended_since_the_reading_frees_its_replica_at_once() -> None:
    # one slot, weight 1, read running its one request, which has ended since; four
    # slots, weight 4, four of ours running: the one is free and takes the next (the
    # reading's running count once held it busy until the next scrape, and a 4:1
    # split ran 5:1)
    one = ep("one", in_flight=0, in_flight_at_load=1, weight=1.0, **fresh(running=1))
    four = ep("four", in_flight=4, weight=4.0, **fresh(running=4))
    assert score(one, one.load) == 0
    assert choose([four, one], NOW, admission=OPEN).endpoint is one
    # what the engine ran beyond this router's own requests is other routers' work
    shared = ep("shared", in_flight=1, in_flight_at_load=1, **fresh(running=3, waiting=1))
    assert score(shared, shared.load) == 1 + 2 + 1


def test_stale_metrics_degrade_to_in_flight_not_saturated() -> None:
    # metrics say waiting=100 but are 60 s old: ignore them, and do not shed
    stale = ep(
        "stale",
        in_flight=2,
        load=LoadSignals(waiting=100, running=50, kv_usage=0.99),
        load_at=NOW - 60,
    )
    choice = choose([stale], NOW, admission=STRICT)
    assert choice.endpoint is stale
    assert not choice.shed
    assert "stale" in choice.reason
    # and balanced on in-flight against a fresh one
    busy_fresh = ep("fresh", in_flight=0, **fresh(waiting=3, running=3))
    assert choose([stale, busy_fresh], NOW, admission=STRICT).endpoint is stale


def test_missing_metrics_are_not_saturation() -> None:
    unknown = ep("unknown", in_flight=7)
    full = ep("full", **fresh(waiting=9))
    choice = choose([unknown, full], NOW, admission=STRICT)
    assert choice.endpoint is unknown
    assert "no metrics" in choice.reason


def test_staleness_boundary() -> None:
    e = ep("e", load=LoadSignals(waiting=9), load_at=NOW - 5)
    assert choose([e], NOW, admission=STRICT, stale_after_s=5).shed
    assert not choose([e], NOW + 0.01, admission=STRICT, stale_after_s=5).shed


# --- admission -------------------------------------------------------------------


def test_over_threshold_replica_avoided_while_another_is_below() -> None:
    # 'over' has the lower score but its queue is past target_waiting
    over = ep("over", weight=10, **fresh(waiting=5, running=0))
    below = ep("below", in_flight=3, **fresh(waiting=1, running=3))
    assert score(over, over.load) < score(below, below.load)
    assert choose([over, below], NOW, admission=STRICT).endpoint is below
    # without thresholds it would have been picked
    assert choose([over, below], NOW, admission=OPEN).endpoint is over


def test_kv_ceiling_avoided() -> None:
    full = ep("full", **fresh(waiting=0, running=0, kv=0.95))
    roomy = ep("roomy", in_flight=4, **fresh(waiting=0, running=4, kv=0.5))
    assert choose([full, roomy], NOW, admission=STRICT).endpoint is roomy


def test_all_above_sheds_with_retry_after() -> None:
    a = ep("r1", **fresh(waiting=9))
    b = ep("r2", **fresh(waiting=0, kv=0.97))
    choice = choose([a, b], NOW, admission=STRICT)
    assert choice.endpoint is None
    assert choice.shed
    assert choice.retry_after_s == 2.5
    assert "waiting 9 > 4 on r1" in choice.reason
    assert "kv 0.97 > 0.90 on r2" in choice.reason


def test_threshold_is_strictly_above() -> None:
    at = ep("at", **fresh(waiting=4, kv=0.9))
    assert choose([at], NOW, admission=STRICT).endpoint is at


def test_none_thresholds_never_trigger() -> None:
    e = ep("e", **fresh(waiting=10_000, kv=1.0))
    assert choose([e], NOW, admission=OPEN).endpoint is e
    # llama.cpp has no KV gauge: a kv ceiling alone never triggers on it
    llama = ep("llama", load=LoadSignals(waiting=0, running=1, kv_usage=None), load_at=NOW)
    assert choose([llama], NOW, admission=Admission(kv_ceiling=0.1)).endpoint is llama


def test_per_endpoint_admission_overrides() -> None:
    small = ep("small", admission=Admission(target_waiting=1), **fresh(waiting=2))
    big = ep("big", in_flight=5, **fresh(waiting=2))
    assert choose([small, big], NOW, admission=STRICT).endpoint is big


# --- sharing -----------------------------------------------------------------------


def simulate(weights: list[float], steps: int, hold: int, seed: int) -> Counter[str]:
    """One arrival per step, each held for ``hold`` steps: how many each replica took."""
    rng = random.Random(seed)
    endpoints = [ep(f"r{i}", weight=w) for i, w in enumerate(weights)]
    done_at: list[tuple[int, Endpoint]] = []
    taken: Counter[str] = Counter()
    for step in range(steps):
        for entry in [d for d in done_at if d[0] <= step]:
            done_at.remove(entry)
            entry[1].finish(float(step), "success")
        choice = choose(endpoints, float(step), admission=OPEN, rng_value=rng.random())
        assert choice.endpoint is not None
        choice.endpoint.start(float(step))
        done_at.append((step + hold, choice.endpoint))
        taken[choice.endpoint.key] += 1
    return taken


@pytest.mark.parametrize("weights", [[1, 1], [2, 1], [1, 3], [1, 2, 5], [1.5, 1]])
@pytest.mark.parametrize("seed", [1, 2])
def test_weight_scales_share(weights: list[float], seed: int) -> None:
    steps = 4000
    taken = simulate(weights, steps=steps, hold=40, seed=seed)
    total = sum(weights)
    for i, w in enumerate(weights):
        expected = steps * w / total
        assert abs(taken[f"r{i}"] - expected) <= 0.1 * expected, (taken, weights)


def test_equal_replicas_share_ties() -> None:
    # idle replicas tie; the tie-break must spread, not always pick the first
    a, b, c = ep("a"), ep("b"), ep("c")
    picks = set()
    for r in (0.0, 0.4, 0.8):
        chosen = choose([a, b, c], NOW, admission=OPEN, rng_value=r).endpoint
        assert chosen is not None
        picks.add(chosen.key)
    assert picks == {"a", "b", "c"}


# --- properties --------------------------------------------------------------------

endpoint_st = st.builds(
    lambda i, ready, draining, tripped, in_flight, waiting, kv, age, weight: Endpoint(
        key=f"r{i}",
        model="m",
        url="http://x",
        weight=weight,
        ready=ready,
        draining=draining,
        in_flight=in_flight,
        load=None if age is None else LoadSignals(waiting=waiting, running=None, kv_usage=kv),
        load_at=None if age is None else NOW - age,
        breaker=open_breaker() if tripped else Breaker(),
    ),
    st.integers(0, 1000),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(0, 20),
    st.one_of(st.none(), st.floats(0, 50)),
    st.one_of(st.none(), st.floats(0, 1)),
    st.one_of(st.none(), st.floats(0, 120)),
    st.floats(0.1, 10),
)


@given(
    st.lists(endpoint_st, max_size=8, unique_by=lambda e: e.key),
    st.frozensets(st.sampled_from([f"r{i}" for i in range(5)])),
    st.floats(0, 0.999),
)
def test_choose_only_admissible_and_never_sheds_on_unknown(
    endpoints: list[Endpoint], exclude: frozenset[str], r: float
) -> None:
    choice = choose(endpoints, NOW, admission=STRICT, stale_after_s=5, exclude=exclude, rng_value=r)

    def candidate(e: Endpoint) -> bool:
        return (
            e.ready
            and not e.draining
            and e.key not in exclude
            and e.breaker.state is BreakerState.CLOSED
        )

    def panic_candidate(e: Endpoint) -> bool:
        return e.ready and not e.draining and e.key not in exclude

    if choice.endpoint is not None:
        assert not choice.shed
        if choice.panic:  # only when the breakers refused every candidate
            assert panic_candidate(choice.endpoint)
            assert not any(candidate(e) for e in endpoints)
        else:
            assert candidate(choice.endpoint)
    unknown = [e for e in endpoints if candidate(e) and (e.load_at is None or NOW - e.load_at > 5)]
    if unknown:
        assert choice.endpoint is not None and not choice.panic
    healthy_tried = any(
        e.ready and not e.draining and e.key in exclude and e.breaker.state is BreakerState.CLOSED
        for e in endpoints
    )
    if not any(candidate(e) for e in endpoints):
        assert not choice.shed
        panics = not healthy_tried and any(panic_candidate(e) for e in endpoints)
        assert (choice.endpoint is None) == (not panics)


# --- retries -------------------------------------------------------------------------


def test_retry_budget_attempts_per_request() -> None:
    budget = RetryBudget(max_attempts=3)
    budget.on_request(0)
    assert budget.can_retry(0, attempts=1)
    assert budget.can_retry(0, attempts=2)
    assert not budget.can_retry(0, attempts=3)


def test_retry_budget_ratio_over_window() -> None:
    budget = RetryBudget(ratio=0.2, window_s=10, min_retries=0)
    for i in range(100):
        budget.on_request(i * 0.05)  # 100 requests within 5 s
    now = 5.0
    granted = 0
    while budget.can_retry(now):
        budget.on_retry(now)
        granted += 1
        assert granted <= 100
    assert granted == 20
    # the window slides: once those requests age out, retries are refused (min 0) ...
    assert budget.totals(30.0) == (0, 0)
    assert not budget.can_retry(30.0)
    # ... and new traffic earns new budget
    for _ in range(10):
        budget.on_request(31.0)
    assert budget.can_retry(31.0)
    budget.on_retry(31.0)
    budget.on_retry(31.0)
    assert not budget.can_retry(31.0)


def test_retry_budget_floor_lets_a_quiet_router_retry() -> None:
    budget = RetryBudget(ratio=0.2, min_retries=3)
    budget.on_request(0)
    for _ in range(3):
        assert budget.can_retry(0)
        budget.on_retry(0)
    assert not budget.can_retry(0)


# --- what was sent since the engine's gauges were read ---------------------------

ONE_QUEUED = Admission(target_waiting=0)


def read(in_flight: int, **load: float | None) -> dict[str, object]:
    """An endpoint whose gauges were read when this router had ``in_flight`` there."""
    return {"load": LoadSignals(**load), "load_at": NOW - 0.5, "in_flight_at_load": in_flight}


def test_an_engine_with_slots_is_judged_with_the_request_sent() -> None:
    """A one-slot llama-server read idle, nothing queued: it takes one request; this
    router's second request there would queue behind the first, though the reading
    (up to a scrape old) says nothing runs."""
    one = ep("one", in_flight=0, **read(0, waiting=0, running=0, slots=1))
    assert choose([one], NOW, admission=ONE_QUEUED).endpoint is one
    one.in_flight = 1  # sent since the reading
    choice = choose([one], NOW, admission=ONE_QUEUED)
    assert choice.shed and "waiting 1 > 0 on one" in choice.reason


def test_requests_sent_since_the_reading_take_free_slots_first() -> None:
    four = ep("four", in_flight=3, **read(1, waiting=0, running=1, slots=4))
    assert not choose([four], NOW, admission=ONE_QUEUED).shed  # the fourth slot is free
    four.in_flight = 4
    assert choose([four], NOW, admission=ONE_QUEUED).shed  # a fifth would queue
    assert not choose([four], NOW, admission=Admission(target_waiting=1)).shed
    # a queue the reading saw (another router's requests) stands
    shared = ep("shared", in_flight=0, **read(0, waiting=2, running=4, slots=4))
    assert choose([shared], NOW, admission=Admission(target_waiting=1)).shed


def test_at_capacity_the_next_request_goes_where_a_slot_is_free() -> None:
    """Four slots full and one slot free, read when the one-slot replica was busy
    (its stale running count scores it as loaded as the other): the request goes
    to the free slot, never to queue behind four."""
    four = ep("four", weight=4, in_flight=4, **read(4, waiting=0, running=4, slots=4))
    one = ep("one", weight=1, in_flight=0, **read(1, waiting=0, running=1, slots=1))
    for r in (0.0, 0.99):
        assert choose([four, one], NOW, admission=ONE_QUEUED, rng_value=r).endpoint is one


def test_an_engine_that_does_not_say_its_slots_has_room_until_it_queues() -> None:
    """vLLM says no slot count: sent since a reading with nothing queued is taken to
    have found room (an unknown is not saturation); once it queues, every request
    sent since queues too."""
    roomy = ep("roomy", in_flight=9, **read(0, waiting=0, running=0))
    assert not choose([roomy], NOW, admission=ONE_QUEUED).shed
    queueing = ep("queueing", in_flight=3, **read(2, waiting=1, running=8))
    choice = choose([queueing], NOW, admission=Admission(target_waiting=1))
    assert choice.shed and "waiting 2 > 1" in choice.reason
    # completions since the reading make room again
    queueing.in_flight = 1
    assert not choose([queueing], NOW, admission=Admission(target_waiting=1)).shed

"""The control plane's bank of leases (``llmgw.controlplane.leases``): several routers
spending one tenant's limits hold them exactly, refuse nothing the limit has room
for, lose at most a lease when killed, and a restart forgets no grant."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.controlplane.leases import COUNTED_S, GONE_S, HELD_S, LeaseBank, LeaseRefused, period_end
from llmgw.router.keys import ApiKey
from llmgw.router.quota import Quotas, Refusal, Short, Ticket
from llmgw.routing import LeaseAsk, LeaseBack, LeaseExchange, LeaseHold, Limits

WALL = 1_700_000_000.0
KEY = ApiKey("k", "h", tenant="acme")


class Fleet:
    """Routers spending one tenant's limits from one bank, as the app and the lease
    client do: a request short of a lease waits for an exchange; every router
    exchanges every second; one denied while others give back asks again."""

    def __init__(self, limits: Limits, routers: int) -> None:
        self.limits = {"acme": limits}
        self.bank = LeaseBank(lambda scope, owner: self.limits.get(owner))
        self.quotas = [Quotas() for _ in range(routers)]
        self.ticked = 0.0
        self.begun: list[float] = []

    def exchange(self, i: int, now: float) -> None:
        q = self.quotas[i]
        if q.exchange_in(self.bank.exchange(q.exchange_out(f"r{i}", now), WALL + now), now):
            self.exchange(i, now)  # asked to give back at once

    def tick(self, now: float) -> None:
        while self.ticked + 1 <= now:
            self.ticked += 1
            for i in range(len(self.quotas)):
                self.exchange(i, self.ticked)

    def ask(self, i: int, now: float, judge: object) -> object:
        for _ in range(4):
            got = judge(now)  # type: ignore[operator]
            if not isinstance(got, Short):
                return got
            self.quotas[i].wait(got, 1)
            self.exchange(i, now)
            self.quotas[i].wait(got, -1)
            if got.waits():
                for j in range(len(self.quotas)):  # the others' next exchange
                    if j != i:
                        self.exchange(j, now)
        raise AssertionError(f"still short after four exchanges: {got}")

    def request(self, i: int, now: float, tokens: int, used: int) -> Ticket | Refusal:
        """A request reserving ``tokens`` and using ``used``; ``begun`` has when each
        admitted one began (one refused for tokens still counts as a request)."""
        q = self.quotas[i]
        got = self.ask(i, now, lambda t: q.admit(KEY, self.limits, t))
        if isinstance(got, Refusal):
            return got
        assert isinstance(got, Ticket)
        self.begun.append(now)
        over = self.ask(i, now, lambda t: q.reserve(got, 0, tokens - 1, t))
        if isinstance(over, Refusal):
            got.release(now)
            return over
        got.settle(1, used - 1, now)
        got.release(now)
        return got


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.one_of(st.floats(0, 0.3), st.floats(0, 30)),  # bursts, and pauses
            st.integers(1, 40),
            st.floats(0, 1),
        ),
        min_size=1,
        max_size=150,
    ),
    st.integers(5, 40),
    st.one_of(st.none(), st.integers(100, 600)),
)
def test_routers_together_never_spend_past_a_minute_and_refuse_only_at_the_limit(
    requests: list[tuple[int, float, int, float]], rpm: int, tpm: int | None
) -> None:
    fleet = Fleet(Limits(rpm=rpm, tpm=tpm), 3)
    now = 0.0
    begun = fleet.begun
    spent: list[tuple[float, int]] = []
    for router, gap, tokens, share in requests:
        now += gap
        fleet.tick(now)
        used = max(1, math.floor(tokens * share))
        got = fleet.request(router, now, tokens, used)
        if isinstance(got, Ticket):
            spent.append((now, used))
            continue
        # refused: the limit had no room, counting what was spent within COUNTED_S
        recent = [t for t in begun if t > now - COUNTED_S]
        tokens_recent = sum(n for t, n in spent if t > now - COUNTED_S)
        if got.limit == "rpm":
            assert len(recent) + 1 > rpm, (got, len(recent))
        else:
            assert got.limit == "tpm" and tpm is not None, got
            assert tokens_recent + tokens > tpm, (got, tokens_recent)
    for t in begun:  # every minute, however it falls between the routers
        assert sum(1 for b in begun if t - 60 < b <= t) <= rpm
        assert tpm is None or sum(n for b, n in spent if t - 60 < b <= t) <= tpm


def test_a_router_denied_while_another_holds_unspent_is_served_once_that_comes_back() -> None:
    """Router 0, busy, holds requests ahead of need; router 1's need fits only in what
    router 0 holds and has not spent: told the limit is contended, router 0 gives it
    back, and router 1 is served: no request within the limit is refused."""
    fleet = Fleet(Limits(rpm=10), 2)
    for i in range(6):
        assert isinstance(fleet.request(0, i * 0.01, 1, 1), Ticket)
    unspent = sum(h.units for h in fleet.quotas[0].exchange_out("r0", 0.1).holds)
    assert unspent >= 1 and fleet.bank.used("tenant", "acme", "rpm", WALL) == 6 + unspent
    served = [fleet.request(1, 0.2, 1, 1) for _ in range(4)]
    assert all(isinstance(t, Ticket) for t in served), served
    assert isinstance(fleet.request(1, 0.3, 1, 1), Refusal)  # ten in the minute: now it is
    # what the operator sees: the contention counted, and said once in a line
    stats = fleet.bank.stats
    assert stats.denied.get(("rpm", "held_elsewhere"), 0) >= 1, stats
    assert stats.denied.get(("rpm", "limit"), 0) >= 1, stats
    assert stats.granted["rpm"] >= 10 and stats.exchanges > 0, stats
    assert fleet.bank.routers() == 2


def test_a_contended_limit_is_said_once_a_minute_and_counted_while_it_lasts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Router 0 holds what router 1's requests need, again and again: one log line
    names the limit and what to look at, not one per contention; the gauge counts
    the limit contended for a few seconds after."""
    limits = Limits(rpm=10)
    bank = LeaseBank(lambda scope, owner: limits)
    rpm = {"scope": "tenant", "owner": "acme", "kind": "rpm"}
    grab = LeaseExchange(router="r0", asks=[LeaseAsk(**rpm, units=10, needed=10)])
    assert bank.exchange(grab, WALL).grants[0].units == 10  # router 0 takes all there is
    for round in range(5):  # contended five times within a few seconds
        now = WALL + round * 0.5
        bank.exchange(LeaseExchange(router="r0", holds=[LeaseHold(**rpm, units=10)]), now)
        need = LeaseExchange(router="r1", asks=[LeaseAsk(**rpm, units=1, needed=1)])
        with caplog.at_level("INFO", "llmgw.tenants"):
            answer = bank.exchange(need, now)
        assert answer.denied and not answer.denied[0].final, answer
        assert bank.contended(now) == 1
    said = [r.getMessage() for r in caplog.records if "contended" in r.getMessage()]
    assert len(said) == 1, said
    assert "tenant 'acme': its rpm limit (10) is contended" in said[0]
    assert "llmgw ctl tenant show acme" in said[0]
    assert bank.contended(WALL + 100) == 0


def test_in_flight_across_routers_holds_and_a_killed_router_frees_its_slots() -> None:
    fleet = Fleet(Limits(in_flight=3), 2)
    q0, q1 = fleet.quotas
    held = [fleet.ask(0, 0, lambda t: q0.admit(KEY, fleet.limits, t)) for _ in range(2)]
    held.append(fleet.ask(1, 0, lambda t: q1.admit(KEY, fleet.limits, t)))
    assert all(isinstance(t, Ticket) for t in held)
    refused = fleet.ask(1, 0.5, lambda t: q1.admit(KEY, fleet.limits, t))
    assert isinstance(refused, Refusal) and refused.limit == "in_flight"
    # router 0 is killed with its two requests: its slots are free once it is gone
    fleet.quotas[0] = Quotas()
    assert fleet.bank.used("tenant", "acme", "in_flight", WALL + GONE_S - 1) == 3
    later = GONE_S + 1
    fleet.exchange(1, later)
    # router 1's own: its request, and a spare slot while it is busy
    assert fleet.bank.used("tenant", "acme", "in_flight", WALL + later) <= 2
    again = fleet.ask(1, later, lambda t: q1.admit(KEY, fleet.limits, t))
    assert isinstance(again, Ticket)


def test_a_killed_router_loses_its_budget_lease_and_no_more() -> None:
    fleet = Fleet(Limits(budget_day=10_000), 2)
    for i in range(20):  # busy: router 0 asks ahead of need
        fleet.request(0, i * 0.05, 100, 100)
    bank = fleet.bank
    granted = bank.used("tenant", "acme", "budget_day", WALL + 1)
    unspent = sum(h.units for h in fleet.quotas[0].exchange_out("r0", 1).holds)
    assert unspent > 0 and granted == 2000 + unspent
    fleet.quotas[0] = Quotas()  # killed: what it held is counted as spent
    served = 0
    for i in range(200):
        if isinstance(fleet.request(1, 2 + i * 0.05, 100, 100), Ticket):
            served += 100
    # the rest of the budget, all but what is too little for one more request
    assert 10_000 - granted - 100 < served <= 10_000 - granted


def admitted(fleet: Fleet, i: int, now: float) -> Ticket:
    """A request router ``i`` admits, its tokens not reserved yet."""
    q = fleet.quotas[i]
    ticket = fleet.ask(i, now, lambda t: q.admit(KEY, fleet.limits, t))
    assert isinstance(ticket, Ticket)
    return ticket


def reserving(fleet: Fleet, i: int, now: float, tokens: int) -> object:
    """What router ``i`` answers a request reserving ``tokens``, exchanging as it needs:
    None (reserved; the ticket is ``admitted``'s) or the refusal."""
    q, ticket = fleet.quotas[i], admitted(fleet, i, now)
    return fleet.ask(i, now, lambda t: q.reserve(ticket, 0, tokens - 1, t))


def reserved(fleet: Fleet, i: int, now: float, tokens: int) -> Ticket:
    """Router ``i`` admits a request reserving ``tokens`` and keeps it in flight."""
    q, ticket = fleet.quotas[i], admitted(fleet, i, now)
    assert fleet.ask(i, now, lambda t: q.reserve(ticket, 0, tokens - 1, t)) is None
    return ticket


def short_of(fleet: Fleet, i: int, now: float, tokens: int) -> Short:
    """Router ``i``'s request reserving ``tokens``, after one exchange that asked for it."""
    q = fleet.quotas[i]
    got = q.reserve(admitted(fleet, i, now), 0, tokens - 1, now)
    assert isinstance(got, Short), got
    q.wait(got, 1)
    fleet.exchange(i, now)
    q.wait(got, -1)
    return got


def test_a_budget_waits_for_what_requests_in_flight_reserved_rather_than_refuse_it() -> None:
    """A request reserves its worst case and gives back what it did not use at its end:
    a budget refused is refused until the day ends, so a need that what requests in
    flight reserved could meet waits for them (at any router, its own too) rather
    than being told the budget is used up."""
    fleet = Fleet(Limits(budget_day=1000), 2)
    long = reserved(fleet, 0, 0, 900)  # a long answer in flight at router 0
    fleet.tick(1)  # router 0 says what it holds: 900 reserved, and a little ahead
    assert fleet.bank.used("tenant", "acme", "budget_day", WALL + 1) >= 900
    waits = short_of(fleet, 1, 1.1, 200)
    assert waits.waits(), fleet.bank.stats.denied  # not refused: it may come back
    assert fleet.bank.stats.denied == {("budget_day", "held_elsewhere"): 1}
    long.settle(prompt=1, completion=99, now=1.2)  # used 100 of its 900
    long.release(1.2)
    reserved(fleet, 1, 1.3, 200)  # served from what came back

    # its own requests in flight too, at a router of its own; and once they used what
    # they reserved, a need past the budget is refused for good, saying so
    alone = Fleet(Limits(budget_day=1000), 1)
    long = reserved(alone, 0, 0, 900)
    alone.tick(1)
    assert short_of(alone, 0, 1.1, 200).waits()
    long.settle(prompt=1, completion=899, now=1.2)  # used all it reserved
    long.release(1.2)
    refused = reserving(alone, 0, 1.3, 200)
    assert isinstance(refused, Refusal) and refused.budget, refused


def test_what_a_killed_router_reserved_is_waited_for_no_longer_than_it_is_heard_from() -> None:
    fleet = Fleet(Limits(budget_day=1000), 2)
    reserved(fleet, 0, 0, 900)
    fleet.tick(1)
    fleet.quotas[0] = Quotas()  # killed, with its request: the 900 are lost, counted
    waits = short_of(fleet, 1, 2, 200)
    assert waits.waits()
    # out of time meanwhile (the app waits 5 s at most): refused for now, not for the day
    held = waits.denied()
    assert held is not None and held.held and not held.budget and held.retry_after_s == 1
    assert "its budget of 1000 tokens a day is held for now by other routers" in held.message
    later = 1 + HELD_S + 0.5  # router 0 not heard from since 1: nothing may come back
    refused = reserving(fleet, 1, later, 200)
    assert isinstance(refused, Refusal) and refused.budget and not refused.held, refused
    assert "has used its budget of 1000 tokens a day" in refused.message


def test_a_budget_is_held_for_its_period_and_refused_with_when_it_resets() -> None:
    fleet = Fleet(Limits(budget_month=500), 1)
    assert isinstance(fleet.request(0, 0, 400, 400), Ticket)
    refused = fleet.request(0, 1, 200, 200)
    assert isinstance(refused, Refusal) and refused.limit == "budget_month"
    assert refused.retry_after_s == pytest.approx(period_end("budget_month", WALL + 1) - WALL - 1)


def test_a_restarted_bank_knows_every_grant_it_made(tmp_path: Path) -> None:
    limits = {"acme": Limits(rpm=10, budget_day=1000)}
    path = tmp_path / "leases.json"
    bank = LeaseBank(lambda s, o: limits.get(o), path)
    ask = [
        LeaseAsk(scope="tenant", owner="acme", kind="rpm", units=8, needed=8),
        LeaseAsk(scope="tenant", owner="acme", kind="budget_day", units=900, needed=900),
    ]
    answer = trio.run(bank.serve, LeaseExchange(router="r1", asks=ask), WALL)
    assert [g.units for g in answer.grants] == [8, 900]
    again = LeaseBank(lambda s, o: limits.get(o), path)
    assert again.used("tenant", "acme", "rpm", WALL + 1) == 8
    assert again.used("tenant", "acme", "budget_day", WALL + 1) == 900
    more = again.exchange(LeaseExchange(router="r2", asks=[ask[1]]), WALL + 2)
    assert [d.kind for d in more.denied] == ["budget_day"] and more.denied[0].final


def test_a_bank_whose_file_cannot_be_written_grants_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    limits = {"acme": Limits(rpm=10)}
    bank = LeaseBank(lambda s, o: limits.get(o), tmp_path / "ro" / "leases.json")
    ask = [LeaseAsk(scope="tenant", owner="acme", kind="rpm", units=1, needed=1)]
    try:
        for i in range(3):
            answer = trio.run(bank.serve, LeaseExchange(router="r", asks=ask), WALL + i)
            assert answer.grants
    finally:
        (tmp_path / "ro").chmod(0o700)
    said = [r for r in caplog.records if "leases not saved" in r.message]
    if said:  # as root the directory is writable whatever its mode
        assert len(said) == 1


@pytest.mark.parametrize(
    ("ex", "said"),
    [
        (LeaseExchange(router=""), "router must be"),
        (
            LeaseExchange(router="r", asks=[LeaseAsk(scope="t", owner="a", kind="rpm", units=1)]),
            "scope must be one of",
        ),
        (
            LeaseExchange(
                router="r",
                backs=[LeaseBack(scope="tenant", owner="a/b", kind="rpm", units=1, grant=0)],
            ),
            "owner must be",
        ),
        (
            LeaseExchange(
                router="r",
                asks=[LeaseAsk(scope="tenant", owner="a", kind="rpm", units=1, needed=2)],
            ),
            "needed must be between",
        ),
    ],
)
def test_an_exchange_not_well_formed_changes_nothing(ex: LeaseExchange, said: str) -> None:
    bank = LeaseBank(lambda s, o: Limits(rpm=1))
    with pytest.raises(LeaseRefused, match=said):
        bank.exchange(ex, WALL)
    assert bank.used("tenant", "a", "rpm", WALL) == 0

"""A tenant's limits at one router (``llmgw.router.quota``), spent from leases of a
control plane's bank (``llmgw.controlplane.leases``): what it asks, what it gives
back, how a request waits, and what a refusal says."""

from __future__ import annotations

import math
from collections.abc import Callable

from llmgw.controlplane.leases import LEASE_S, LeaseBank
from llmgw.router.keys import ApiKey
from llmgw.router.quota import IDLE_S, UNBOUNDED, Quotas, Refusal, Short, Ticket
from llmgw.routing import Limits

A = ApiKey("a1", "h1", tenant="acme")
A2 = ApiKey("a2", "h2", tenant="acme", limits=Limits(rpm=1))
WALL = 1_700_000_000.0  # the bank's clock; the router's starts at 0


class Router:
    """One router's quotas and its exchanges with ``bank``, on a clock of its own."""

    def __init__(self, bank: LeaseBank, tenants: dict[str, Limits], name: str = "r1") -> None:
        self.bank, self.tenants, self.name = bank, tenants, name
        self.quotas = Quotas()
        self.peers: list[Router] = []  # exchange when the bank says the limit is contended

    def exchange(self, now: float) -> None:
        ex = self.quotas.exchange_out(self.name, now)
        if self.quotas.exchange_in(self.bank.exchange(ex, WALL + now), now):
            self.exchange(now)  # asked to give back at once

    def judged(self, judge: Callable[[], Ticket | Refusal | Short | None], now: float) -> object:
        """As the app does: a request short of a lease waits for an exchange; denied
        while peers give back, it asks again after theirs."""
        for _ in range(3):
            got = judge()
            if not isinstance(got, Short):
                return got
            self.quotas.wait(got, 1)
            self.exchange(now)
            self.quotas.wait(got, -1)
            if got.waits():
                for peer in self.peers:
                    peer.exchange(now)
        raise AssertionError(f"still short: {got}")

    def admit(self, key: ApiKey, now: float) -> Ticket | Refusal:
        got = self.judged(lambda: self.quotas.admit(key, self.tenants, now), now)
        assert isinstance(got, Ticket | Refusal)
        return got

    def reserve(self, ticket: Ticket, prompt: int, completion: int | None, now: float) -> object:
        return self.judged(lambda: self.quotas.reserve(ticket, prompt, completion, now), now)


def bank_of(tenants: dict[str, Limits], keys: dict[str, Limits] | None = None) -> LeaseBank:
    return LeaseBank(lambda scope, owner: (tenants if scope == "tenant" else keys or {}).get(owner))


def admitted(got: Ticket | Refusal) -> Ticket:
    assert isinstance(got, Ticket), got
    return got


def test_a_key_of_no_tenant_counts_nothing_and_asks_nothing() -> None:
    router = Router(bank_of({}), {})
    ticket = admitted(router.quotas.admit(ApiKey("cfg", "h"), {}, 0.0))
    assert ticket.scopes == [] and router.quotas.reserve(ticket, 10**6, None, 0) is None
    assert not router.quotas.holding()


def test_a_request_waits_on_its_first_lease_then_the_router_asks_ahead() -> None:
    limits = {"acme": Limits(rpm=100)}
    router = Router(bank_of(limits), limits)
    first = router.quotas.admit(A, limits, 0.0)
    assert isinstance(first, Short)  # nothing held yet: it waits for an exchange
    router.quotas.wait(first, 1)
    ex = router.quotas.exchange_out("r1", 0.0)
    assert [(a.kind, a.units, a.needed) for a in ex.asks] == [("rpm", 1, 1)]
    router.quotas.wait(first, -1)
    router.quotas.exchange_in(router.bank.exchange(ex, WALL), 0.0)
    ticket = admitted(router.quotas.admit(A, limits, 0.0))
    assert dict(ticket.headers())["x-ratelimit-limit-requests"] == "100"
    for t in range(1, 10):  # spending 1 a second: it asks for what 2 s will need
        router.quotas.admit(A, limits, t * 0.1)
    ahead = router.quotas.exchange_out("r1", 1.0).asks
    assert ahead and ahead[0].needed == 0 and ahead[0].units >= 1


def test_in_flight_slots_are_held_used_and_given_back_when_idle() -> None:
    limits = {"acme": Limits(in_flight=2)}
    bank = bank_of(limits)
    router = Router(bank, limits)
    one = admitted(router.admit(A, 0))
    two = admitted(router.admit(A2, 0))
    refused = router.admit(A, 0)  # both slots are out: the bank denies a third
    assert isinstance(refused, Refusal) and (refused.limit, refused.scope) == (
        "in_flight",
        "tenant",
    )
    assert "tenant 'acme' is at its limit of 2 requests in flight" in refused.message
    one.release(1)
    one.release(1)  # twice is once
    admitted(router.admit(A, 1.5))
    two.release(2)
    assert bank.used("tenant", "acme", "in_flight", WALL) == 2
    router.exchange(2 + IDLE_S)  # one still in use: the other slot goes back
    assert bank.used("tenant", "acme", "in_flight", WALL) == 1


def test_two_routers_share_a_tenants_limit_and_neither_is_refused_within_it() -> None:
    limits = {"acme": Limits(rpm=10)}
    bank = bank_of(limits)
    r1, r2 = Router(bank, limits, "r1"), Router(bank, limits, "r2")
    r1.peers, r2.peers = [r2], [r1]
    got = [isinstance(r.admit(A, i * 0.1), Ticket) for i, r in enumerate([r1, r2] * 5)]
    assert got == [True] * 10
    for r in (r1, r2):
        refused = r.admit(A, 1.0)
        assert isinstance(refused, Refusal) and refused.limit == "rpm"
    assert "it resets in" in refused.message


def test_a_keys_own_limit_holds_within_its_tenants() -> None:
    limits = {"acme": Limits(rpm=10)}
    router = Router(bank_of(limits, {"a2": Limits(rpm=1)}), limits)
    first = admitted(router.admit(A2, 0))
    shown = dict(first.headers())  # the tighter of the two
    assert shown["x-ratelimit-limit-requests"] == "1"
    assert shown["x-ratelimit-remaining-requests"] == "0"
    refused = router.admit(A2, 1)
    assert isinstance(refused, Refusal) and (refused.scope, refused.owner) == ("key", "a2")
    admitted(router.admit(A, 1))  # the tenant's other key: 2 of its 10


def test_tokens_are_reserved_at_their_worst_and_what_was_not_used_returns() -> None:
    """A burst cannot overspend: each request reserves its prompt and max_tokens before
    any ends; at its end what was not used is the router's to spend again."""
    limits = {"acme": Limits(tpm=1000)}
    bank = bank_of(limits)
    router = Router(bank, limits)
    one = admitted(router.admit(A, 0))
    assert router.reserve(one, 300, 400, 0) is None  # 101 + 400: granted 501 of 1000
    two = admitted(router.admit(A, 0))
    assert router.reserve(two, 300, 300, 0) is None  # 401 of the 499 left
    assert bank.used("tenant", "acme", "tpm", WALL) == 902
    three = admitted(router.admit(A, 0))
    refused = router.reserve(three, 300, 400, 0)
    assert isinstance(refused, Refusal) and refused.limit == "tpm"
    assert "tokens per minute: it resets in 70 s" in refused.message
    one.settle(prompt=90, completion=10, now=1)  # used 100 of its 501: 401 back here
    assert router.reserve(three, 300, 300, 1) is None  # 401 fits what came back


def test_a_request_larger_than_the_limit_is_told_to_lower_max_tokens_at_once() -> None:
    limits = {"acme": Limits(tpm=1000, budget_day=10**6)}
    router = Router(bank_of(limits), limits)
    ticket = admitted(router.admit(A, 0))
    refused = router.quotas.reserve(ticket, 30, None, 0)  # no exchange needed to say so
    assert isinstance(refused, Refusal) and refused.asked == 11 + UNBOUNDED
    assert "more than tenant 'acme''s limit of 1000 tokens per minute: lower max_tokens" in (
        refused.message
    )


def test_a_spent_budget_is_refused_until_the_day_ends_and_says_so() -> None:
    limits = {"acme": Limits(budget_day=1000)}
    bank = bank_of(limits)
    router = Router(bank, limits)
    for _ in range(2):
        ticket = admitted(router.admit(A, 0))
        assert router.reserve(ticket, 0, 499, 0) is None
        ticket.settle(prompt=1, completion=499, now=0)
    ticket = admitted(router.admit(A, 1))
    refused = router.reserve(ticket, 0, 10, 1)
    assert isinstance(refused, Refusal) and refused.budget and refused.limit == "budget_day"
    day_left = 86400 - (WALL + 1) % 86400
    assert math.isclose(refused.retry_after_s, day_left, abs_tol=1)
    assert "tenant 'acme' has used its budget of 1000 tokens a day: it resets in" in (
        refused.message
    )


def test_grants_past_their_time_go_back_with_their_id() -> None:
    limits = {"acme": Limits(rpm=100)}
    bank = bank_of(limits)
    router = Router(bank, limits)
    for i in range(5):  # busy: the router holds more than it spent
        admitted(router.admit(A, i * 0.1))
    held = bank.used("tenant", "acme", "rpm", WALL)
    assert held > 5
    ex = router.quotas.exchange_out("r1", LEASE_S + 0.5)
    assert sum(b.units for b in ex.backs) == held - 5 and {b.grant for b in ex.backs} == {int(WALL)}
    router.quotas.unsent(ex)  # the control plane away: given back with the next
    again = router.quotas.exchange_out("r1", LEASE_S + 1)
    assert sum(b.units for b in again.backs) == held - 5
    bank.exchange(again, WALL + LEASE_S + 1)
    assert bank.used("tenant", "acme", "rpm", WALL + LEASE_S + 1) == 5  # what was spent

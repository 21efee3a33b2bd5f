"""A tenant's limits at one router (``llmgw.router.quota``): in flight, per minute,
the key's own within its tenant's, and the headers a client reads."""

from __future__ import annotations

from llmgw.router.keys import ApiKey
from llmgw.router.quota import FREE, Quotas, Refusal, Ticket
from llmgw.routing import Limits

A = ApiKey("a1", "h1", tenant="acme")
A2 = ApiKey("a2", "h2", tenant="acme", limits=Limits(rpm=1))


def admitted(got: Ticket | Refusal) -> Ticket:
    assert isinstance(got, Ticket), got
    return got


def test_a_key_of_no_tenant_counts_nothing() -> None:
    assert Quotas().admit(ApiKey("cfg", "h"), {}, 0.0) is FREE


def test_in_flight_holds_until_a_ticket_is_handed_back_once() -> None:
    quotas, limits = Quotas(), {"acme": Limits(in_flight=2)}
    one, two = admitted(quotas.admit(A, limits, 0)), admitted(quotas.admit(A2, limits, 0))
    refused = quotas.admit(A, limits, 0)
    assert isinstance(refused, Refusal) and (refused.limit, refused.scope) == (
        "in_flight",
        "tenant",
    )
    assert "tenant 'acme' is at its limit of 2 requests in flight" in refused.message
    one.release()
    one.release()  # twice is once
    admitted(quotas.admit(A, limits, 0))
    assert isinstance(quotas.admit(A, limits, 0), Refusal)
    two.release()
    assert not one.headers()  # no per-minute limit: no headers


def test_a_sliding_minute_and_when_it_has_room_again() -> None:
    quotas, limits = Quotas(), {"acme": Limits(rpm=3)}
    seen = [admitted(quotas.admit(A, limits, t)) for t in (0.0, 10.0, 20.0)]
    assert [t.remaining for t in seen] == [2, 1, 0]
    assert dict(seen[0].headers())["x-ratelimit-reset-requests"] == "60s"
    refused = quotas.admit(A, limits, 30.0)
    assert isinstance(refused, Refusal) and refused.limit == "rpm"
    assert refused.retry_after_s == 30.0  # the first leaves the window at 60
    assert "it resets in 30 s" in refused.message
    admitted(quotas.admit(A, limits, 60.5))


def test_a_keys_own_limit_holds_within_its_tenants() -> None:
    quotas, limits = Quotas(), {"acme": Limits(rpm=10)}
    first = admitted(quotas.admit(A2, limits, 0))
    assert (first.rpm, first.remaining) == (1, 0)  # the tighter of the two is shown
    refused = quotas.admit(A2, limits, 1)
    assert isinstance(refused, Refusal) and (refused.scope, refused.owner) == ("key", "a2")
    admitted(quotas.admit(A, limits, 1))  # the tenant's other key: 2 of its 10
    tenant_left = admitted(quotas.admit(A, limits, 2)).remaining
    assert tenant_left == 7  # the refused request counted nowhere

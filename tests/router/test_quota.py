"""A tenant's limits at one router (``llmgw.router.quota``): in flight, per minute,
the key's own within its tenant's, and the headers a client reads."""

from __future__ import annotations

from llmgw.router.keys import ApiKey
from llmgw.router.quota import UNBOUNDED, Quotas, Refusal, Ticket
from llmgw.routing import Limits

A = ApiKey("a1", "h1", tenant="acme")
A2 = ApiKey("a2", "h2", tenant="acme", limits=Limits(rpm=1))


def admitted(got: Ticket | Refusal) -> Ticket:
    assert isinstance(got, Ticket), got
    return got


def test_a_key_of_no_tenant_counts_nothing() -> None:
    ticket = admitted(Quotas().admit(ApiKey("cfg", "h"), {}, 0.0))
    assert ticket.usages == [] and ticket.reserve(10**6, None, 0) is None


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
    assert [dict(t.headers())["x-ratelimit-remaining-requests"] for t in seen] == ["2", "1", "0"]
    assert dict(seen[0].headers())["x-ratelimit-reset-requests"] == "60s"
    refused = quotas.admit(A, limits, 30.0)
    assert isinstance(refused, Refusal) and refused.limit == "rpm"
    assert refused.retry_after_s == 30.0  # the first leaves the window at 60
    assert "it resets in 30 s" in refused.message
    admitted(quotas.admit(A, limits, 60.5))


def test_a_keys_own_limit_holds_within_its_tenants() -> None:
    quotas, limits = Quotas(), {"acme": Limits(rpm=10)}
    first = admitted(quotas.admit(A2, limits, 0))
    shown = dict(first.headers())  # the tighter of the two
    assert (shown["x-ratelimit-limit-requests"], shown["x-ratelimit-remaining-requests"]) == (
        "1",
        "0",
    )
    refused = quotas.admit(A2, limits, 1)
    assert isinstance(refused, Refusal) and (refused.scope, refused.owner) == ("key", "a2")
    admitted(quotas.admit(A, limits, 1))  # the tenant's other key: 2 of its 10
    tenant_left = dict(admitted(quotas.admit(A, limits, 2)).headers())
    assert tenant_left["x-ratelimit-remaining-requests"] == "7"  # the refused one counted nowhere


def test_tokens_are_reserved_at_their_worst_and_settled_on_what_was_used() -> None:
    """A burst cannot overspend: each request reserves its prompt and max_tokens before
    any ends; at its end what the engine said replaces the reservation."""
    quotas, limits = Quotas(), {"acme": Limits(tpm=1000)}
    one = admitted(quotas.admit(A, limits, 0))
    assert one.reserve(300, 400, 0) is None  # 101 + 400
    two = admitted(quotas.admit(A, limits, 0))
    refused = two.reserve(300, 400, 1)  # 501 more would make 1002
    assert isinstance(refused, Refusal) and refused.limit == "tpm"
    assert (
        refused.retry_after_s == 59.0 and "tokens per minute: it resets in 59 s" in refused.message
    )
    one.settle(prompt=90, completion=10)  # used 100 of its 501
    assert two.reserve(300, 400, 2) is None  # 100 + 501
    assert dict(two.headers())["x-ratelimit-remaining-tokens"] == "399"
    three = admitted(quotas.admit(A, limits, 3))
    assert isinstance(three.reserve(0, 500, 3), Refusal)  # 1 + 500 > 399 left
    two.settle(prompt=0, completion=50)  # the engine gave no prompt count: the estimate
    assert three.reserve(0, 500, 3) is None  # 100 + 151 + 501 = 752


def test_a_request_larger_than_the_limit_says_to_lower_max_tokens() -> None:
    quotas = Quotas()
    ticket = admitted(quotas.admit(A, {"acme": Limits(tpm=1000)}, 0))
    refused = ticket.reserve(30, None, 0)
    assert isinstance(refused, Refusal) and refused.asked == 11 + UNBOUNDED
    assert "more than tenant 'acme''s limit of 1000 tokens per minute: lower max_tokens" in (
        refused.message
    )


def test_tokens_leave_the_window_after_a_minute_and_a_late_settle_changes_nothing() -> None:
    quotas, limits = Quotas(), {"acme": Limits(tpm=600)}
    early = admitted(quotas.admit(A, limits, 0))
    assert early.reserve(0, 499, 0) is None  # 500
    late = admitted(quotas.admit(A, limits, 30))
    assert isinstance(late.reserve(0, 199, 30), Refusal)
    assert late.reserve(0, 199, 60.5) is None  # the first left the window
    early.settle(prompt=10, completion=490)  # after it left: counts nowhere now
    other = admitted(quotas.admit(A, limits, 61))
    assert other.reserve(0, 399, 61) is None  # 200 + 400 = 600

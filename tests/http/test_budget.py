"""The body budget's sharing rule, in pure code (the server's own tests drive it over
real connections: test_abuse.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.http._budget import BodyBudget, Holding


def test_a_holder_within_its_share_takes_room_from_the_one_most_over() -> None:
    budget = BodyBudget(300)
    dropped: list[str] = []
    greedy = [budget.hold("g", f"10.0.0.{i}", lambda i=i: dropped.append(f"g{i}")) for i in (1, 2)]
    assert budget.charge(greedy[0], 200) and budget.charge(greedy[1], 100)
    # the same key, anywhere: over its share, refused
    more = budget.hold("g", "10.0.0.3", lambda: dropped.append("more"))
    assert not budget.charge(more, 10)
    # another key, from a third address: its share is a third (by address); more is
    # refused, and within it the greedy key's largest body goes
    good = budget.hold("k", "10.0.0.9", lambda: dropped.append("good"))
    assert not budget.charge(good, 101)
    assert budget.charge(good, 90)
    assert dropped == ["g1"]
    assert budget.used == 190 and budget.held_by(principal="g") == 100
    assert not budget.charge(greedy[0], 1)  # a dropped body takes nothing more


def test_a_body_already_complete_is_never_dropped() -> None:
    budget = BodyBudget(100)
    done = budget.hold("g", "a", lambda: None)
    assert budget.charge(done, 100)
    budget.done_reading(done)
    asking = budget.hold("k", "b", lambda: None)
    assert not budget.charge(asking, 10)  # nothing it may take
    budget.release(done)
    assert budget.charge(asking, 10)
    assert budget.used == 10


def test_one_address_with_many_keys_is_shared_by_address() -> None:
    budget = BodyBudget(100)
    drops: list[int] = []
    many = [budget.hold(f"key{i}", "1.2.3.4", lambda i=i: drops.append(i)) for i in range(4)]
    for h in many:
        assert budget.charge(h, 25)
    other = budget.hold("other", "5.6.7.8", lambda: None)
    assert not budget.charge(other, 21)  # one key of five: a fifth at most
    assert budget.charge(other, 20)  # the address holding everything gives way
    assert len(drops) == 1 and budget.used == 95


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["charge", "done", "release"]),
            st.integers(0, 7),
            st.integers(1, 60),
        ),
        max_size=60,
    )
)
def test_what_is_held_always_adds_up_and_stays_within_the_limit(
    steps: list[tuple[str, int, int]],
) -> None:
    budget = BodyBudget(200)
    holdings: list[Holding] = []
    for i in range(8):
        holdings.append(budget.hold(("a", "b", "")[i % 3], f"10.0.0.{i % 4}", lambda: None))
    for op, i, n in steps:
        h = holdings[i]
        if op == "charge":
            before = budget.used
            took = budget.charge(h, n)
            assert took or budget.used == before
        elif op == "done":
            budget.done_reading(h)
        else:
            budget.release(h)
        assert 0 <= budget.used <= budget.limit
        assert budget.used == sum(x.held for x in holdings)
        for p in ("a", "b"):
            assert budget.held_by(principal=p) == sum(x.held for x in holdings if x.principal == p)
        for j in range(4):
            address = f"10.0.0.{j}"
            assert budget.held_by(address=address) == sum(
                x.held for x in holdings if x.address == address
            )
        assert all(x.held == 0 for x in holdings if x.dropped)

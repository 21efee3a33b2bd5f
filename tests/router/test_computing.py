"""Waiting for a copy of a prompt on a replica to come free, without a network: which
requests hold which blocks, how many copies there are, and how long a request waits
by what is known of the replica's pace (the real engine's side is
``test_affinity_llama``)."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.router.computing import Computing, Entry
from llmgw.router.waits import WAIT_S, enter

SYSTEM = (11, 12, 13)  # a system prompt's blocks
ONE = (*SYSTEM, 21)  # two users' prompts behind it
TWO = (*SYSTEM, 22)


def test_a_prompt_is_busy_while_as_many_hold_it_as_there_are_copies() -> None:
    computing = Computing()
    assert computing.busy(ONE, 3) is None and computing.free(ONE, 3)  # none in flight
    first = computing.enter(ONE, 0, 0.0, streamed=True, slots=2)  # computes it all
    assert not computing.free(TWO, 3) and computing.free(TWO, 0)
    assert computing.busy(TWO, 3) == [first]
    assert computing.busy(TWO, 2) == [first]
    assert computing.busy(TWO, 0) is None  # it holds nothing of it
    first.end()
    first.end()  # once
    assert computing.busy(TWO, 3) is None and len(computing) == 0
    # one in flight on the one copy; a second sent anyway computes another
    a = computing.enter(ONE, 3, 1.0, streamed=True, slots=2)
    b = computing.enter(TWO, 3, 1.0, streamed=True, slots=2)
    assert computing.busy(ONE, 3) == [a, b]
    a.end()
    assert computing.busy(ONE, 3) is None  # two copies, one in flight
    c = computing.enter(ONE, 3, 2.0, streamed=True, slots=2)
    assert computing.busy(TWO, 3) == [b, c]
    d = computing.enter(TWO, 3, 2.0, streamed=True, slots=2)  # no more copies than slots
    b.end()
    assert computing.busy(ONE, 3) == [c, d]
    for e in (c, d):
        e.end()
    # a prompt new to the replica again (evicted, and sent whole) has one copy again
    e = computing.enter(ONE, 0, 3.0, streamed=True, slots=2)
    assert computing.busy(TWO, 3) == [e]


async def test_waiters_go_one_at_a_time_as_the_slot_holding_it_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()
    first = computing.enter(ONE, 0, trio.current_time(), streamed=True, slots=2)
    went: list[tuple[str, float, bool]] = []

    async def user(name: str, blocks: tuple[int, ...], holds_for: float) -> None:
        entry, waited, idle = await enter(computing, blocks, 3, 10.0, streamed=True, slots=2)
        went.append((name, waited, idle))
        await trio.sleep(holds_for)
        entry.end()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(user, "second", TWO, 1.0)
        await trio.sleep(0.1)
        nursery.start_soon(user, "third", ONE, 1.0)
        await trio.sleep(0.9)
        first.end()  # at 1 s: the second goes, and the third waits for it
    assert went == [("second", 1.0, True), ("third", 1.9, True)], went


async def test_unpaced_a_request_waits_for_the_first_token_then_as_long_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()

    async def engine(entry: Entry, first_after: float, ends_after: float) -> None:
        await trio.sleep(first_after)
        entry.first_token(trio.current_time())
        await trio.sleep(ends_after)
        entry.end()

    for reply_s, waited, idle in ((2.5, 5.5, True), (10.0, 6.0, False)):
        # prefill 3 s, then the reply: a reply longer than the prefill again is not
        # waited for, as computing it again costs less than that
        first = computing.enter(ONE, 0, trio.current_time(), streamed=True, slots=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine, first, 3.0, reply_s)
            second, took, found = await enter(computing, TWO, 3, 0.0, streamed=True, slots=2)
            assert (took, found) == (waited, idle)
            second.end()
    # unpaced, and the one in flight not streamed: no first token to go by
    first = computing.enter(ONE, 0, trio.current_time(), streamed=False, slots=2)
    second, took, found = await enter(computing, TWO, 3, 0.0, streamed=True, slots=2)
    assert (took, found) == (0.0, False)


async def test_paced_a_request_waits_at_most_its_budget_and_never_past_wait_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()
    computing.enter(ONE, 0, trio.current_time(), streamed=False, slots=2)
    _, took, found = await enter(computing, TWO, 3, 1.5, streamed=True, slots=2)
    assert (took, found) == (1.5, False)
    _, took, found = await enter(computing, TWO, 3, 10 * WAIT_S, streamed=True, slots=4)
    assert (took, found) == (WAIT_S, False)


async def test_a_request_that_ends_with_no_first_token_lets_its_waiters_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()
    first = computing.enter(ONE, 0, trio.current_time(), streamed=True, slots=2)

    async def fails() -> None:
        await trio.sleep(0.5)
        first.end()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fails)
        _, took, found = await enter(computing, TWO, 3, 0.0, streamed=True, slots=2)
    assert (took, found) == (0.5, True)

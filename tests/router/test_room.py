"""A model's queue (``llmgw.router.room``): a freed slot wakes one waiter, the head of
the line whose owner stands best at that moment; the chain goes on from there, and a
wake is never lost with a waiter that leaves."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.router.room import Room


async def _waiters(
    nursery: trio.Nursery, room: Room, owners: list[str], woke: list[int]
) -> list[trio.CancelScope]:
    """One task waiting in ``room`` per owner given, in that order (far deadline); each
    appends its place to ``woke`` when its wait returns. Their cancel scopes."""
    scopes: list[trio.CancelScope] = []

    async def one(owner: str, place: int, scope: trio.CancelScope) -> None:
        with scope:
            await room.wait(trio.current_time() + 1e6, owner, place)
            woke.append(place)

    for owner in owners:
        scope = trio.CancelScope()
        scopes.append(scope)
        nursery.start_soon(one, owner, room.place(), scope)
    await trio.testing.wait_all_tasks_blocked()
    return scopes


async def test_a_wake_lets_the_head_of_the_best_standing_line_look_and_only_it() -> None:
    standing = {"noisy": 5.0, "quiet": 1.0, "mid": 3.0}
    room = Room(lambda owner: standing[owner])
    woke: list[int] = []
    async with trio.open_nursery() as nursery:
        # places 0..4: noisy, noisy, quiet, mid, quiet
        await _waiters(nursery, room, ["noisy", "noisy", "quiet", "mid", "quiet"], woke)
        assert len(room) == 5
        assert room.ahead("noisy", room.place())  # everyone is before a new noisy one
        standing["new"] = 0.0  # it used less than anyone waiting: it goes first
        assert not room.ahead("new", room.place())
        assert room.ahead("quiet", 9) and not room.ahead("quiet", 1)  # its own line: in turn
        room.wake()
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [2]  # quiet's head, alone: the rest stay asleep
        standing["mid"] = 0.5  # the order is judged when room frees, not when one came
        room.wake()
        room.wake()  # two wakes before anyone runs: two different waiters
        await trio.testing.wait_all_tasks_blocked()
        assert woke[0] == 2 and sorted(woke[1:]) == [3, 4]  # trio runs them in any order
        room.wake(after=0)  # only those that came after place 0 may use this one
        await trio.testing.wait_all_tasks_blocked()
        assert woke[3:] == [1]
        room.wake_all()
    assert woke[3:] == [1, 0] and len(room) == 0


async def test_a_woken_waiter_that_leaves_passes_its_wake_on() -> None:
    room = Room()
    woke: list[int] = []
    async with trio.open_nursery() as nursery:
        scopes = await _waiters(nursery, room, ["a", "b", "c"], woke)
        scopes[0].cancel()  # its client leaves, and a slot frees before it is gone
        room.wake()
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [1]  # the next in turn looked in its place
        scopes[2].cancel()  # one that was not woken leaves: nothing is passed on
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [1] and len(room) == 0


async def test_a_waiter_of_no_owner_is_woken_by_every_wake_and_keeps_no_one_back() -> None:
    room = Room()
    woke: list[str] = []

    async def unowned() -> None:
        await room.wait(trio.current_time() + 1e6)
        woke.append("suspect")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unowned)
        await _waiters(nursery, room, ["a"], [])
        assert len(room) == 2
        assert room.ahead("b", room.place())  # a waits, and came first
        assert not room.ahead("a", -1)  # the suspect keeps no one back
        room.wake()
        await trio.testing.wait_all_tasks_blocked()
        assert woke == ["suspect"]
        room.wake_all()

"""Requests queued for room on a model's replicas, woken the moment there may be some.

Theory of operation
-------------------
When every replica of a model is above its admission thresholds, a request
may wait up to the router's ``queue_timeout_s`` for room before it is shed
(``Proxy``). It waits in its model's ``Room``, and whatever can give room back
wakes every request waiting there, each of which chooses again
(``balancer.choose``) and waits again if it still finds none:

- a request on one of the model's replicas ends (``Lease.finish``): the
  router's own in-flight count, which admission reads, has dropped;
- a reading of a replica's gauges arrives (the table's scrape): its engine's
  queue is what it says now;
- the routing table changes (a replica becomes Ready, stops draining, is
  added), and every scrape beat, which covers what time alone changes (a
  breaker's cool-down ends, a reading grows too old to count).

A woken request that is given a replica counts on it before the next one
chooses (no await between the choice and ``Lease``), so one free slot admits
one request however many were woken. Waiters go in the order of their rank
(``llmgw.router.fair``): one that is not first waits again while a better one
waits, and one that took room wakes the next in rank.

Every wait has a bound: a waiter chooses again at least every ``RECHECK_S``, in
case something changed that nothing here was told of, and leaves at its
deadline.
"""

from __future__ import annotations

import itertools
import math

import trio

# the longest a queued request waits before choosing again, woken or not
RECHECK_S = 1.0


class Room:
    """Where one model's queued requests wait for room, each with its rank
    (``llmgw.router.fair``): the lower, the sooner."""

    __slots__ = ("_order", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[tuple[float, int], trio.Event] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        """How many requests wait here now."""
        return len(self._waiting)

    def wake(self) -> None:
        """There may be room now: every waiter chooses again."""
        for event in self._waiting.values():
            event.set()

    def wake_first(self) -> None:
        """A waiter took room: the next in rank looks at once (there may be more)."""
        if self._waiting:
            self._waiting[min(self._waiting)].set()

    def ahead(self, rank: tuple[float, int]) -> bool:
        """Whether a request of a better rank waits here (it goes first)."""
        return bool(self._waiting) and min(self._waiting) < rank

    async def wait(self, deadline: float, rank: tuple[float, int] | None = None) -> None:
        """Until woken, ``RECHECK_S`` has passed, or ``deadline``, whichever is first.
        ``rank``: its place in the queue; None: it keeps no one waiting (it is last)."""
        if rank is None:
            rank = (math.inf, next(self._order))
        event = self._waiting[rank] = trio.Event()
        try:
            with trio.move_on_at(min(deadline, trio.current_time() + RECHECK_S)):
                await event.wait()
        finally:
            del self._waiting[rank]


class Rooms:
    """Every model's ``Room``, made on first use."""

    __slots__ = ("_rooms",)

    def __init__(self) -> None:
        self._rooms: dict[str, Room] = {}

    def __call__(self, model: str) -> Room:
        room = self._rooms.get(model)
        if room is None:
            room = self._rooms[model] = Room()
        return room

    def wake(self, model: str) -> None:
        room = self._rooms.get(model)
        if room is not None:
            room.wake()

    def wake_all(self) -> None:
        for room in self._rooms.values():
            room.wake()

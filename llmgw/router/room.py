"""Requests queued for room on a model's replicas, woken the moment there may be some.

Theory of operation
-------------------
When every replica of a model is above its admission thresholds, a request
may wait up to the router's ``queue_timeout_s`` for room before it is shed
(``Proxy``). It waits in its model's ``Room``, in its owner's line (its tenant,
or its key), each line in the order its requests came (``place``). Whatever can
give room back wakes one waiter: the head of the line whose owner stands best
now (``value``, ``llmgw.router.fair``: the fewest recent tokens over weight;
ties go to the earlier head). The woken one chooses again
(``balancer.choose``); what wakes one:

- a request on one of the model's replicas ends (``Lease.finish``): the
  router's own in-flight count, which admission reads, has dropped by one;
- a reading of a replica's gauges arrives (the table's scrape): its engine's
  queue is what it says now.

A woken request that is given a replica counts on it before the next one
chooses (no await between the choice and ``Lease``), and wakes the next
(``wake``): there may be more room. One that finds none waits again, and the
chain stops there, so a freed slot costs one waiter's look, not one per waiter
(with ninety waiting, waking them all made every finished request cost ninety
looks). A request that arrives while one that goes before it waits (``ahead``)
queues behind it. One that found no room only because it may not go back to a
replica it tried passes the wake on to those that came after it
(``wake(after=place)``: a chain that ends).

What changes more than one slot at once wakes everyone (``wake_all``): the
routing table changes (a replica becomes Ready, stops draining, is added), and
every scrape beat, which covers what time alone changes (a breaker's cool-down
ends, a reading grows too old to count). Waiters of no owner (a suspect waiting
for a replica of its own, ``poison``) keep no one waiting and are woken by
every wake.

Every wait has a bound: a waiter chooses again at least every ``RECHECK_S``, in
case something changed that nothing here was told of, and leaves at its
deadline.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

import trio

# the longest a queued request waits before choosing again, woken or not
RECHECK_S = 1.0


def _level(owner: str) -> float:
    return 0.0  # every owner alike: first come, first served


class _Line:
    """One owner's waiting requests, by place."""

    __slots__ = ("events", "places")

    def __init__(self) -> None:
        self.places: list[int] = []  # sorted
        self.events: dict[int, trio.Event] = {}

    def first(self, after: int) -> int | None:
        """The first place behind ``after`` whose waiter is not woken yet."""
        for place in itertools.islice(self.places, bisect.bisect_right(self.places, after), None):
            if not self.events[place].is_set():
                return place
        return None


class Room:
    """Where one model's queued requests wait for room, each owner in its line."""

    __slots__ = ("_lines", "_places", "_unowned", "_waiting", "value")

    def __init__(self, value: Callable[[str], float] = _level) -> None:
        self.value = value  # where an owner stands now: the lower, the sooner
        self._lines: dict[str, _Line] = {}
        self._unowned: set[trio.Event] = set()
        self._places = itertools.count()
        self._waiting = 0

    def __len__(self) -> int:
        """How many requests wait here now."""
        return self._waiting

    def place(self) -> int:
        """A place in the order requests came, for a request about to wait."""
        return next(self._places)

    def wake(self, after: int = -1) -> None:
        """There may be room for one more: the first not-yet-woken waiter (of those
        that came after place ``after``, when given) of the owner that stands best
        looks, and every waiter of no owner."""
        best: tuple[float, int] | None = None
        best_line: _Line | None = None
        for owner, line in self._lines.items():
            place = line.first(after)
            if place is not None:
                key = (self.value(owner), place)
                if best is None or key < best:
                    best, best_line = key, line
        if best is not None and best_line is not None:
            best_line.events[best[1]].set()
        for event in self._unowned:
            event.set()

    def wake_all(self) -> None:
        """There may be room for many: every waiter looks again."""
        for line in self._lines.values():
            for event in line.events.values():
                event.set()
        for event in self._unowned:
            event.set()

    def ahead(self, owner: str, place: int) -> bool:
        """Whether a request that goes before ``owner``'s at ``place`` waits here: an
        earlier one of the same owner, or the head of an owner that stands better (or
        as well, and came earlier)."""
        mine = (self.value(owner), place)
        for other, line in self._lines.items():
            if line.places and (
                line.places[0] < place
                if other == owner
                else (self.value(other), line.places[0]) < mine
            ):
                return True
        return False

    async def wait(self, deadline: float, owner: str | None = None, place: int = 0) -> None:
        """Until woken, ``RECHECK_S`` has passed, or ``deadline``, whichever is first.
        ``owner`` and ``place`` (``place()``): its line, and where in it; no owner: it
        keeps no one waiting."""
        event = trio.Event()
        line = None
        if owner is None:
            self._unowned.add(event)
        else:
            line = self._lines.get(owner)
            if line is None:
                line = self._lines[owner] = _Line()
            line.events[place] = event
            bisect.insort(line.places, place)
        self._waiting += 1
        waited = False
        try:
            with trio.move_on_at(min(deadline, trio.current_time() + RECHECK_S)):
                await event.wait()
            waited = True
        finally:
            self._waiting -= 1
            if line is None:
                self._unowned.discard(event)
            else:
                del line.events[place]
                del line.places[bisect.bisect_left(line.places, place)]
                if not line.places:
                    assert owner is not None
                    del self._lines[owner]
            if event.is_set() and not waited:  # woken, but it leaves (its client did)
                self.wake()


class Rooms:
    """Every model's ``Room``, made on first use."""

    __slots__ = ("_rooms", "value")

    def __init__(self) -> None:
        self._rooms: dict[str, Room] = {}
        self.value: Callable[[str], float] = _level  # each room's order (``Room.value``)

    def __call__(self, model: str) -> Room:
        room = self._rooms.get(model)
        if room is None:
            room = self._rooms[model] = Room(self.value)
        return room

    def sizes(self) -> list[tuple[str, int]]:
        """(model, requests waiting) for every model that has had a queue."""
        return [(model, len(room)) for model, room in self._rooms.items()]

    def wake(self, model: str) -> None:
        """One more request of ``model`` may go (``Room.wake``)."""
        room = self._rooms.get(model)
        if room is not None:
            room.wake()

    def wake_all(self) -> None:
        """Every waiter of every model looks again (``Room.wake_all``)."""
        for room in self._rooms.values():
            room.wake_all()

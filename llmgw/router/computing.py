"""The requests in flight on a replica, by the prompt they hold there, and the requests
that wait for one of them to end rather than compute that prompt again (the waiting
itself, with its clock, is ``llmgw.router.waits``).

Theory of operation
-------------------
llama.cpp reuses a prompt's KV only from an idle slot (its own, or its host-memory
cache, which a slot's state enters when the slot takes other work): a request of a
system prompt sent while every slot holding that prompt is busy, with the first
request still computing it or with later ones generating, is given another free
slot and computes the whole prompt again (llama.cpp issue #27616, open), and on a
replica whose slots share its compute it slows the others as much. Affinity sends
them to the replica that holds the prompt, rightly, and the engine computes it
again. In ``tools/bench_goodput.py``'s shared system prompts that was 4-7 of 60
requests a run while the first of each prompt was in its prefill, and, once only
those waited, as many again sent while the one holding the slot was generating.

So, per replica, ``Computing`` keeps the requests in flight there (``Entry``: from
when each is sent until its ``Lease`` ends, however) under every block of their
prompt, and how many copies of a block the replica is known to have computed
(one, unless requests were sent while every copy was busy: each of those computed
another). A request whose held part (what the index says the replica holds of its
prompt, to its deepest block) is in use by as many requests in flight as there
are copies waits (``waits.enter``) until one of them ends: a slot is then idle and holds
the prompt. It is counted on the replica all the while (its ``Lease`` is open), so
the load bound and the balancer see it, and the client's leaving ends it as any.
Waiters go one at a time, in the order they came: each that goes is in flight
again, and the next waits for the next to end.

Bounded, so that waiting never costs more than computing again would:

- where the replica's pace is known (``pace``; its own, else its model's other
  replicas'), at most ``FLEET`` times what computing the held part again would
  take, as a move past the load bound is;
- where none is, for the first of those in flight to have its first token (a
  stream's: before it, the prompt is still being computed, and a second
  computation could be done no sooner), then as long again as that took, which is
  what computing it again would take at most; one that is not streamed says no
  first token, and is not waited for;
- never more than ``waits.WAIT_S``.

A request that went on while every copy was busy computes one more (counted, up
to the replica's slots).

Where the router picks the slot itself (``llmgw.router.slotmap``: it is the fleet's
only router, and the engine says its slots), a request goes, once it is through
here, to the slot it picks: one let go to an idle copy to that copy's slot, so that
a request the engine queued meanwhile cannot take it first (``awaited`` says which
slots' prompts have requests waiting here).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

COPIES = 4096  # blocks whose copies a replica keeps count of (the others have one)


class Entry:
    """One request in flight on a replica, holding ``blocks`` of prompt there."""

    __slots__ = ("_owner", "blocks", "first", "first_at", "sent_at", "streamed")

    def __init__(
        self, owner: Computing, blocks: tuple[int, ...], sent_at: float, *, streamed: bool
    ) -> None:
        self._owner = owner
        self.blocks = blocks
        self.sent_at = sent_at
        self.streamed = streamed
        self.first = False  # its first token was relayed (a stream's)
        self.first_at = 0.0

    def first_token(self, now: float) -> None:
        if not self.first:
            self.first, self.first_at = True, now
            self._owner.changed()

    def end(self) -> None:
        """It ended (once; later calls do nothing): the slot it held is idle."""
        self._owner.leave(self)


class Computing:
    """One replica's requests in flight, by the blocks of prompt they hold there."""

    __slots__ = ("_copies", "_lines", "_listeners", "_users", "waits")

    def __init__(self) -> None:
        self._users: dict[int, list[Entry]] = {}
        self._lines: dict[int, deque[object]] = {}  # who waits for a block, in order
        self._copies: OrderedDict[int, int] = OrderedDict()
        # called (once each) when one ends or has its first token
        self._listeners: list[Callable[[], None]] = []
        self.waits = 0  # requests that waited for a copy, ever, here or in the engine (``ctl``)

    def __len__(self) -> int:
        return len(self._users)

    def busy(self, blocks: tuple[int, ...], held: int) -> list[Entry] | None:
        """The requests in flight holding every copy of the first ``held`` of ``blocks``
        (what the index says the replica holds of a prompt); None: a copy is idle, or
        nothing is held."""
        if not held:
            return None
        deepest = blocks[held - 1]
        users = self._users.get(deepest)
        if not users or len(users) < self._copies.get(deepest, 1):
            return None
        return users

    def free(self, blocks: tuple[int, ...], held: int) -> bool:
        """A request of this prompt would go at once: a copy is idle (or nothing is
        held) and none waits for one."""
        return self.busy(blocks, held) is None and not (held and blocks[held - 1] in self._lines)

    def awaited(self, blocks: tuple[int, ...]) -> bool:
        """A request waits for a copy of some of ``blocks`` (a slot holding them)."""
        lines = self._lines
        return bool(lines) and any(block in lines for block in blocks)

    def holding(self, blocks: tuple[int, ...], held: int) -> int:
        """The requests on the replica, in flight or waiting for a copy, of the prompt
        whose first ``held`` of ``blocks`` it holds."""
        if not held:
            return 0
        deepest = blocks[held - 1]
        return len(self._users.get(deepest, ())) + len(self._lines.get(deepest, ()))

    def enter(
        self, blocks: tuple[int, ...], held: int, now: float, *, streamed: bool, slots: int
    ) -> Entry:
        """A request whose prompt's first ``held`` blocks the replica holds is sent there
        now; if every copy of those is busy, it computes another (up to ``slots``; 0:
        not known)."""
        copies = self._copies
        if self.busy(blocks, held) is not None:
            for block in blocks[:held]:
                n = copies.get(block, 1)
                copies[block] = min(n + 1, slots) if slots else n + 1
                copies.move_to_end(block)
            while len(copies) > COPIES:
                copies.popitem(last=False)
        for block in blocks[held:]:  # new to it: computed once, now
            copies.pop(block, None)
        entry = Entry(self, blocks, now, streamed=streamed)
        users = self._users
        for block in blocks:
            users.setdefault(block, []).append(entry)
        return entry

    def leave(self, entry: Entry) -> None:
        users = self._users
        left = False
        for block in entry.blocks:
            holding = users.get(block)
            if holding is not None and entry in holding:
                holding.remove(entry)
                left = True
                if not holding:
                    del users[block]
        if left:
            self.changed()

    def changed(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` once, when a request in flight ends or has its first token
        (or one waiting goes)."""
        self._listeners.append(listener)

    def line(self, block: int) -> deque[object]:
        """The requests waiting for a copy of ``block``, in the order they came."""
        return self._lines.setdefault(block, deque())

    def out_of_line(self, block: int, ticket: object) -> None:
        line = self._lines[block]
        line.remove(ticket)
        if not line:
            del self._lines[block]
        self.changed()  # the next in line looks

"""A prompt a replica is computing now, and the requests that wait for it there.

Theory of operation
-------------------
llama.cpp reuses a prompt's KV only from an idle slot (its own, or its host-memory
cache, which a slot's state enters when the slot takes other work): a second
request of one system prompt, sent while the first is still in its slot, is given
another free slot and computes the whole prompt again (llama.cpp issue #27616,
open), and on a replica whose slots share its compute it slows the first as much.
Affinity sends both to the replica that holds the prompt, rightly, and the engine
computes it twice. In ``tools/bench_goodput.py``'s shared system prompts that was
4-7 of 60 requests a run, each about 430 tokens computed again, nearly all in the
first seconds, while the first of each prompt was still in its prefill.

So, per replica, ``Computing`` knows the requests in flight there that brought it
blocks of prompt it did not hold (``begin``, as each is sent; ``end``, from its
``Lease``, as it ends, however), and a request whose held part (what the index
says the replica holds) includes a block one of them is computing waits for that
request to end before it is sent (``wait``): its slot is then idle and holds the
prompt. It is counted on the replica all the while (its ``Lease`` is open), so
the load bound and the balancer see it, and the client's leaving ends it as any.

Bounded, so that waiting never costs more than computing again would:

- where the replica's pace is known (``pace``; its own, else its model's other
  replicas'), at most ``FLEET`` times what computing the held part again would
  take, as a move past the load bound is;
- where none is, until the request waited for has its first token (a stream's:
  before it, the prompt is still being computed, and a second computation could be
  done no sooner), then as long again as that took, which is what computing it
  again would take at most; a request waited for that is not streamed says no
  first token, and is not waited for;
- never more than ``WAIT_S``.

All the waiters of one computation go when it ends: the first takes the idle slot
that holds the prompt, and the others are the engine's to place, as before.
"""

from __future__ import annotations

import trio

WAIT_S = 30.0  # the longest a request waits for a prompt's computation, however paced


class Computation:
    """One request in flight on a replica, computing ``blocks`` of prompt there."""

    __slots__ = ("_owner", "blocks", "done", "first", "first_at", "sent_at", "streamed")

    def __init__(
        self, owner: Computing, blocks: tuple[int, ...], sent_at: float, *, streamed: bool
    ) -> None:
        self._owner = owner
        self.blocks = blocks
        self.sent_at = sent_at
        self.streamed = streamed
        self.first = trio.Event()  # its first token was relayed (a stream's)
        self.first_at = 0.0
        self.done = trio.Event()  # it ended, however

    def first_token(self, now: float) -> None:
        if not self.first.is_set():
            self.first_at = now
            self.first.set()

    def end(self) -> None:
        """It ended (once; later calls do nothing): its blocks are no longer being
        computed, and whoever waits for them goes."""
        if not self.done.is_set():
            self._owner.forget(self)
            self.first_token(self.sent_at)  # (none came: nothing to wait for past it)
            self.done.set()


class Computing:
    """One replica's requests in flight that brought it prompt it did not hold."""

    __slots__ = ("_by_block", "waits")

    def __init__(self) -> None:
        self._by_block: dict[int, Computation] = {}
        self.waits = 0  # requests that waited here for one, ever (``ctl replicas``)

    def __len__(self) -> int:
        return len(self._by_block)

    def of(self, blocks: tuple[int, ...], held: int) -> Computation | None:
        """The computation in flight of the deepest of the first ``held`` of
        ``blocks`` (what the index says the replica holds of a prompt), if any."""
        for block in reversed(blocks[:held]):
            found = self._by_block.get(block)
            if found is not None:
                return found
        return None

    def begin(
        self, blocks: tuple[int, ...], held: int, now: float, *, streamed: bool
    ) -> Computation | None:
        """A request whose prompt's first ``held`` blocks the replica holds is sent
        there: the rest, those not already being computed, are its to compute (None:
        it brings none)."""
        new = tuple(b for b in blocks[held:] if b not in self._by_block)
        if not new:
            return None
        computation = Computation(self, new, now, streamed=streamed)
        for block in new:
            self._by_block[block] = computation
        return computation

    def forget(self, computation: Computation) -> None:
        for block in computation.blocks:
            if self._by_block.get(block) is computation:
                del self._by_block[block]


async def wait(computation: Computation, budget_s: float) -> bool:
    """Wait for ``computation`` to end, as the module docstring bounds it (``budget_s``:
    what computing the held part again would cost, by the replica's pace; 0: not
    known). True: it ended; False: the request goes on without it."""
    if budget_s <= 0 and not computation.streamed:
        return computation.done.is_set()
    start = trio.current_time()
    with trio.move_on_at(start + WAIT_S):
        if budget_s > 0:
            with trio.move_on_at(start + budget_s):
                await computation.done.wait()
        else:
            await computation.first.wait()  # its prefill is over
            took = computation.first_at - computation.sent_at
            with trio.move_on_at(computation.first_at + took):
                await computation.done.wait()
    return computation.done.is_set()

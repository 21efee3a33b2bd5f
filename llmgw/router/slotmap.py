"""Which of a llama.cpp replica's slots takes a request: the one holding its prompt.

Theory of operation
-------------------
llama-server reuses a prompt's KV only from the slot that holds it (or from its
host-memory cache, which a slot's prompt enters when the slot takes other work,
or sits idle as a new request comes). Left to itself it gives a request waiting
for a slot the first slot to come free: with one slot holding a popular system
prompt and generating, and another holding a second prompt, a request of the first
prompt waiting behind both is given the second's slot when that frees first, and
computes the whole prompt again there (its slot never sat idle, so the host cache
never had it), and the next request of the second prompt computes that one again in
turn. On one llama-server with two slots, two prompts of 1,400 tokens and four
requests sent so, that was four prompts computed and 16.3 s to the last reply; sent
each to the slot holding its prompt (``id_slot``, which llama-server honours by
waiting for that slot, and which it hands to a request waiting for it first when it
frees), two prompts computed and 8.9 s. The router's own waits
(``llmgw.router.computing``) keep most such requests out of the engine until a slot
holding their prompt is idle; but a request already queued in the engine (a new
prompt's, sent while every slot was busy) takes that slot as it frees, before the
waiter, let go a moment later, reaches it. In ``tools/bench_goodput.py``'s shared
system prompts, 18 of the 54 prompts computed again in twelve seeds were computed
again on the replica that held them.

So, where the router is the fleet's only one (every request to the replica is its
own, so what it sent each slot is what each slot holds) and the engine says how many
slots it has, ``SlotMap`` keeps per slot the prompt last sent there (its blocks,
``llmgw.router.prefix``), when each request sent there and still in flight (running
or waiting for it) was sent, and when it was last given one. The router decides, as
before, whether a request waits for a slot holding its prompt to come free
(``llmgw.router.computing``); ``choose`` then picks which slot it goes to:

- once it need not wait (a slot holding its prompt is idle), the slot holding the
  most of it;
- where it would not wait (waiting would cost more than computing the prompt
  again), and for a prompt no slot holds: an idle slot (of those the one holding
  the most of it, then the least recently given one). Where none is idle, a
  request whose prompt a slot holds waits for that slot: it waits in the engine
  either way, and in whichever slot frees first it would compute the prompt again.
  A prompt no slot holds gets the engine's own choice, whichever frees first (no
  slot is named), unless a request in the router waits for one of the slots'
  prompts: then a slot none waits for (the fewest in flight, then the oldest of
  them sent first), so that it cannot take the waited slot as it frees. The map
  follows the requests the engine places: each takes the first slot that frees
  with nothing else sent to it.

Measured on twelve seeds of ``tools/bench_goodput.py``'s shared system prompts at
4.47 requests a second, beside the code before (93,143 prompt tokens computed,
1.71 good/s, 14 prompts computed again on the replica holding them). Three ways
that pinned every request measured worse or only half as good. With the engine
waiting in place of the router (a request sent at once to the busy slot holding its
prompt, the wait bounded as the router bounds its own): 104,753 tokens at 0.64
good/s; in the engine the requests of a prompt do not go one at a time as the
router's waiters do, and those the bound sent to the other slot took it from the
prompt it held, whose next request then computed that again. After the router's
wait, every other request to the least busy slot: 88,953 tokens but 1.13 good/s (a
new prompt waited for a slot that freed later); to the slot first to free as the
router guesses it: 89,427 tokens at 1.53 good/s, but on prompts nothing shares
0.89x load-only routing's goodput and 1.15x its TTFT p95, where llama-server's own
queue gives a request whichever slot frees first.

The request then carries the slot (``EngineAdapter.slot_field``; llama.cpp's
``id_slot``). Where several routers share the fleet each knows only its own
requests, and a request sent to a slot another router filled would wait for it and
compute its prompt anyway: none pins, and the engine chooses, as before.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs


@attrs.define(eq=False)  # each slot is itself: two idle ones alike are still two
class _Slot:
    index: int  # its id, as the engine numbers them
    blocks: tuple[int, ...] = ()  # of the prompt last sent there
    # when each request sent there still in flight (running or waiting for it) was sent
    sent: list[float] = attrs.Factory(list)
    used: int = 0  # when it was last given one (``SlotMap``'s count)

    def frees(self) -> tuple[int, float]:
        """Which slot frees first, as far as the router can tell: the fewest requests in
        flight there, then the oldest of them sent first."""
        return len(self.sent), (self.sent[0] if self.sent else 0.0)


# why a request went to its slot (``Pin.outcome``; the metric's label)
OUTCOMES = {
    "idle": "the idle slot holding its prompt",
    "waits": "the busy slot holding its prompt, which the engine waits for",
    "again": "another, idle slot, computing the prompt again: waiting would cost more",
    "new": "an idle slot, or one no waiter in the router waits for: none holds its prompt",
    "first": "none: every slot busy and none waited for, the engine's first to free",
}


class Pin:
    """One request sent to one slot (or, ``slot`` None, to the engine's first to free,
    which it takes when a slot with nothing else sent to it frees): counted there until
    it ends (once)."""

    __slots__ = ("_map", "_sent", "_slot", "blocks", "outcome", "slot")

    def __init__(self, owner: SlotMap, blocks: tuple[int, ...], outcome: str, sent: float) -> None:
        self._map = owner
        self._slot: _Slot | None = None
        self._sent = sent
        self.blocks = blocks
        self.slot: int | None = None  # the slot's id, as the engine numbers them
        self.outcome = outcome  # why it went there (``OUTCOMES``' key)

    def take(self, slot: _Slot, used: int) -> None:
        self._slot, self.slot = slot, slot.index
        slot.blocks, slot.used = self.blocks, used
        slot.sent.append(self._sent)

    def end(self) -> None:
        if self._slot is not None:
            self._slot.sent.remove(self._sent)
            slot, self._slot = self._slot, None
            self._map.freed(slot)
        else:
            self._map.gone(self)


class SlotMap:
    """What this router sent each slot of one replica (see the module docstring)."""

    __slots__ = ("_first", "_slots", "_used")

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._first: deque[Pin] = deque()  # sent to the engine's first slot to free
        self._used = 0

    def choose(
        self,
        blocks: tuple[int, ...],
        slots: int,
        now: float,
        *,
        again: bool = False,
        awaited: Callable[[tuple[int, ...]], bool] = lambda _: False,
    ) -> Pin:
        """Send a request whose prompt has ``blocks`` to one of the replica's ``slots``
        at ``now``: the one holding the most of it; ``again`` (the router would not wait
        for a slot holding it, ``llmgw.router.computing``) or a prompt no slot holds, an
        idle slot, else the one holding the most of it; for a prompt none holds, one whose
        prompt no request in the router waits for (``awaited``), first to free as far as
        the router can tell (``_Slot.frees``), else the engine's first to free (no
        slot)."""
        if len(self._slots) != slots:  # first sight, or the engine came back with others
            self._slots = [_Slot(i) for i in range(slots)]
            self._first.clear()
        state = self._slots
        held = [_common(s.blocks, blocks) for s in state]
        best = max(range(slots), key=lambda i: (held[i], -len(state[i].sent), -i))
        pin = Pin(self, blocks, "", now)
        index: int | None = best
        if held[best] and not again:
            pin.outcome = "waits" if state[best].sent else "idle"
        else:
            pin.outcome = "again" if held[best] else "new"
            order = sorted(range(slots), key=lambda i: (state[i].frees(), -held[i], state[i].used))
            free = [i for i in order if not awaited(state[i].blocks)]  # none waits for it
            idle = [i for i in free if not state[i].sent]
            if idle:
                index = idle[0]
            elif held[best]:  # it waits in the engine either way: for its prompt's slot
                index = best
            elif len(free) == len(order) and state[order[0]].sent:
                index, pin.outcome = None, "first"  # every slot busy, none waited for
            else:  # one a waiter is not about to be let go to, where there is one
                index = free[0] if free else order[0]
        if index is not None and held[index]:  # it holds the prompt after all
            pin.outcome = "waits" if state[index].sent else "idle"
        if index is None:
            self._first.append(pin)
        else:
            self._used += 1
            pin.take(state[index], self._used)
        return pin

    def freed(self, slot: _Slot) -> None:
        """A request on ``slot`` ended: with nothing else sent to it, the engine gives
        it the first of those sent to its first slot to free."""
        mapped = slot.index < len(self._slots) and self._slots[slot.index] is slot
        if not slot.sent and self._first and mapped:  # not of a map started again
            self._used += 1
            self._first.popleft().take(slot, self._used)

    def gone(self, pin: Pin) -> None:
        if pin in self._first:
            self._first.remove(pin)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The leading blocks ``a`` and ``b`` share (each block's key covers the prompt up
    to its end, so the first that differs ends what they share)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

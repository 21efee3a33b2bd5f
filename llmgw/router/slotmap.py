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
frees), two prompts computed and 8.9 s. In ``tools/bench_goodput.py``'s shared
system prompts, 18 of the 54 prompts computed again in twelve seeds were computed
again on the replica that held them.

So, where the router is the fleet's only one (every request to the replica is its
own, so what it sent each slot is what each slot holds) and the engine says how many
slots it has, ``SlotMap`` keeps per slot the prompt last sent there (its blocks,
``llmgw.router.prefix``), the requests sent there still in flight (running or
waiting for it), and when it was last given one; and ``choose`` picks the slot:

- the one holding the most of the prompt, if it is idle;
- if it is busy, it still, while waiting for it costs less than computing what it
  holds again in the least busy other slot (each request ahead there takes a
  slot's time, ``pace.slot_s``, and computing the prompt again takes ``FLEET``
  times its time, as the load bound and the router's own waits count it); where
  the replica's pace is not yet known, while no more than one more request is
  ahead of it there than in the other slot;
- a prompt no slot holds: the least busy slot, of those the least recently given
  one (the engine's own choice among idle slots).

The request then carries the slot (``EngineAdapter.slot_field``; llama.cpp's
``id_slot``). Where several routers share the fleet each knows only its own
requests, and a request sent to a slot another router filled would wait for it and
compute its prompt anyway: none pins, and the engine chooses, as before.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import attrs

from llmgw.router.pace import FLEET, Pace, held_bytes


@attrs.define
class _Slot:
    blocks: tuple[int, ...] = ()  # of the prompt last sent there
    busy: int = 0  # requests sent there still in flight (running or waiting for it)
    used: int = 0  # when it was last given one (``SlotMap``'s count)


class Pin:
    """One request sent to one slot: counted there until it ends (once)."""

    __slots__ = ("_slot", "slot")

    def __init__(self, slot: _Slot, index: int) -> None:
        self._slot: _Slot | None = slot
        self.slot = index  # the slot's id, as the engine numbers them

    def end(self) -> None:
        if self._slot is not None:
            self._slot.busy -= 1
            self._slot = None


class SlotMap:
    """What this router sent each slot of one replica (see the module docstring)."""

    __slots__ = ("_slots", "_used")

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._used = 0

    def choose(
        self, blocks: tuple[int, ...], slots: int, pace: Pace, size: int, kept: float
    ) -> Pin:
        """Send a request whose prompt has ``blocks`` (``size`` bytes read) to one of the
        replica's ``slots``, by ``pace`` (the replica's, else its model's) and ``kept``
        (how much of what the router estimated its replies bore out)."""
        if len(self._slots) != slots:  # first sight, or the engine came back with others
            self._slots = [_Slot() for _ in range(slots)]
        held = [_common(s.blocks, blocks) for s in self._slots]
        best = max(range(slots), key=lambda i: (held[i], -self._slots[i].busy, -i))
        if not held[best]:
            index = min(range(slots), key=lambda i: (self._slots[i].busy, self._slots[i].used))
        elif self._slots[best].busy == 0 or slots == 1:
            index = best
        else:
            others = [i for i in range(slots) if i != best]
            alt = min(others, key=lambda i: (self._slots[i].busy, self._slots[i].used))
            ahead, elsewhere = self._slots[best].busy, self._slots[alt].busy
            if pace.known:
                again = held_bytes(held[best], size, kept) - held_bytes(held[alt], size, kept)
                wait = ahead * pace.slot_s
                index = (
                    best if wait <= elsewhere * pace.slot_s + FLEET * pace.saved_s(again) else alt
                )
            else:
                index = best if ahead <= elsewhere + 1 else alt
        slot = self._slots[index]
        self._used += 1
        slot.blocks, slot.busy, slot.used = blocks, slot.busy + 1, self._used
        return Pin(slot, index)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The leading blocks ``a`` and ``b`` share (each block's key covers the prompt up
    to its end, so the first that differs ends what they share)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

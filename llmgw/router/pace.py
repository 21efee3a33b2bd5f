"""How fast each replica works, learned from what its engine says of each reply.

Theory of operation
-------------------
A request whose prompt a replica holds, sent there while all its slots are busy,
waits for one to free; sent elsewhere, it has what was held computed again, and
that work is the fleet's. Which costs less depends on the engine, the hardware
and the traffic: on these CPUs a slot frees in about a second and a few hundred
tokens of prompt take three; on a GPU with long replies and short prompts it is
the other way round. The load bound alone (``affinity``) cannot tell: at four
replicas and three requests in flight its cap is two, so a turn whose replica had
both slots busy moved to an idle one (``tools/bench_goodput.py``: 10 of 48 later
turns in one run, 6 of them then evicted from the replica they left), and a
popular system prompt was computed again on a second and a third replica.

``Pace`` keeps, per replica, moving averages of what llama.cpp's ``timings`` say
of each reply (``engines.base.reply_timings``): the time a prompt token takes to
compute (``prompt_ms / prompt_n``, from replies that computed at least
``PREFILL_TOKENS``, so that a reply that found nearly everything cached does not
count its fixed costs as a speed), the time a request holds its slot (``prompt_ms
+ predicted_ms``), and the prompt's bytes per token (what the router reads
before any tokenizer, against the tokens the engine counted). ``patience`` is
how many requests past its slots a replica may have and still take one whose
prompt it holds ``held`` bytes of: while the wait for a slot (those ahead x the
slot time / slots) is no longer than ``FLEET`` times computing the held part
again (the request's own time, and as much of another replica's, which every
request behind it there waits for too) plus the wait for a slot where it would go
instead (``queue_s``: a move to a busy replica waits there too), at most
``QUEUE_PER_SLOT`` per slot.
What is held is what the router's index says, discounted by how much of its
estimates the replica's replies bore out (``PrefixIndex.kept``): a replica that
evicted what it was thought to hold, or ran a second request of one prompt in
another slot and computed it again, is not waited for. Until a replica has said
enough (``READINGS`` of each), its model's other replicas' pace stands for its own
(``fleet``); until one of them has, it has no patience, and the bound alone decides.

The comparison is against the cost to the fleet, not the request's own time to
its first token elsewhere: an idle replica always looks quicker to one request,
and a bound on that moved more turns, not fewer (18 against 9 at four replicas).
With it, four seeds of the benchmark's conversations moved no turn and lost
none (0.61-0.75 good/s, 1.28x ``smg``'s on the mean), and on the users behind
shared system prompts the router went from 0.67x ``smg``'s goodput (mean of three
seeds) to level with it (1.03x of four).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs

from llmgw.router.prefix import BLOCK_BYTES, MAX_BYTES

if TYPE_CHECKING:
    from llmgw.engines.base import Timings

ALPHA = 0.25  # weight of the newest reading in the moving averages
PREFILL_TOKENS = 64  # a reply that computed fewer tokens of its prompt says little of its speed
READINGS = 2  # of each, before a replica's pace is used
QUEUE_PER_SLOT = 4  # patience at most, per slot: a hot prompt still spreads past it
# what a move costs, in the request's own wait: computing the held part again takes
# that long on the replica it goes to, and the same time of that replica's work is
# lost to every request behind it there
FLEET = 2.0


def _mean(old: float, new: float, n: int) -> float:
    return new if n == 0 else old + ALPHA * (new - old)


@attrs.define
class Pace:
    """One replica's pace as its replies said it (see the module docstring)."""

    prefill_ms: float = 0.0  # per prompt token computed
    slot_s: float = 0.0  # a request's time in its slot
    bytes_per_token: float = 0.0  # of the prompt as the router reads it
    prefills: int = 0
    replies: int = 0

    def observe(self, timings: Timings, prompt_tokens: int, prompt_bytes: int) -> None:
        """A reply said ``timings``, of a prompt of ``prompt_tokens`` tokens in all
        (reused and computed) and ``prompt_bytes`` as the router read it."""
        if timings.prompt_ms < 0 or timings.predicted_ms < 0:
            return
        self.slot_s = _mean(
            self.slot_s, (timings.prompt_ms + timings.predicted_ms) / 1e3, self.replies
        )
        self.replies += 1
        if timings.prompt_n >= PREFILL_TOKENS:
            per = timings.prompt_ms / timings.prompt_n
            self.prefill_ms = _mean(self.prefill_ms, per, self.prefills)
            if prompt_tokens > 0 and 0 < prompt_bytes < MAX_BYTES:  # read whole
                ratio = prompt_bytes / prompt_tokens
                self.bytes_per_token = _mean(self.bytes_per_token, ratio, self.prefills)
            self.prefills += 1

    @property
    def known(self) -> bool:
        return (
            self.prefills >= READINGS
            and self.replies >= READINGS
            and self.slot_s > 0
            and self.bytes_per_token > 0
        )

    def saved_s(self, held: float) -> float:
        """About what computing ``held`` bytes of prompt again would take (0: this
        replica's pace is not known)."""
        if not self.known or held <= 0:
            return 0.0
        return held / self.bytes_per_token * self.prefill_ms / 1e3

    def patience(self, held: float, slots: int, elsewhere_s: float = 0.0) -> int:
        """Requests past its ``slots`` the replica may have and still take one whose
        prompt it holds ``held`` bytes of (``held_bytes``): while the wait is no longer
        than ``FLEET`` times computing that again, plus ``elsewhere_s``, the wait for a
        slot where it would go instead (0 until its pace is known)."""
        if held <= 0 or slots <= 0 or not self.known:
            return 0
        waits = math.floor((FLEET * self.saved_s(held) + elsewhere_s) * slots / self.slot_s)
        return max(0, min(waits, QUEUE_PER_SLOT * slots))

    def queue_s(self, requests: float, slots: int) -> float:
        """How long one more request would wait for a slot, with ``requests`` running
        and waiting (0: a slot is free, or the pace is not known)."""
        if slots <= 0 or not self.known:
            return 0.0
        return max(0.0, requests + 1 - slots) * self.slot_s / slots


def fleet(own: Pace, others: Iterable[Pace]) -> Pace:
    """``own`` where it is known; else the mean of the known ``others`` (the same
    model's other replicas: a new replica's pace until it has said its own, so that a
    fleet's early moves and waits are paced); else ``own``, not known."""
    if own.known:
        return own
    known = [p for p in others if p.known]
    if not known:
        return own
    n = len(known)
    return Pace(
        prefill_ms=sum(p.prefill_ms for p in known) / n,
        slot_s=sum(p.slot_s for p in known) / n,
        bytes_per_token=sum(p.bytes_per_token for p in known) / n,
        prefills=READINGS,
        replies=READINGS,
    )


def held_bytes(held: int, size: int, kept: float) -> float:
    """What a replica holds of a prompt of ``size`` bytes, ``held`` blocks of it known to
    this router's index, which the replica's readings bore out by ``kept`` (the share of
    what the index estimated that its replies said they reused). The engine holds the
    prompt it was sent, not blocks: what it shares with this one runs on into the next
    block, by half of one on the mean."""
    if held <= 0:
        return 0.0
    return min(size, (held + 0.5) * BLOCK_BYTES) * kept

"""A circuit breaker per replica, and which upstream answers count against it.

A replica that keeps failing at the transport level (refused connections,
resets, timeouts, 502/503/504) is taken out of rotation for a cool-down, then
let back in one probe at a time. The breaker counts *upstream faults* only,
evidence that the replica itself is broken: an engine's own answer, whatever
its status (a 400 for a malformed body, a 500 for an image part a text
model cannot read), is about the request and says nothing about the
replica. Counting those is how SGLang's router took whole fleets out: one
client sending bad requests opened every breaker in turn, and the model went
dark for everybody. Faults a request may have caused itself are counted
only once another replica has failed to reproduce them (``verdict``).

Pure code with an explicit ``now`` (a monotonic clock reading in seconds): the
router reports every request it sends (``on_start``) and its outcome exactly
once (``on_success``, ``on_upstream_fault``, ``on_client_error`` or
``on_cancel``). All the moves the breaker can make are in ``TRANSITIONS``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

import attrs

from llmgw.router.validators import non_negative, positive_int


class BreakerState(StrEnum):
    CLOSED = "closed"  # traffic flows; consecutive upstream faults are counted
    OPEN = "open"  # no traffic until the cool-down has passed
    HALF_OPEN = "half-open"  # a bounded number of trial requests decide


# (from, to) -> why. Nothing else is legal; ``Breaker._move`` refuses anything else.
TRANSITIONS: dict[tuple[BreakerState, BreakerState], str] = {
    (BreakerState.CLOSED, BreakerState.OPEN): "consecutive upstream faults reached the threshold",
    (BreakerState.OPEN, BreakerState.HALF_OPEN): "cool-down over: letting a probe through",
    (BreakerState.HALF_OPEN, BreakerState.CLOSED): "a probe succeeded",
    (BreakerState.HALF_OPEN, BreakerState.OPEN): "a probe failed: cool-down restarts",
}

# success: the replica worked; client_error: an error answer, a verdict on the
# request and never on the replica; upstream_fault: the replica failed.
Outcome = Literal["success", "client_error", "upstream_fault"]


class IllegalMove(AssertionError):
    pass


def classify(status: int) -> Outcome:
    """What an engine's answer tells the replica's breaker: a success, or nothing.

    - 1xx/2xx/3xx: ``success``: the replica works; a fault streak is over.
    - Anything else, 429 and 500 included: ``client_error``, an error answer
      that says nothing about the replica's health. An engine that answers
      is up; what it said is about this request (llama.cpp answers 500 to an
      image part a text model cannot read, 400 to a prompt that is too
      long), and counting such answers lets one client open the breaker of
      every replica in turn. A 429 is the engine's own admission, which the
      balancer's load signals already follow. A replica broken in a way that
      still answers is taken out by its health check (not Ready), not here.

    ``verdict`` takes 502, 503 and 504 out before asking: those say the
    replica had no answer to give, and are judged with the failures.
    """
    return "success" if status < 400 else "client_error"


@attrs.define
class Breaker:
    """Closed → open after ``failure_threshold`` consecutive upstream faults;
    open → half-open once ``cooldown_s`` has passed; half-open lets at most
    ``half_open_probes`` requests in flight at once, and the first verdict
    decides: a success closes it, an upstream fault re-opens it.

    Late outcomes of requests sent before the breaker opened are not
    evidence about the present: in OPEN they neither close it nor restart the
    cool-down (a fault still increments ``consecutive_faults`` for the record).
    """

    failure_threshold: int = attrs.field(default=5, validator=positive_int)
    cooldown_s: float = attrs.field(default=10.0, validator=non_negative)
    half_open_probes: int = attrs.field(default=1, validator=positive_int)
    state: BreakerState = BreakerState.CLOSED
    consecutive_faults: int = 0
    opened_at: float | None = None  # when it last opened; None if it never did
    probes_in_flight: int = 0  # half-open trial requests without a verdict yet
    reason: str = "never tripped"  # why the last move happened (from TRANSITIONS)

    def _move(self, to: BreakerState) -> None:
        why = TRANSITIONS.get((self.state, to))
        if why is None:
            raise IllegalMove(f"breaker {self.state} -> {to}")
        self.state = to
        self.reason = why

    def allows(self, now: float) -> bool:
        """Whether a new request may be sent now.

        Moves OPEN → HALF_OPEN when the cool-down has passed, so the first
        caller after the cool-down gets the probe; nothing else is needed to
        bring a replica back.
        """
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            assert self.opened_at is not None
            if now - self.opened_at < self.cooldown_s:
                return False
            self._move(BreakerState.HALF_OPEN)
            self.probes_in_flight = 0
        return self.probes_in_flight < self.half_open_probes

    def on_start(self, now: float) -> None:
        """A request was sent; in half-open it is a probe and takes a slot."""
        if self.state is BreakerState.HALF_OPEN:
            self.probes_in_flight += 1

    def _release_probe(self) -> None:
        if self.probes_in_flight > 0:
            self.probes_in_flight -= 1

    def on_success(self, now: float) -> None:
        """The replica answered: the fault streak is over; a probe closes it."""
        if self.state is BreakerState.OPEN:
            return  # sent before it opened: says nothing about now
        self.consecutive_faults = 0
        if self.state is BreakerState.HALF_OPEN:
            self._move(BreakerState.CLOSED)
            self.probes_in_flight = 0

    def on_upstream_fault(self, now: float) -> None:
        """The replica or the path to it failed; opens at the threshold."""
        self.consecutive_faults += 1
        if self.state is BreakerState.CLOSED:
            if self.consecutive_faults >= self.failure_threshold:
                self._move(BreakerState.OPEN)
                self.opened_at = now
        elif self.state is BreakerState.HALF_OPEN:
            self._move(BreakerState.OPEN)
            self.opened_at = now
            self.probes_in_flight = 0

    def trip(self, now: float, why: str) -> None:
        """Open now, whatever the fault count, for evidence other than a request's
        fault (a wedged engine); open already, the cool-down starts again."""
        if self.state is not BreakerState.OPEN:
            self._move(BreakerState.OPEN)
        self.opened_at = now
        self.probes_in_flight = 0
        self.reason = why

    def on_client_error(self, now: float) -> None:
        """The engine answered with an error: never counts against the replica.

        It neither counts nor resets the fault streak: it is a verdict on the
        request, not the replica. A half-open probe that ends this way frees
        its slot so another probe can decide, but does not close the breaker.
        """
        if self.state is BreakerState.HALF_OPEN:
            self._release_probe()

    def on_cancel(self, now: float) -> None:
        """The request ended with no verdict (the client went away): frees a probe slot.

        Without it a half-open breaker whose probe was abandoned would keep
        its slot taken and never let the replica back in.
        """
        if self.state is BreakerState.HALF_OPEN:
            self._release_probe()

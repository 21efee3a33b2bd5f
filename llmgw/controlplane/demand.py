"""How many replicas a model should run, from what its routers see: the scaling rule.

Theory of operation
-------------------
A model with a range (``replicas = { min, max }``) runs as many replicas as its
load needs: each replica should carry ``target`` requests at once (in flight or
waiting for it), so the load ``L`` (requests in flight at its replicas plus those
queued or held in routers, fleet-wide) needs ``ceil(L / target)`` of them, within
the range. Load is noisy and a replica takes a while to start, so the count
follows it with hysteresis, one decision at a time (``Demand.observe``):

- **Up** when the load has needed more replicas for all of the last ``UP_S``
  (its lowest reading in that window needs more): to what that lowest reading
  needs, at once (a burst of fifty users wants several, not one a minute). At
  most once every ``UP_COOL_S``, or the replica's measured start time when that is
  longer (``Range.start_s``), so a count just raised is given time to start: the
  load its new replicas will carry still queues until they are Ready, and raising
  again on it would start more than it needs.
- **Down** by one when the load could have been carried by one replica fewer,
  each running at ``DOWN_AT`` of its target, for all of the last ``DOWN_S`` (its
  highest reading in that window); and not within ``DOWN_COOL_S`` of any change.
  The gap between the two thresholds (a replica more as soon as one is full for
  ``UP_S``, one less only when the rest would be at ``DOWN_AT`` for ``DOWN_S``)
  keeps a load that rises and falls within a minute from starting and stopping
  engines: the count rises once with the first rise and stays.
- **To zero** (``min`` 0): after ``idle_s`` with no request at all.
- **From zero**: requests held for a model with no replica ask at once,
  whatever the windows say, for as many as they need (a burst that finds the
  model at zero starts several, not one and the rest a cool-down later): a
  held request waits on nothing else. For ``UP_S`` after that, while the
  burst is still arriving and none of it is served yet, a reading that needs
  more raises the count at once too.

A pin (``ctl scale MODEL N``) replaces the rule until it is released. Every
change comes with its reason in words, for ``ctl models`` and the log: ``2 → 3:
14 requests at once for 20 s, 5 each at most``.

Pure: no I/O, no trio; time comes in with each reading.
"""

from __future__ import annotations

import math
from collections import deque

import attrs

UP_S = 15.0  # the load needed more replicas this long: start them
UP_COOL_S = 30.0  # no second rise sooner than this after a change
DOWN_S = 120.0  # the load would have fit in one fewer this long: stop one
DOWN_COOL_S = 120.0  # no fall sooner than this after any change
DOWN_AT = 0.7  # ... each of the rest running at this share of its target
IDLE_S = 600.0  # a model of min 0 with no request this long: none


@attrs.frozen
class Range:
    """A model's replicas: at least ``min``, at most ``max``, each carrying about
    ``target`` requests at once."""

    min: int
    max: int
    target: float
    idle_s: float = IDLE_S
    start_s: float = 0.0  # how long one of its replicas takes to start, as measured

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.min <= self.max or self.max < 1:
            raise ValueError(f"replicas range needs 0 <= min <= max and max >= 1: {self}")
        if self.target <= 0:
            raise ValueError(f"a replica's target load must be above 0, got {self.target}")


@attrs.frozen
class Reading:
    """What the routers saw of a model at ``at``: requests in flight at its
    replicas, and requests waiting in routers (queued for room, or held for a
    replica to start)."""

    at: float
    in_flight: int
    waiting: int
    arrived: int = 0  # requests that arrived since the reading before (idle or not)

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting


@attrs.frozen
class Change:
    """The count a model should run, from ``before``, and why: in words, and as one of a
    few fixed kinds (``up``, ``down``, ``idle``, ``held``, ``pinned``) for metrics."""

    before: int
    after: int
    why: str
    kind: str

    def __str__(self) -> str:
        return f"{self.before} → {self.after}: {self.why}"


@attrs.define
class Demand:
    """One model's count and the readings that decide it (see the module docstring)."""

    range: Range
    count: int  # replicas it should run now
    changed: float = -math.inf  # when the count last changed
    pinned: int | None = None  # an operator's count, until released
    _seen: deque[Reading] = attrs.field(factory=deque)  # the last ``DOWN_S`` of readings
    _since: float | None = None  # the first reading: a window counts once it is this old
    _last_request: float = -math.inf  # when a reading last had any load (or the first)
    _woke: float = -math.inf  # when it last rose from zero

    @property
    def last(self) -> Reading | None:
        """The latest reading taken."""
        return self._seen[-1] if self._seen else None

    def need(self, load: float) -> int:
        """Replicas that carry ``load`` at their target, within the range."""
        return self._clamp(math.ceil(load / self.range.target))

    def _clamp(self, n: int) -> int:
        return max(self.range.min, min(self.range.max, n))

    def pin(self, n: int | None, now: float) -> Change | None:
        """Hold the count at ``n`` (within 0 and ``max``) until released (None)."""
        self.pinned = None if n is None else max(0, min(self.range.max, n))
        if self.pinned is None or self.pinned == self.count:
            return None
        return self._change(self.pinned, now, "pinned by an operator (`llmgw ctl scale`)", "pinned")

    def observe(self, reading: Reading) -> Change | None:
        """Take a reading (in time order); the change it makes, if any."""
        now = reading.at
        seen = self._seen
        seen.append(reading)
        while seen and seen[0].at < now - DOWN_S:
            seen.popleft()
        if self._since is None:
            self._since = self._last_request = now  # idle is counted from here
        if reading.load or reading.arrived:
            self._last_request = now
        watched = now - self._since
        if self.pinned is not None:
            return None
        if self.count == 0:
            if reading.waiting:
                held = f"{reading.waiting} request{'s' if reading.waiting != 1 else ''}"
                want = max(1, self.need(reading.load))
                self._woke = now
                return self._change(want, now, f"{held} held with no replica", "held")
            return None
        if now - self._woke <= UP_S and self.need(reading.load) > self.count:
            # a burst still arriving while the first replicas start: all of it is held
            # or queued behind them, none served yet, and needs what it needs now
            return self._change(
                self.need(reading.load),
                now,
                f"{reading.load} requests at once while its first replicas start",
                "up",
            )
        lowest = min(r.load for r in seen if r.at >= now - UP_S)
        want = self.need(lowest)
        cool = max(UP_COOL_S, self.range.start_s)
        if watched >= UP_S and want > self.count and now >= self.changed + cool:
            return self._change(
                want,
                now,
                f"{lowest} requests at once for {UP_S:.0f} s, {self.range.target:g} each at most",
                "up",
            )
        if self.range.min == 0 and now - self._last_request >= self.range.idle_s:
            return self._change(0, now, f"no request for {self.range.idle_s:.0f} s", "idle")
        highest = max(r.load for r in seen)
        fits = highest <= (self.count - 1) * self.range.target * DOWN_AT
        if (
            self.count > max(self.range.min, 1)
            and watched >= DOWN_S
            and fits
            and now >= self.changed + DOWN_COOL_S
        ):
            return self._change(
                self.count - 1,
                now,
                f"at most {highest} requests at once for {DOWN_S:.0f} s: "
                f"{self.count - 1} carry them at {DOWN_AT:.0%} of their target",
                "down",
            )
        return None

    def _change(self, after: int, now: float, why: str, kind: str) -> Change:
        change = Change(self.count, after, why, kind)
        self.count, self.changed = after, now
        return change

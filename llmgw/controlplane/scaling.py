"""Replicas that follow demand: each ranged model's count, from what its routers see.

Theory of operation
-------------------
A model whose catalog entry gives a range (``replicas = { min, max }``,
``catalog.Scaling``) runs as many replicas as its load needs, decided by
``demand.Demand`` (the rule, its hysteresis and cool-downs are there). This
module keeps one ``Demand`` per ranged model and feeds it once a pass
(``observe``): the load is what every router says it has of the model now,
requests in flight at its replicas plus requests waiting in routers (queued
for room, or held because the model has no replica), summed over the router
inside ``llmgw server`` (read in process) and the standalone routers heard
from lately (their reports, ``followers.RouterReports``). The reconciler asks
``wanted`` instead of the catalog's count; a model with a plain count is
untouched.

A router that holds a request for a model with no replica tells the control
plane at once (the in-process router directly, a standalone one with a report
sent then), and the pass that follows starts one: ``Demand`` starts one as
soon as a reading has anything waiting at zero.

A control plane that restarts knows no demand. Until it is settled (up for
its lost-node timeout, ``FleetManager.settled``), each model's count is at
least what counts towards it now (the replicas its agents come back with), so
a scale-up in progress when it stopped is neither placed again nor drained;
once settled, the rule decides, with its usual patience.

Start times: each replica that becomes Ready, placed by this control plane,
took ``state_since - created_at`` to start; the last few per profile give the
model's measured start time (``start_s``: what a held request is told to wait
in a refusal's Retry-After, and what ``ctl models`` shows). A replica woken from
sleep (``sleep.py``) is timed from its wake, apart (``wake_s``).

Every change is one log line with its reason (``2 → 3: 14 requests at once for
15 s, 4 each at most``), kept for ``ctl models``, and counted by reason.

Pure: no I/O, no trio; time comes in with each call.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping

import attrs

from llmgw.controlplane.catalog import Catalog, Model, scaling_target
from llmgw.controlplane.demand import Change, Demand, Range, Reading
from llmgw.controlplane.replicas import Replica, ReplicaState
from llmgw.routing import ModelLoad

log = logging.getLogger("llmgw.scaling")

DEFAULT_START_S = 30.0  # a model's start time before one was measured
DEFAULT_WAKE_S = 5.0  # a sleeping replica's wake, before one was measured
STARTS_KEPT = 5  # start times kept per profile: the median of these is shown


@attrs.frozen
class Said:
    """A model's last change, and when it was made (wall clock)."""

    change: Change
    at: float


class Scaling:
    """Every ranged model's ``Demand``, and the start times measured per profile."""

    def __init__(self, pinned: Mapping[str, int] = {}) -> None:
        self._demands: dict[str, Demand] = {}
        self._pins = dict(pinned)  # ``ctl scale``'s counts, kept across restarts
        self.said: dict[str, Said] = {}  # model -> its last change
        self.events: dict[tuple[str, str], int] = {}  # (model, reason) -> changes
        self._starts: dict[tuple[str, str], deque[float]] = {}  # (model, profile) -> s
        self._ready: set[str] = set()  # replica ids already counted Ready
        self.new_starts: list[tuple[str, str, float]] = []  # measured since last taken
        self._wakes: dict[tuple[str, str], deque[float]] = {}  # (model, profile) -> s
        self.new_wakes: list[tuple[str, str, float]] = []  # measured since last taken
        self._counting: dict[str, int] = {}  # replicas that count towards each model
        self.yielding: dict[str, str] = {}  # ranged model -> why it is held below demand

    # --- the count ------------------------------------------------------------------

    def wanted(self, model: Model) -> int:
        """How many replicas ``model`` should run now: a fixed count, or what demand says
        of a range; while another model is below its floor for want of room, a range
        grows no further than it is (demand never takes the room a floor needs)."""
        if model.scaling is None:
            return model.replicas
        demand = self._demands.get(model.name)
        if demand is None:
            return model.replicas
        if model.name in self.yielding:
            return min(demand.count, max(model.replicas, self._counting.get(model.name, 0)))
        return demand.count

    def room_first(self, catalog: Catalog, short_of_room: Collection[str]) -> None:
        """``short_of_room``: models placement found no room for, of which those below
        their floor (a count, or a range's min) go first: every range that
        wants more than it runs waits for them. One line when that starts and ends."""
        first = [  # below their floor for want of room: others' demand waits for them
            m
            for m in short_of_room
            if m in catalog.models and self._counting.get(m, 0) < catalog.models[m].replicas
        ]
        yielding = {}
        for name, demand in self._demands.items():
            others = sorted(m for m in first if m != name)
            if others and demand.count > max(
                catalog.models[name].replicas, self._counting.get(name, 0)
            ):
                yielding[name] = (
                    f"{name} runs {self._counting.get(name, 0)} of the {demand.count} its "
                    f"demand wants: {', '.join(others)} {'is' if len(others) == 1 else 'are'} "
                    "below the minimum for want of room, and placed first"
                )
        for name in sorted(yielding.keys() - self.yielding.keys()):
            log.warning("%s", yielding[name])
        for name in sorted(self.yielding.keys() - yielding.keys()):
            log.info("scaling %s: no model waits for room any more; it follows demand", name)
        self.yielding = yielding

    def demand(self, name: str) -> Demand | None:
        return self._demands.get(name)

    def demands(self) -> dict[str, Demand]:
        return dict(self._demands)

    def pins(self) -> dict[str, int]:
        """The pinned counts, to keep across restarts."""
        return dict(self._pins)

    def follow(self, catalog: Catalog, counting: Mapping[str, int], *, settled: bool) -> None:
        """Keep a ``Demand`` for each ranged model of ``catalog`` (its range as the
        catalog says it now); ``counting``: replicas that count towards each model."""
        self._counting = dict(counting)
        for name, model in catalog.models.items():
            r = model.scaling
            if r is None or not model.profiles:
                continue
            span = Range(
                min=r.min,
                max=r.max,
                target=scaling_target(model),
                idle_s=r.idle_s,
                start_s=self.start_s(name, [p.name for p in model.profiles]) or 0.0,
            )
            demand = self._demands.get(name)
            have = max(r.min, min(r.max, counting.get(name, 0)))
            if demand is None:
                demand = self._demands[name] = Demand(range=span, count=have)
                if name in self._pins:  # pinned before this control plane started
                    demand.pinned = demand.count = max(0, min(r.max, self._pins[name]))
                continue
            if demand.range != span:
                demand.range = span
                demand.count = max(span.min, min(span.max, demand.count))
                if demand.pinned is not None:
                    demand.pinned = demand.count = min(span.max, demand.pinned)
            if not settled and demand.pinned is None:
                # what came back counts: nothing placed twice, nothing drained
                demand.count = max(demand.count, have)
        for name in list(self._demands):
            kept = catalog.models.get(name)
            if kept is None or kept.scaling is None:  # gone, or no range any more
                del self._demands[name]
        for name in [n for n in self._pins if n not in self._demands]:
            del self._pins[name]  # a model with no range any more has no pin

    def observe(self, loads: Mapping[str, ModelLoad], now: float, wall: float) -> None:
        """One reading per ranged model (no load said: none)."""
        for name, demand in self._demands.items():
            load = loads.get(name)
            reading = Reading(
                at=now,
                in_flight=load.in_flight if load else 0,
                waiting=load.waiting if load else 0,
                arrived=load.arrived if load else 0,
            )
            change = demand.observe(reading)
            if change is not None:
                self._said(name, change, wall)

    def pin(self, name: str, n: int | None, now: float, wall: float) -> str:
        """Hold ``name`` at ``n`` replicas until released (None); what was done, in words.

        Raises:
            KeyError: ``name`` is not a model with a range.
        """
        demand = self._demands[name]
        change = demand.pin(n, now)
        if demand.pinned is None:
            self._pins.pop(name, None)
        else:
            self._pins[name] = demand.pinned
        if change is not None:
            self._said(name, change, wall)
        if n is None:
            return f"{name}: released; its replicas follow demand again ({demand.count} now)"
        return (
            f"{name}: pinned at {demand.pinned} replicas until `llmgw ctl scale {name} --release`"
        )

    def _said(self, name: str, change: Change, wall: float) -> None:
        self.said[name] = Said(change, wall)
        self.events[name, change.kind] = self.events.get((name, change.kind), 0) + 1
        log.info("scaling %s: %s", name, change)

    # --- start times ------------------------------------------------------------------

    def saw(self, replicas: Iterable[Replica]) -> None:
        """Measure the start of every replica placed here that became Ready since the
        last call (an adopted one's start was before this control plane's time), and the
        wake of every one woken (``sleep.py``) that became Ready again."""
        ready: set[str] = set()
        for r in replicas:
            if r.state is not ReplicaState.READY:
                continue
            ready.add(r.replica_id)
            if r.replica_id in self._ready:
                continue
            self._ready.add(r.replica_id)
            if r.woken_at is not None and r.restarted_at == r.woken_at:
                took = max(0.0, r.state_since - r.woken_at)
                kept = self._wakes.setdefault((r.model, r.profile), deque(maxlen=STARTS_KEPT))
                kept.append(took)
                self.new_wakes.append((r.model, r.profile, took))
                continue
            if r.adopted or r.restarted_at is not None:
                continue
            # the engine's start: a fetch of its weights before it is not part of it
            took = max(0.0, r.state_since - (r.fetched_at or r.created_at))
            kept = self._starts.setdefault((r.model, r.profile), deque(maxlen=STARTS_KEPT))
            kept.append(took)
            self.new_starts.append((r.model, r.profile, took))
        self._ready &= ready  # one that leaves Ready is measured again when it comes back

    def start_s(self, model: str, profiles: Collection[str] = ()) -> float | None:
        """The model's measured start time (the median of the last few of its first
        profile that has any); None before one was measured."""
        return _median(self._starts, model, profiles)

    def wake_s(self, model: str, profiles: Collection[str] = ()) -> float | None:
        """The model's measured wake time (``start_s``'s, for a sleeping replica woken)."""
        return _median(self._wakes, model, profiles)

    def start_times(self, model: Model, *, asleep: bool = False) -> float:
        """``start_s``, or ``DEFAULT_START_S`` before a start was measured; for a model
        with a sleeping replica (``asleep``), its wake time (``DEFAULT_WAKE_S`` before
        one was measured)."""
        profiles = [p.name for p in model.profiles]
        if asleep:
            woke = self.wake_s(model.name, profiles)
            return DEFAULT_WAKE_S if woke is None else woke
        got = self.start_s(model.name, profiles)
        return DEFAULT_START_S if got is None else got


def _median(
    kept: Mapping[tuple[str, str], deque[float]], model: str, profiles: Collection[str]
) -> float | None:
    for profile in profiles:
        times = kept.get((model, profile))
        if times:
            return statistics.median(times)
    return None

"""A shard's lifecycle table against a simulated supervisor: a hypothesis state machine.

The supervisor runs a shard with several tasks that race: the launcher
(validate, spawn), the watcher (health until ready or the startup timeout,
then the process's end), the terminator (ending the process group), the
drainer, the sleeper (the engine's sleep call) and the waker (its wake call,
then its health), while the control plane's commands arrive at any moment. Each rule
here is one step one of them can take, at any await, and each hands its
event to ``lifecycle.move`` as the supervisor does; what the move asks for
(a report, ending the group, a drain) starts the simulated task.

The naive model of the world: a process that is alive or not; what the
control plane asked (start, stop, drain, sleep, wake); which tasks are still
running and at which await. The engine may crash at any time, and ending its
group may fail (it survives SIGKILL); asked to sleep or to wake, it may not
(no answer, a refusal); adopted, it may be asleep already.

Invariants: no pair that the tasks can produce is missing from the table (an
``IllegalMove`` fails the run); the reports the control plane hears are
legal moves of the wire state, and nothing follows ``stopped`` or
``failed``; ``ready`` and ``sleeping`` are heard only of a live engine nobody
asked to stop; ``stopped`` only after a stop or drain was asked, or a sleep
failed, and once the group is gone; the group is ended by one terminator at a
time, the engine drained, put to sleep or woken by one task at a time; and every
phase has a task that will move it on (nothing waits for ever). At the end, everything left
running runs to completion: a shard asked to stop is then stopped, or failed
with a reason.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from llmgw.agent.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    WIRE,
    Event,
    IllegalMove,
    Phase,
    expects_exit,
    move,
)

# Wire states the control plane may hear one after the other, written out apart
# from the table: a report of the same state again is always fine.
WIRE_MOVES = {
    ("starting", "ready"),
    ("starting", "failed"),
    ("starting", "stopping"),
    ("starting", "draining"),
    ("ready", "draining"),
    ("ready", "stopping"),
    ("ready", "failed"),
    ("draining", "stopping"),
    ("draining", "failed"),
    ("stopping", "stopped"),
    ("stopping", "failed"),
    ("draining", "sleeping"),
    ("starting", "sleeping"),  # adopted, and its engine says it sleeps
    ("sleeping", "starting"),  # waking
    ("sleeping", "draining"),
    ("sleeping", "stopping"),
    ("sleeping", "failed"),
}


# where a run begins: an adopted shard, or a new one moved on by this many of the rules'
# first steps (``LifecycleMachine.begin``), through the table, as far as a later phase
STARTS = {
    "adopted": 0,
    "new": 0,
    "ready": 3,
    "draining to sleep": 4,
    "falling asleep": 5,
    "asleep": 6,
    "waking": 7,
}


@attrs.define
class World:
    phase: Phase = Phase.STARTING
    alive: bool = False  # the engine process
    launcher: str | None = None  # "validating", "spawning" (checked, not yet spawned)
    watcher: str | None = None  # "until ready", "watching", "cleaning up"
    first_check: bool = False  # an adopted shard's health check before registering
    terminator: bool = False
    drainer: bool = False
    sleeper: bool = False  # the engine's sleep call is in flight
    waker: bool = False  # its wake call, or the health check after it, is in flight
    adopted: bool = False
    survives: bool = False  # the next end of its group fails
    asked_to_stop: bool = False
    sleep_failed: bool = False  # stopped for the agent's reason: its engine would not sleep
    heard: list[str] = attrs.Factory(list)  # every wire state reported, in order


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World()

    @initialize(start=st.sampled_from(list(STARTS)))
    def begin(self, start: str) -> None:
        if start == "adopted":
            # a previous agent's engine, alive; one health check, then its watcher
            self.w.alive = True
            self.w.first_check = True
            self.w.adopted = True
            return
        self.w.launcher = "validating"
        # the rules alone seldom go this deep before a stop or a crash ends the run
        steps = [
            self.prepared,
            self.spawned,
            self.healthy,  # ready
            self.sleep,  # draining to sleep
            self.drained,  # falling asleep
            self.slept,  # asleep
            self.wake,  # waking
        ]
        for step in steps[: STARTS[start]]:
            step()

    # --- the one way events reach the table ------------------------------------------

    def fire(self, event: Event) -> None:
        w = self.w
        before = w.phase
        m = move(before, event)  # an IllegalMove fails the run
        w.phase = m.to
        if m.report:
            state = WIRE[m.to]
            if w.heard and w.heard[-1] != state:
                assert (w.heard[-1], state) in WIRE_MOVES, (w.heard, state, event)
            assert not (w.heard and w.heard[-1] in ("stopped", "failed")), (w.heard, event)
            if state in ("ready", "sleeping") and not m.again:
                assert w.alive and not w.asked_to_stop, event
            if state == "stopped":
                assert (w.asked_to_stop or w.sleep_failed) and not w.alive, event
            w.heard.append(state)
        if m.end_process:
            assert not w.terminator, f"a second terminator on {event}"
            w.terminator = True
        if m.drain:
            assert not w.drainer, f"a second drainer on {event}"
            w.drainer = True
        if m.sleep:
            assert not w.sleeper, f"a second sleeper on {event}"
            w.sleeper = True
        if m.wake:
            assert not w.waker, f"a second waker on {event}"
            w.waker = True

    # --- the control plane ---------------------------------------------------------

    def known(self) -> bool:
        """Commands reach the shard while the supervisor holds it."""
        return self.w.phase not in TERMINAL

    @precondition(known)
    @rule()
    def start_again(self) -> None:
        self.fire(Event.START)

    @precondition(known)
    @rule()
    def stop(self) -> None:
        self.w.asked_to_stop = True
        self.fire(Event.STOP)

    @precondition(known)
    @rule()
    def drain(self) -> None:
        self.w.asked_to_stop = True
        self.fire(Event.DRAIN)

    @precondition(known)
    @rule()
    def sleep(self) -> None:
        self.fire(Event.SLEEP)

    @precondition(known)
    @rule()
    def wake(self) -> None:
        self.fire(Event.WAKE)

    # --- the launcher ----------------------------------------------------------------

    @precondition(lambda self: self.w.launcher == "validating")
    @rule()
    def refused(self) -> None:
        self.w.launcher = None
        self.fire(Event.REFUSED)

    @precondition(lambda self: self.w.launcher == "validating")
    @rule()
    def prepared(self) -> None:
        # right before the spawn it checks that the shard is still starting
        self.w.launcher = "spawning" if self.w.phase is Phase.STARTING else None

    @precondition(lambda self: self.w.launcher == "spawning")
    @rule()
    def spawned(self) -> None:
        w = self.w
        w.launcher = None
        w.alive = True
        self.fire(Event.LAUNCHED)
        if w.phase is Phase.STARTING:
            w.watcher = "until ready"
        else:
            w.alive = False  # no longer wanted: the launcher ends what it started

    # --- the watcher -----------------------------------------------------------------

    @precondition(lambda self: self.w.watcher == "until ready" and self.w.alive)
    @rule()
    def healthy(self) -> None:
        # the answer may arrive after anything else happened: the await is the check
        self.fire(Event.HEALTHY)
        self.w.watcher = "watching"

    @precondition(lambda self: self.w.first_check and self.w.alive)
    @rule()
    def adopted_healthy(self) -> None:
        self.fire(Event.HEALTHY)
        self.adopted_checked()

    @precondition(lambda self: self.w.first_check and self.w.alive)
    @rule()
    def adopted_asleep(self) -> None:
        # a previous agent put it to sleep: it says so before its health is asked
        self.fire(Event.SLEPT)
        self.adopted_checked()

    @precondition(lambda self: self.w.watcher == "until ready" and self.w.adopted and self.w.alive)
    @rule()
    def found_asleep(self) -> None:
        # its health answered, and then it said it sleeps
        self.fire(Event.SLEPT)
        self.w.watcher = "watching"

    @precondition(lambda self: self.w.first_check)
    @rule()
    def adopted_checked(self) -> None:
        w = self.w
        w.first_check = False
        w.watcher = "until ready" if w.phase is Phase.STARTING else "watching"

    @precondition(lambda self: self.w.watcher == "until ready")
    @rule()
    def startup_timeout(self) -> None:
        # checked right after a health check that did not answer: anything may have
        # happened during it
        self.fire(Event.TIMED_OUT)
        self.w.watcher = "watching"

    @precondition(
        lambda self: self.w.watcher == "until ready" and self.w.phase is not Phase.STARTING
    )
    @rule()
    def stops_waiting(self) -> None:
        self.w.watcher = "watching"

    @precondition(lambda self: self.w.watcher in ("until ready", "watching") and not self.w.alive)
    @rule()
    def sees_exit(self) -> None:
        w = self.w
        w.watcher = None if expects_exit(w.phase) else "cleaning up"

    @precondition(lambda self: self.w.watcher == "cleaning up")
    @rule()
    def cleaned_up(self) -> None:
        self.w.watcher = None
        self.fire(Event.EXITED)

    # --- the engine ----------------------------------------------------------------

    @precondition(lambda self: self.w.alive)
    @rule()
    def crash(self) -> None:
        self.w.alive = False

    @rule(survives=st.booleans())
    def next_end_fails(self, survives: bool) -> None:
        self.w.survives = survives

    # --- the terminator and the drainer ------------------------------------------------

    @precondition(lambda self: self.w.terminator and self.w.launcher != "spawning")
    @rule()
    def group_ended(self) -> None:
        w = self.w
        w.terminator = False
        if w.alive and w.survives:
            self.fire(Event.SURVIVED)
        else:
            w.alive = False
            self.fire(Event.GONE)

    @precondition(lambda self: self.w.terminator and self.w.launcher == "spawning")
    @rule()
    def group_ended_before_the_spawn(self) -> None:
        # it looked before there was a process: nothing to end
        self.w.terminator = False
        self.fire(Event.GONE)

    @precondition(lambda self: self.w.drainer)
    @rule()
    def drained(self) -> None:
        self.w.drainer = False
        self.fire(Event.DRAINED)

    # --- the sleeper and the waker -------------------------------------------------------

    @precondition(lambda self: self.w.sleeper and self.w.alive)
    @rule()
    def slept(self) -> None:
        self.w.sleeper = False
        self.fire(Event.SLEPT)

    @precondition(lambda self: self.w.sleeper)
    @rule()
    def sleep_fails(self) -> None:
        w = self.w
        w.sleeper = False
        # the reason is the agent's only while nothing else is ending it already
        w.sleep_failed = w.sleep_failed or w.phase is Phase.FALLING_ASLEEP
        self.fire(Event.SLEEP_FAILED)

    @precondition(lambda self: self.w.waker and self.w.alive)
    @rule()
    def woke(self) -> None:
        self.w.waker = False
        self.fire(Event.HEALTHY)

    @precondition(lambda self: self.w.waker)
    @rule()
    def wake_fails(self) -> None:
        self.w.waker = False
        self.fire(Event.WAKE_FAILED)

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def a_way_out(self) -> None:
        w = self.w
        if w.phase in (Phase.STOPPING, Phase.GIVING_UP):
            assert w.terminator, w
        elif w.phase in (Phase.DRAINING, Phase.DRAINING_TO_SLEEP):
            assert w.drainer, w
        elif w.phase is Phase.FALLING_ASLEEP:
            assert w.sleeper, w
        elif w.phase is Phase.WAKING:
            assert w.waker, w
        elif w.phase is Phase.SLEEPING:
            # nothing moves it but a command, or its end, which the watcher sees
            assert w.watcher is not None, w
        elif w.phase is Phase.STARTING:
            assert w.launcher is not None or w.watcher is not None or w.first_check, w

    @invariant()
    def stopped_means_gone(self) -> None:
        if self.w.phase is Phase.STOPPED:
            assert not self.w.alive

    def teardown(self) -> None:
        """Stop it, and run every task still running to its end."""
        w = self.w
        w.survives = False
        if self.known():
            self.stop()
        for _ in range(20):
            if w.first_check:
                self.adopted_checked()
            elif w.launcher == "validating":
                self.prepared()
            elif w.launcher == "spawning":
                self.spawned()
            elif w.terminator:
                self.group_ended()
            elif w.drainer:
                self.drained()
            elif w.sleeper and w.alive:
                self.slept()
            elif w.sleeper:
                self.sleep_fails()
            elif w.waker and w.alive:
                self.woke()
            elif w.waker:
                self.wake_fails()
            elif w.watcher is not None:
                if w.watcher == "cleaning up":
                    self.cleaned_up()
                elif w.alive:
                    w.watcher = "watching" if w.watcher == "until ready" else w.watcher
                    break
                else:
                    self.sees_exit()
            else:
                break
        assert w.phase in TERMINAL, w
        assert w.heard and w.heard[-1] == WIRE[w.phase], w
        if w.phase is Phase.STOPPED:
            assert not w.alive


LifecycleMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=30)
TestLifecycleMachine = LifecycleMachine.TestCase


def test_every_pair_the_table_leaves_out_raises() -> None:
    for phase in Phase:
        for event in Event:
            if (phase, event) not in TRANSITIONS:
                with pytest.raises(IllegalMove, match=r"shard s1: .* cannot happen while"):
                    move(phase, event, "s1")

"""One shard's lifecycle on its agent: every phase, every event, every legal move.

Theory of operation
-------------------
The supervisor runs each shard with a few tasks at once: the launcher
(validate, spawn), the watcher (health until ready, then the process's end),
a drainer or a terminator while it is being ended, a sleeper or a waker while
its engine falls asleep or wakes, and the control plane's commands arriving
whenever they like. Each of them reports what it saw as an ``Event``;
``move`` looks the pair (phase, event) up in ``TRANSITIONS`` and says where
the shard goes, whether the control plane is told, and what the supervisor
must set going (ending the process group, draining, the engine's sleep or
its wake).

Because those tasks race, many events arrive in a phase where they no longer
matter: a health check that answers just after a stop, an exit that a stop
caused, a second stop. Those are in the table too, as moves that change
nothing; a pair that is not in the table cannot happen and raises
``IllegalMove`` (the table is property-tested against a model of those
tasks). A command that changes nothing reports the current state again, so
the control plane hears where the shard stands, as a repeated start always
has.

Stopped and failed are terminal: the supervisor forgets the shard as it
enters one, and whatever its tasks still report afterwards is ignored.

``GIVING_UP`` (not ready within the startup timeout, or not awake: its
process group is being ended, then it fails) reads ``starting`` on the wire, as it always
has: the control plane hears ``failed`` once the group is gone.

Sleep (an engine launched able to, ``ShardSpec.sleep``): a ready shard told
to sleep drains first (``DRAINING_TO_SLEEP``, the drainer), then the sleeper
asks its engine to sleep (``FALLING_ASLEEP``); both read ``draining`` on the
wire, so the control plane hears ``draining``, then ``sleeping``. An engine
that will not sleep is stopped instead, as a drain would have. A sleeping
shard's process still runs, and its end is a failure, as a ready one's.
Told to wake, it reads ``starting`` (``WAKING``: the waker asks its engine to
wake, then for its health) until it is ``ready``; an engine that will not
wake is ended and fails (``GIVING_UP``). A wake while it drains to sleep or
falls asleep, or a sleep while it wakes, is a command that changes nothing:
the control plane hears the state again and asks again once the shard is
where the command means something. An adopted shard whose engine says it
sleeps (``SLEPT`` while ``STARTING``) is ``sleeping``, not ready.

This module is pure: no trio, no processes, no files.
"""

from __future__ import annotations

from enum import Enum

import attrs

from llmgw.protocol.messages import ShardState


class Phase(Enum):
    STARTING = "starting"  # validating, launching, or waiting for its health
    READY = "ready"
    DRAINING = "draining"  # finishing in-flight work, then it stops
    STOPPING = "stopping"  # told to stop: its process group is being ended
    # not ready in time, or it would not wake: its group is being ended, then it fails
    GIVING_UP = "giving up"
    DRAINING_TO_SLEEP = "draining to sleep"  # finishing in-flight work, then it sleeps
    FALLING_ASLEEP = "falling asleep"  # its engine was asked to sleep, and has not answered
    SLEEPING = "sleeping"  # its process runs, its GPU memory is free; it serves nothing
    WAKING = "waking"  # its engine was asked to wake: then its health, then ready
    STOPPED = "stopped"
    FAILED = "failed"


class Event(Enum):
    START = "start"  # the control plane asked to start it (again)
    LAUNCHED = "launched"  # the engine's process started
    REFUSED = "refused"  # it could not be launched (invalid, not installed, port held)
    HEALTHY = "healthy"  # its health endpoint answered (a worker: it stayed up a moment)
    TIMED_OUT = "timed out"  # not ready within its startup timeout
    EXITED = "exited"  # its process ended
    STOP = "stop"  # the control plane asked it to stop
    DRAIN = "drain"  # the control plane asked it to drain
    DRAINED = "drained"  # nothing in flight any more, or the drain's grace ran out
    GONE = "gone"  # no process of its group remains
    SURVIVED = "survived"  # its group survived SIGKILL
    SLEEP = "sleep"  # the control plane asked it to sleep
    SLEPT = "slept"  # its engine sleeps (it said so once asked to, or once adopted)
    SLEEP_FAILED = "sleep failed"  # its engine did not sleep (no answer, a refusal)
    WAKE = "wake"  # the control plane asked it to wake
    WAKE_FAILED = "wake failed"  # its engine did not wake, or not answer its health in time


WIRE: dict[Phase, ShardState] = {
    Phase.STARTING: ShardState.STARTING,
    Phase.READY: ShardState.READY,
    Phase.DRAINING: ShardState.DRAINING,
    Phase.STOPPING: ShardState.STOPPING,
    Phase.GIVING_UP: ShardState.STARTING,
    Phase.DRAINING_TO_SLEEP: ShardState.DRAINING,
    Phase.FALLING_ASLEEP: ShardState.DRAINING,
    Phase.SLEEPING: ShardState.SLEEPING,
    Phase.WAKING: ShardState.STARTING,
    Phase.STOPPED: ShardState.STOPPED,
    Phase.FAILED: ShardState.FAILED,
}

TERMINAL = frozenset({Phase.STOPPED, Phase.FAILED})


@attrs.frozen
class Move:
    to: Phase
    report: bool = False  # tell the control plane the state
    again: bool = False  # nothing changed: the report says the current state again
    end_process: bool = False  # end its process group (then GONE or SURVIVED)
    drain: bool = False  # wait for in-flight work (then DRAINED)
    sleep: bool = False  # ask the engine to sleep (then SLEPT or SLEEP_FAILED)
    wake: bool = False  # ask the engine to wake, then for its health (HEALTHY or WAKE_FAILED)


def _stay(phase: Phase, *, report: bool = False) -> Move:
    return Move(phase, report=report, again=report)


P, E = Phase, Event

# (phase, event) -> move. Nothing else can happen.
TRANSITIONS: dict[tuple[Phase, Event], Move] = {
    # starting: the launcher and the watcher decide, unless a command comes first
    (P.STARTING, E.START): _stay(P.STARTING, report=True),
    (P.STARTING, E.LAUNCHED): Move(P.STARTING, report=True),
    (P.STARTING, E.REFUSED): Move(P.FAILED, report=True),
    (P.STARTING, E.HEALTHY): Move(P.READY, report=True),
    (P.STARTING, E.TIMED_OUT): Move(P.GIVING_UP, end_process=True),
    (P.STARTING, E.EXITED): Move(P.FAILED, report=True),
    (P.STARTING, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    (P.STARTING, E.DRAIN): Move(P.DRAINING, report=True, drain=True),
    (P.STARTING, E.SLEEP): _stay(P.STARTING, report=True),  # it sleeps once ready
    (P.STARTING, E.SLEPT): Move(P.SLEEPING, report=True),  # adopted, and its engine sleeps
    (P.STARTING, E.WAKE): _stay(P.STARTING, report=True),
    # ready: serving until told otherwise or its process ends
    (P.READY, E.START): _stay(P.READY, report=True),
    (P.READY, E.EXITED): Move(P.FAILED, report=True),
    (P.READY, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    (P.READY, E.DRAIN): Move(P.DRAINING, report=True, drain=True),
    (P.READY, E.SLEEP): Move(P.DRAINING_TO_SLEEP, report=True, drain=True),
    (P.READY, E.WAKE): _stay(P.READY, report=True),
    # draining: a drain is a way out; a late launch or health check does not undo it
    (P.DRAINING, E.START): _stay(P.DRAINING, report=True),
    (P.DRAINING, E.LAUNCHED): _stay(P.DRAINING),
    (P.DRAINING, E.REFUSED): Move(P.FAILED, report=True),
    (P.DRAINING, E.HEALTHY): _stay(P.DRAINING),
    (P.DRAINING, E.TIMED_OUT): _stay(P.DRAINING),
    (P.DRAINING, E.EXITED): Move(P.FAILED, report=True),
    (P.DRAINING, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    (P.DRAINING, E.DRAIN): _stay(P.DRAINING, report=True),
    (P.DRAINING, E.DRAINED): Move(P.STOPPING, report=True, end_process=True),
    (P.DRAINING, E.SLEEP): _stay(P.DRAINING, report=True),
    (P.DRAINING, E.SLEPT): _stay(P.DRAINING),  # a drain overtook the sleep: it still stops
    (P.DRAINING, E.SLEEP_FAILED): _stay(P.DRAINING),
    (P.DRAINING, E.WAKE): _stay(P.DRAINING, report=True),
    (P.DRAINING, E.WAKE_FAILED): _stay(P.DRAINING),  # the drainer ends it all the same
    # draining to sleep: the drainer, then the sleeper; a drain or a stop overtakes it
    (P.DRAINING_TO_SLEEP, E.START): _stay(P.DRAINING_TO_SLEEP, report=True),
    (P.DRAINING_TO_SLEEP, E.EXITED): Move(P.FAILED, report=True),
    (P.DRAINING_TO_SLEEP, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    # the drainer already running goes on, and then it stops
    (P.DRAINING_TO_SLEEP, E.DRAIN): Move(P.DRAINING, report=True),
    (P.DRAINING_TO_SLEEP, E.DRAINED): Move(P.FALLING_ASLEEP, sleep=True),
    (P.DRAINING_TO_SLEEP, E.SLEEP): _stay(P.DRAINING_TO_SLEEP, report=True),
    (P.DRAINING_TO_SLEEP, E.WAKE): _stay(P.DRAINING_TO_SLEEP, report=True),
    # falling asleep: the sleeper decides, unless a command or its end comes first
    (P.FALLING_ASLEEP, E.START): _stay(P.FALLING_ASLEEP, report=True),
    (P.FALLING_ASLEEP, E.EXITED): Move(P.FAILED, report=True),
    (P.FALLING_ASLEEP, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    (P.FALLING_ASLEEP, E.DRAIN): Move(P.DRAINING, report=True, drain=True),
    (P.FALLING_ASLEEP, E.SLEEP): _stay(P.FALLING_ASLEEP, report=True),
    (P.FALLING_ASLEEP, E.SLEPT): Move(P.SLEEPING, report=True),
    (P.FALLING_ASLEEP, E.SLEEP_FAILED): Move(P.STOPPING, report=True, end_process=True),
    (P.FALLING_ASLEEP, E.WAKE): _stay(P.FALLING_ASLEEP, report=True),
    # sleeping: until woken, told to go, or its process ends
    (P.SLEEPING, E.START): _stay(P.SLEEPING, report=True),
    (P.SLEEPING, E.EXITED): Move(P.FAILED, report=True),
    (P.SLEEPING, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    (P.SLEEPING, E.DRAIN): Move(P.DRAINING, report=True, drain=True),  # nothing in flight
    (P.SLEEPING, E.SLEEP): _stay(P.SLEEPING, report=True),
    (P.SLEEPING, E.WAKE): Move(P.WAKING, report=True, wake=True),
    # waking: the waker decides, unless a command or its end comes first
    (P.WAKING, E.START): _stay(P.WAKING, report=True),
    (P.WAKING, E.HEALTHY): Move(P.READY, report=True),
    (P.WAKING, E.WAKE_FAILED): Move(P.GIVING_UP, end_process=True),
    (P.WAKING, E.EXITED): Move(P.FAILED, report=True),
    (P.WAKING, E.STOP): Move(P.STOPPING, report=True, end_process=True),
    (P.WAKING, E.DRAIN): Move(P.DRAINING, report=True, drain=True),
    (P.WAKING, E.SLEEP): _stay(P.WAKING, report=True),
    (P.WAKING, E.WAKE): _stay(P.WAKING, report=True),
    # stopping: only the end of its group moves it; everything else was overtaken
    (P.STOPPING, E.START): _stay(P.STOPPING, report=True),
    (P.STOPPING, E.LAUNCHED): _stay(P.STOPPING),  # the launcher ends what it just started
    (P.STOPPING, E.REFUSED): _stay(P.STOPPING),
    (P.STOPPING, E.HEALTHY): _stay(P.STOPPING),
    (P.STOPPING, E.TIMED_OUT): _stay(P.STOPPING),
    (P.STOPPING, E.EXITED): _stay(P.STOPPING),
    (P.STOPPING, E.STOP): _stay(P.STOPPING, report=True),
    (P.STOPPING, E.DRAIN): _stay(P.STOPPING, report=True),
    (P.STOPPING, E.DRAINED): _stay(P.STOPPING),
    (P.STOPPING, E.GONE): Move(P.STOPPED, report=True),
    (P.STOPPING, E.SURVIVED): Move(P.FAILED, report=True),
    (P.STOPPING, E.SLEEP): _stay(P.STOPPING, report=True),
    (P.STOPPING, E.SLEPT): _stay(P.STOPPING),
    (P.STOPPING, E.SLEEP_FAILED): _stay(P.STOPPING),
    (P.STOPPING, E.WAKE): _stay(P.STOPPING, report=True),
    (P.STOPPING, E.WAKE_FAILED): _stay(P.STOPPING),
    # giving up: already being ended, and it fails however that ends
    (P.GIVING_UP, E.START): _stay(P.GIVING_UP, report=True),
    (P.GIVING_UP, E.HEALTHY): _stay(P.GIVING_UP),
    (P.GIVING_UP, E.EXITED): _stay(P.GIVING_UP),
    (P.GIVING_UP, E.STOP): _stay(P.GIVING_UP, report=True),
    (P.GIVING_UP, E.DRAIN): _stay(P.GIVING_UP, report=True),
    (P.GIVING_UP, E.GONE): Move(P.FAILED, report=True),
    (P.GIVING_UP, E.SURVIVED): Move(P.FAILED, report=True),
    (P.GIVING_UP, E.SLEEP): _stay(P.GIVING_UP, report=True),
    (P.GIVING_UP, E.WAKE): _stay(P.GIVING_UP, report=True),
    # stopped and failed: forgotten; a task that reports late is ignored
    **{(phase, event): _stay(phase) for phase in TERMINAL for event in Event},
}

del P, E


class IllegalMove(AssertionError):
    """An event the supervisor's tasks cannot produce in this phase: a bug."""


def move(phase: Phase, event: Event, shard_id: str = "") -> Move:
    """Where a shard in ``phase`` goes on ``event``.

    Raises:
        IllegalMove: the pair is not in ``TRANSITIONS``.
    """
    found = TRANSITIONS.get((phase, event))
    if found is None:
        raise IllegalMove(f"shard {shard_id}: {event.value!r} cannot happen while {phase.value}")
    return found


def expects_exit(phase: Phase) -> bool:
    """Whether its process ending now is what was asked for (no cleanup, no failure)."""
    return phase in (Phase.STOPPING, Phase.GIVING_UP) or phase in TERMINAL

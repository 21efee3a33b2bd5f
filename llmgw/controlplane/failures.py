"""The last few engine failures of each model, kept after their replicas are gone.

A failed shard leaves its replica at once and the replica is forgotten on the
next pass; what the agent said (the exit, the engine's last lines) is kept
here so that ``ctl models`` and ``ctl replicas --failures`` can show it.
Bounded: a few failures per model, and only models of the catalog are asked for.
"""

from __future__ import annotations

import re
from collections import deque

import msgspec

KEEP_PER_MODEL = 5
TAIL_LINES = 20

_EXIT = re.compile(r"exited with code (-?\d+)")
_SIGNAL = re.compile(r"killed by signal (?:\d+ \()?(\w+)")  # "9 (SIGKILL)", or "SIGKILL"


class Failure(msgspec.Struct, kw_only=True, frozen=True):
    model: str
    replica_id: str
    shard_id: str
    node_id: str
    reason: str  # the agent's words: "engine exited with code 1"
    exit_code: int | None  # None: killed by a signal, or not known
    signal: str | None  # "SIGKILL", when a signal ended it
    output_tail: list[str]
    at: float  # wall clock, seconds since the epoch


def exit_of(reason: str) -> tuple[int | None, str | None]:
    """The exit code or the signal named in an agent's words, if any."""
    if m := _EXIT.search(reason):
        return int(m.group(1)), None
    if m := _SIGNAL.search(reason):
        return None, m.group(1)
    return None, None


class FailureLog:
    def __init__(self, keep: int = KEEP_PER_MODEL) -> None:
        self._keep = keep
        self._by_model: dict[str, deque[Failure]] = {}

    def record(self, failure: Failure) -> None:
        box = self._by_model.get(failure.model)
        if box is None:
            box = self._by_model[failure.model] = deque(maxlen=self._keep)
        box.append(failure)

    def recent(self, model: str) -> list[Failure]:
        """Newest first."""
        return list(reversed(self._by_model.get(model, ())))

    def all(self) -> list[Failure]:
        """Every kept failure, newest first."""
        every = [f for box in self._by_model.values() for f in box]
        return sorted(every, key=lambda f: f.at, reverse=True)

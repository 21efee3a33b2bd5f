"""The last few engine failures of each model, kept after their replicas are gone.

A failed shard leaves its replica at once and the replica is forgotten on the
next pass; what the agent said (its words, how the engine ended, the engine's
last lines) is kept here so that ``ctl models`` and ``ctl replicas --failures``
can show it. How the engine ended comes as numbers on the report that failed
the shard (``protocol.exits``); an agent older than those says it only in its
words, which are read back instead. Bounded: a few failures per model, and only
models of the catalog are asked for.
"""

from __future__ import annotations

import re
from collections import deque

import attrs
import msgspec

from llmgw.controlplane.plan import ReplicaFailed
from llmgw.protocol.exits import signal_name
from llmgw.protocol.messages import ShardStatus

KEEP_PER_MODEL = 5
TAIL_LINES = 20

# an agent older than ``ShardStatus.exit_code`` and ``signal`` says its engine's end
# only in words: read back from those, for one release
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


def reported_exit(failed: ReplicaFailed, status: ShardStatus) -> ReplicaFailed:
    """``failed`` with how its engine ended, where ``status`` is the report that failed
    it and says so."""
    if failed.shard_id != status.shard_id or (status.exit_code, status.signal) == (None, None):
        return failed
    return attrs.evolve(failed, exit_code=status.exit_code, signal=status.signal)


def how_ended(failed: ReplicaFailed) -> tuple[int | None, str | None]:
    """The exit code, or the name of the signal, that ended a failed replica's engine:
    as its agent reported them; from an agent older than those fields, as its words
    name them; ``(None, None)`` when neither says (a timeout, a lost node)."""
    if failed.signal is not None:
        return None, signal_name(failed.signal)
    if failed.exit_code is not None:
        return failed.exit_code, None
    return exit_of(failed.why)


def exit_of(reason: str) -> tuple[int | None, str | None]:
    """The exit code or the signal named in an older agent's words, if any."""
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

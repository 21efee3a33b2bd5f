"""The control plane's change bell: rung whenever something an operator sees changes.

Nodes (registered, a liveness move, a change in what a node reports), replicas (a
state or a failure), intent (cordon, drain, a pin), routing (a new snapshot). Whoever
shows the fleet live (the web console) waits here instead of polling: ``wait``
returns as soon as the bell has rung since the count it was given, with what rang.
Heartbeats that change nothing never ring it.
"""

from __future__ import annotations

import trio

KINDS = ("nodes", "replicas", "intent", "routing", "traffic")


class Bell:
    def __init__(self) -> None:
        self.count = 0  # rings so far
        self._what: dict[str, int] = {}  # each kind -> the count when it last rang
        self._rung = trio.Event()

    def ring(self, what: str) -> None:
        """Say that ``what`` (one of ``KINDS``) changed; wakes every waiter."""
        self.count += 1
        self._what[what] = self.count
        self._rung.set()
        self._rung = trio.Event()

    def since(self, count: int) -> list[str]:
        """What rang after ``count``, in ``KINDS`` order."""
        return [k for k in KINDS if self._what.get(k, 0) > count]

    async def wait(self, count: int) -> int:
        """The bell's count, as soon as it is past ``count``."""
        while self.count <= count:
            await self._rung.wait()
        return self.count

    @property
    def waiting(self) -> int:
        return self._rung.statistics().tasks_waiting

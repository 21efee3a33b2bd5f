"""Engine ports that something listens on and no shard of this agent is.

Placement hands out this node's engine ports from what the control plane
knows runs there. A port held by a process no shard describes, and that the
agent does not kill (an engine it started whose records were both spoiled:
``strays`` spares those; or anything, where stray killing is off), would be
handed out again, and every engine placed on it refused: the control plane
placed on the same port after each failure, for ever. So the agent reports
those ports in its inventory (``Inventory.busy_ports``), and placement leaves
them alone; the node's problems say who holds each and what to do.

Asked on every heartbeat: the listening sockets are one read of
``/proc/net/tcp``; who holds a busy port (a scan of every process's
descriptors) is asked only when the set of busy ports changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from llmgw.agent.launch import held_why
from llmgw.agent.procs import listening_ports, port_holders

log = logging.getLogger("llmgw.agent.supervisor")


def candidates(
    listening: Iterable[int], port_range: tuple[int, int], ours: Collection[int]
) -> set[int]:
    """The ports of the engine range that are listened on and no shard of ours is on."""
    low, high = port_range
    return {p for p in listening if low <= p <= high and p not in ours}


class BusyPorts:
    """The busy engine ports and, for each, the words for the node's problems.

    ``our_ports``: the ports this agent's shards are on; ``our_pids``: every
    process of them (a port one of them holds beside its own is not busy).
    """

    def __init__(
        self,
        port_range: tuple[int, int],
        state_dir: Path,
        our_ports: Callable[[], Collection[int]],
        our_pids: Callable[[], set[int]],
    ) -> None:
        self.port_range = port_range
        self.state_dir = state_dir
        self._our_ports = our_ports
        self._our_pids = our_pids
        self._seen: frozenset[int] = frozenset()
        self._said: tuple[list[int], list[str]] = ([], [])

    def __call__(self) -> tuple[list[int], list[str]]:
        found = frozenset(candidates(listening_ports(), self.port_range, self._our_ports()))
        if found == self._seen:
            return self._said
        self._seen = found
        busy: list[int] = []
        words: list[str] = []
        if found:
            ours = self._our_pids()
            for port, pids in sorted(port_holders(found).items()):
                if pids and pids <= ours:
                    continue  # a second listener of one of our engines
                busy.append(port)
                why = (
                    held_why(port, pids - ours, self.state_dir)
                    if pids
                    else f"port {port} is held by a process this agent cannot see"
                )
                words.append(f"{why}; nothing is placed on it while it is held")
        if busy != self._said[0]:
            if busy:
                log.warning(
                    "engine ports held by processes no shard describes: %s; the control "
                    "plane is told, and places nothing on them",
                    ", ".join(map(str, busy)),
                )
            else:
                log.info("no engine port is held by a process no shard describes any more")
        self._said = (busy, words)
        return self._said

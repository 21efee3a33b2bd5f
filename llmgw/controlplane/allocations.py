"""What is already handed out on each node: GPUs, engine ports, replicas per model,
and memory (what each shard there needs, as ``memory.Needs`` reckons it).

Derived from the replicas on every pass (never stored on its own), so it can
never disagree with them: the fleet is authoritative about what runs, and
replicas are rebuilt from what agents report. Ports a node says something
else holds (an engine no record describes) count as handed out too.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

PORT_RANGE = (20000, 20999)  # the agents' default engines.port_range


@attrs.define
class Allocations:
    gpus: dict[str, set[int]] = attrs.Factory(dict)  # node -> GPU indices in use
    ports: dict[str, set[int]] = attrs.Factory(dict)  # node -> engine ports in use
    replicas: dict[tuple[str, str], int] = attrs.Factory(dict)  # (model, node) -> shards
    memory: dict[str, int] = attrs.Factory(dict)  # node -> bytes its shards need
    holders: dict[str, int] = attrs.Factory(dict)  # node -> shards whose need is counted

    def take(
        self,
        node: str,
        model: str,
        gpus: Iterable[int],
        port: int,
        *,
        counts: bool = True,
        memory: int | None = None,
    ) -> None:
        """``counts``: False for a shard that is leaving; it holds its GPUs, port and
        memory, but placement's spreading does not count it (its replacement may stand
        beside it). ``memory``: bytes of node memory it needs; None: not known."""
        self.gpus.setdefault(node, set()).update(gpus)
        if port:
            self.ports.setdefault(node, set()).add(port)
        if memory is not None:
            self.memory[node] = self.memory.get(node, 0) + memory
            self.holders[node] = self.holders.get(node, 0) + 1
        if not counts:
            return
        key = (model, node)
        self.replicas[key] = self.replicas.get(key, 0) + 1

    def hold(self, node: str, ports: Iterable[int]) -> None:
        """Ports the node says something else holds (``Inventory.busy_ports``): no
        engine is placed on them."""
        self.ports.setdefault(node, set()).update(ports)

    def free_gpus(self, node: str, indices: Iterable[int]) -> list[int]:
        used = self.gpus.get(node, set())
        return [i for i in indices if i not in used]

    def free_port(self, node: str, port_range: tuple[int, int] = PORT_RANGE) -> int | None:
        used = self.ports.get(node, set())
        for port in range(port_range[0], port_range[1] + 1):
            if port not in used:
                return port
        return None

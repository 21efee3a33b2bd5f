"""The agent's view of its node: discovered facts, with what is written winning.

Discovery here is what is cheap and certain (hostname, CPUs, memory, the
route address); overrides from the config file replace any discovered value.
Memory is read on every heartbeat; the rest is refreshed on its own interval
and sent only when it changed.
"""

from __future__ import annotations

import os
import socket

import msgspec

from llmgw.agent.discovery.address import route_address
from llmgw.agent.discovery.memory import read_memory
from llmgw.config.schema import InventoryOverrides
from llmgw.protocol.messages import Inventory, Memory


class InventorySource:
    def __init__(self, overrides: InventoryOverrides, control_plane: tuple[str, int]) -> None:
        self.overrides = overrides
        self.control_plane = control_plane

    def memory(self) -> Memory:
        found = read_memory()
        total = self.overrides.memory_gb
        if total is None:
            return found
        total_bytes = int(total * 2**30)
        available = found.available_bytes
        if available is None or available > total_bytes:
            available = total_bytes
        return Memory(total_bytes=total_bytes, available_bytes=available)

    def inventory(self) -> Inventory:
        o = self.overrides
        address = o.address or route_address(*self.control_plane)
        return Inventory(
            hostname=socket.gethostname(),
            address=address,
            cpus=o.cpus if o.cpus is not None else os.cpu_count(),
            memory=self.memory(),
            fabric=o.fabric,
            labels=dict(o.labels),
        )


def same_inventory(a: Inventory, b: Inventory) -> bool:
    """Equal but for the memory reading, which travels in every heartbeat anyway."""
    return msgspec.structs.replace(a, memory=Memory()) == msgspec.structs.replace(
        b, memory=Memory()
    )

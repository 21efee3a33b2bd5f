"""The agent's view of its node: discovered facts, with what is written winning.

Discovery runs at start and again every ``discovery.interval_s`` in a task of
its own (so a slow nvidia-smi never delays a heartbeat); memory is read on
every heartbeat. ``inventory()`` is the latest discovery with the config's
overrides applied on top, every time: a value written in config always wins.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from llmgw.agent.discovery import Discovered, discover, resolve_dir
from llmgw.agent.discovery.address import route_address
from llmgw.agent.discovery.memory import read_memory
from llmgw.config.schema import DiscoveryConfig, InventoryOverrides, WeightsConfig
from llmgw.protocol.messages import Engine, FetchProgress, Gpu, Inventory, Memory

log = logging.getLogger("llmgw.agent.discovery")
STATE_DIR_MIN_FREE = 1 << 20  # less free in the state dir: full (a shard's record is ~2 KiB)


class InventorySource:
    def __init__(
        self,
        overrides: InventoryOverrides,
        control_plane: tuple[str, int],
        *,
        discovery: DiscoveryConfig | None = None,
        weights: WeightsConfig | None = None,
        base: Path | None = None,
        on_discovered: Callable[[float], None] | None = None,
        llama_server: str = "",
    ) -> None:
        self.overrides = overrides
        self.llama_server = llama_server  # [engines] llama_server: what is reported, if set
        self.control_plane = control_plane
        self.settings = discovery or DiscoveryConfig()
        self.weights = weights or WeightsConfig()
        self.base = base
        self.on_discovered = on_discovered
        self.port_range: list[int] = []  # set by the daemon from [engines] port_range
        # set by the daemon: where the agent keeps its records of the engines it runs.
        # Below ``min_free_bytes`` there, it says so (a record it cannot write is an
        # engine a restarted agent cannot adopt)
        self.state_dir: Path | None = None
        self.min_free_bytes = STATE_DIR_MIN_FREE
        # set by the daemon: the engine ports something no shard describes holds, and
        # the words for each (``busy.BusyPorts``)
        self.busy: Callable[[], tuple[list[int], list[str]]] | None = None
        # set by the daemon: the fetches of weights under way (``agent.weights``)
        self.fetching: Callable[[], list[FetchProgress]] | None = None
        self.weights_port = 0  # set by the daemon: its weights transfer listener's
        # set by the daemon: the sources whose last fetch found no room here
        self.no_room: Callable[[], list[str]] | None = None
        self._full = False
        self.discovered: Discovered | None = None
        self.address = ""
        self.changed = trio.Event()  # set whenever a refresh changed the inventory

    def landing_dir(self) -> Path:
        """Where fetched weights land: ``[weights] default_dir``, absolute."""
        return Path(os.path.abspath(resolve_dir(self.base, self.weights.default_dir)))

    def budget_bytes(self) -> int | None:
        """``[weights] budget_gb`` in bytes; None: no budget."""
        gb = self.weights.budget_gb
        return None if gb is None else int(gb * 2**30)

    def memory(self) -> Memory:
        found = read_memory(Path(self.settings.meminfo))
        total = self.overrides.memory_gb
        if total is None:
            return found
        total_bytes = int(total * 2**30)
        available = found.available_bytes
        if available is None or available > total_bytes:
            available = total_bytes
        return Memory(total_bytes=total_bytes, available_bytes=available)

    async def refresh(self) -> None:
        """Run discovery once; log what failed, in words."""
        before = self.inventory() if self.discovered is not None else None
        found = await discover(
            self.settings,
            self.weights,
            ib_fabrics=self.overrides.ib_fabrics,
            base=self.base,
            llama_server=self.llama_server,
        )
        for problem in found.problems:
            log.warning("discovery: %s", problem)
        self.discovered = found
        self.address = route_address(*self.control_plane)
        log.debug("discovery took %.3f s", found.duration_s)
        if self.on_discovered is not None:
            self.on_discovered(found.duration_s)
        if before is None or not same_inventory(before, self.inventory()):
            self.changed.set()
            self.changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Discover now, then again every interval, for as long as the agent runs."""
        await self.refresh()
        task_status.started()
        while True:
            await trio.sleep(self.settings.interval_s)
            await self.refresh()

    def inventory(self) -> Inventory:
        d = self.discovered
        o = self.overrides
        gpus: list[Gpu] = list(d.gpus) if d else []
        if o.gpus is not None:
            gpus = [
                Gpu(
                    index=g.index,
                    name=g.name,
                    uuid=g.uuid,
                    memory_total_mib=g.memory_total_mib,
                    healthy=g.healthy,
                    problems=list(g.problems),
                )
                for g in o.gpus
            ]
        engines: list[Engine] = list(d.engines) if d else []
        if o.engines is not None:
            written = {name: Engine(name=name, version=v) for name, v in o.engines.items()}
            engines = [e for e in engines if e.name not in written] + list(written.values())
        infiniband = list(d.infiniband) if d else []
        fabric = o.fabric or next((a.fabric for a in infiniband if a.fabric), "")
        busy, held = self.busy() if self.busy is not None else ([], [])
        return Inventory(
            hostname=d.hostname if d else "",
            address=o.address or self.address,
            cpus=o.cpus if o.cpus is not None else (d.cpus if d else None),
            memory=self.memory(),
            gpus=gpus,
            infiniband=infiniband,
            fabric=fabric,
            engines=engines,
            weights=list(d.weights) if d else [],
            weights_scanned=d.weights_scanned if d else False,
            weights_dirs=list(d.weights_dirs) if d else [],
            weights_dir=str(self.landing_dir()),
            weights_budget_bytes=self.budget_bytes(),
            weights_port=self.weights_port,
            weights_no_room=self.no_room() if self.no_room is not None else [],
            fetching=self.fetching() if self.fetching is not None else [],
            labels=dict(o.labels),
            port_range=list(self.port_range),
            busy_ports=busy,
            problems=self.problems() + held,
        )

    def problems(self) -> list[str]:
        """What is wrong with this node, in words; logged when it starts and ends."""
        if self.state_dir is None:
            return []
        try:
            free = shutil.disk_usage(self.state_dir).free
        except OSError as exc:
            free, why = 0, f"state dir {self.state_dir} cannot be read: {exc.strerror or exc}"
        else:
            why = f"state dir {self.state_dir} is full: {free >> 10} KiB free"
        full = free < self.min_free_bytes
        if full != self._full:
            self._full = full
            if full:
                log.warning("%s; engines keep serving, but no new one can be recorded", why)
            else:
                log.info("state dir %s has room again: %d KiB free", self.state_dir, free >> 10)
        return [why] if full else []


def same_inventory(a: Inventory, b: Inventory) -> bool:
    """Equal in what placement uses: memory readings travel in every heartbeat, and a
    GPU's used memory, utilisation and temperature change on every probe."""
    return _stable(a) == _stable(b)


def _stable(inv: Inventory) -> Inventory:
    gpus = [
        msgspec.structs.replace(
            g, memory_used_mib=None, memory_free_mib=None, utilization_pct=None, temperature_c=None
        )
        for g in inv.gpus
    ]
    # which sources are being fetched is news; how far each has come is not
    fetching = [FetchProgress(source=f.source, path=f.path) for f in inv.fetching]
    return msgspec.structs.replace(inv, memory=Memory(), gpus=gpus, fetching=fetching)

"""What the agent finds out about its node (each probe a module of its own).

``discover`` runs every probe, each bounded and each failing alone: a node
without nvidia-smi still reports its InfiniBand adapters, engines and weights
(the reference cut discovery short there on every CPU node).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import attrs
import trio

from llmgw.agent.discovery.engines import configured_problem, probe_engines
from llmgw.agent.discovery.gpus import discover_gpus
from llmgw.agent.discovery.infiniband import read_adapters
from llmgw.agent.discovery.memory import read_memory
from llmgw.agent.discovery.weights import scan_weights
from llmgw.config.schema import DiscoveryConfig, WeightsConfig
from llmgw.engines.llamacpp import LLAMA_SERVER
from llmgw.protocol.messages import Engine, Gpu, IbAdapter, Memory, WeightCopy

log = logging.getLogger("llmgw.agent.discovery")


@attrs.frozen
class Discovered:
    hostname: str
    cpus: int | None
    memory: Memory
    gpus: list[Gpu]
    infiniband: list[IbAdapter]
    engines: list[Engine]
    weights: list[WeightCopy]
    weights_scanned: bool
    weights_dirs: list[str]  # the directories looked in: those that are directories
    problems: list[str]  # in words; a probe that failed says so here
    duration_s: float


async def discover(
    settings: DiscoveryConfig,
    weights: WeightsConfig,
    *,
    ib_fabrics: dict[str, str] | None = None,
    base: Path | None = None,
    llama_server: str = "",
) -> Discovered:
    """Every probe, each bounded; ``llama_server`` is ``[engines] llama_server`` (empty:
    none written, so it is searched for)."""
    started = time.perf_counter()
    problems: list[str] = []
    gpu_result = await discover_gpus(settings.nvidia_smi, timeout=settings.probe_timeout_s)
    if gpu_result.error:
        problems.append(f"GPUs: {gpu_result.error}")
    configured = resolve_dir(base, llama_server) if llama_server else None
    if configured is not None and (problem := configured_problem(configured)):
        problems.append(f"engines: {problem}")
    engines = await probe_engines(
        search={LLAMA_SERVER.command: settings.llama_server_search},
        probe_timeout=settings.probe_timeout_s,
        configured={LLAMA_SERVER.command: configured} if configured is not None else None,
    )
    dirs = [resolve_dir(base, d) for d in weights.dirs]
    default_dir = resolve_dir(base, weights.default_dir)
    mounts_path = Path(settings.mounts)

    def scan() -> tuple[list[WeightCopy], bool, list[str]]:
        # in a thread: a hung filer must not stall the event loop
        copies = scan_weights(dirs, default_dir=default_dir, mounts_path=mounts_path)
        looked = list(dict.fromkeys(os.path.abspath(d) for d in [*dirs, default_dir] if d.is_dir()))
        return copies, bool(dirs) or default_dir.is_dir(), looked

    copies, scanned, looked = await trio.to_thread.run_sync(scan, abandon_on_cancel=True)
    return Discovered(
        hostname=socket.gethostname(),
        cpus=os.cpu_count(),
        memory=read_memory(Path(settings.meminfo)),
        gpus=gpu_result.gpus,
        infiniband=read_adapters(Path(settings.infiniband), ib_fabrics),
        engines=engines,
        weights=copies,
        weights_scanned=scanned,
        weights_dirs=looked,
        problems=problems,
        duration_s=time.perf_counter() - started,
    )


def resolve_dir(base: Path | None, path: str) -> Path:
    """A directory written in config, relative to ``base`` (the config file's)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p

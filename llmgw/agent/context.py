"""What a shard's tasks may ask of whoever runs them: the supervisor's settings and
``ShardContext``.

Theory of operation
-------------------
A shard is run by a few tasks (``launch``, and the watcher, the drainer, the
sleeper, the waker and the terminator of ``runner``). They observe, and hand
what they saw to ``fire``, which the supervisor owns: it asks the lifecycle
table where the shard goes, reports the move and sets going what the move
asks for. Besides
``fire`` the tasks need a handful of the agent's things (its settings, the
engine binaries, the records, the outbox, an HTTP client, a nursery to start
more tasks in), and nothing else of the supervisor.

``ShardContext`` names exactly those, as a ``Protocol``: the supervisor is
one, and a test can hand the tasks a stand-in. The task modules import this
module and never the supervisor, which imports them: the dependency points one
way, and an import-linter contract keeps it so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import httpx

from llmgw.agent.health import HealthSettings
from llmgw.agent.lifecycle import Event, Move
from llmgw.agent.records import RecordStore
from llmgw.agent.shard import Outbox, Shard
from llmgw.agent.weights import Fetcher
from llmgw.protocol.messages import ShardSpec


@attrs.frozen
class SupervisorSettings:
    state_dir: Path
    port_range: tuple[int, int] = (20000, 20999)
    kill_unidentified: bool = True
    stop_grace_s: float = 10.0
    log_max_bytes: int = 64 << 20
    stopped_log_keep_s: float = 72 * 3600.0
    stopped_logs_max_bytes: int = 1 << 30
    nvidia_smi: str = "nvidia-smi"
    health: HealthSettings = attrs.Factory(HealthSettings)  # checks of engines once ready
    # where engines listen: "auto" (the address this node reaches the control plane
    # from), or an address ("0.0.0.0": every interface)
    engine_bind: str = "auto"


def stop_grace(spec: ShardSpec, settings: SupervisorSettings, asked: float | None = None) -> float:
    """SIGTERM to SIGKILL for a shard: what the stop asked for, else its profile's (in
    its spec), else this agent's ``[engines] stop_grace_s``."""
    if asked is not None:
        return asked
    return spec.stop_grace_s if spec.stop_grace_s is not None else settings.stop_grace_s


class ShardContext(Protocol):
    """Everything a shard's tasks use of the agent that runs them."""

    @property
    def settings(self) -> SupervisorSettings: ...

    @property
    def records(self) -> RecordStore: ...

    @property
    def outbox(self) -> Outbox:
        """Where a report that is not a move goes (a ready engine's health)."""
        ...

    @property
    def fetcher(self) -> Fetcher:
        """Brings a shard's weights to the node before its engine starts."""
        ...

    @property
    def http(self) -> httpx.AsyncClient:
        """For engines' health and metrics endpoints."""
        ...

    def binaries(self) -> Mapping[str, str]:
        """The engine programs this node has, by name."""
        ...

    def on_event(self, what: str, /) -> None:
        """Counts a thing that happened ("launched", "unhealthy", ...)."""
        ...

    def fire(
        self, shard: Shard, event: Event, detail: str | None = None, *, grace: float = 0.0
    ) -> Move:
        """Move ``shard`` on ``event`` as the lifecycle table says, and act on the move."""
        ...

    def holds(self, shard: Shard) -> bool:
        """Whether ``shard`` is still the one the agent runs under its id."""
        ...

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` as a task that outlives the caller."""
        ...

    def bind_address(self, spec: ShardSpec) -> str:
        """Where the shard's engine listens."""
        ...

    def write_record(self, shard: Shard) -> None: ...

    async def kill_unidentified(self, ports: set[int]) -> None:
        """Kill what holds one of ``ports`` that no shard describes."""
        ...

    async def kill_gpu_holders(self) -> None:
        """Kill what holds GPU memory that no shard describes."""
        ...

    def sigkill_hook(
        self, shard: Shard, grace: float, how: str = ""
    ) -> Callable[[Sequence[int]], None]:
        """For ``terminate_group``: says and reports a SIGKILL of the shard's group."""
        ...

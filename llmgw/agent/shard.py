"""One shard as its agent holds it, and the outbox its reports wait in."""

from __future__ import annotations

import attrs
import trio

from llmgw.agent.lifecycle import WIRE, Phase
from llmgw.agent.output import OutputTail
from llmgw.agent.procs import ProcessIdentity
from llmgw.engines.base import Launch
from llmgw.protocol.messages import FetchProgress, ShardSpec, ShardState, ShardStatus

OUTBOX_LIMIT = 1000


@attrs.define(eq=False)
class Shard:
    spec: ShardSpec
    tail: OutputTail
    phase: Phase = Phase.STARTING
    launch: Launch | None = None
    process: trio.Process | None = None  # None when adopted (not our child)
    ident: ProcessIdentity | None = None
    adopted: bool = False
    detail: str = ""
    ending_why: str = ""  # why its group is being ended, when that ends in a failure
    # False while a ready engine does not answer its health checks (``health``)
    healthy: bool = True
    # how its engine ended, as ``subprocess`` gives it (negative: a signal), once it
    # ended unasked; None before, or when that could not be read (adopted)
    returncode: int | None = None
    launched_at: float = 0.0
    # how many times it woke from sleep: a health watcher watches one wake's ready
    wakes: int = 0
    # its weights are being fetched before its engine starts: how far (``runner``)
    fetching: FetchProgress | None = None
    fetch_scope: trio.CancelScope | None = None  # cancelled when it leaves starting

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def state(self) -> ShardState:
        """What the control plane is told."""
        return WIRE[self.phase]

    @property
    def pid(self) -> int | None:
        return self.ident.pid if self.ident else None


class Outbox:
    """Status reports waiting for a session to carry them (bounded, oldest dropped)."""

    def __init__(self) -> None:
        self.items: list[ShardStatus] = []
        self.changed = trio.Event()

    def put(self, status: ShardStatus) -> None:
        self.items.append(status)
        del self.items[:-OUTBOX_LIMIT]
        self.changed.set()
        self.changed = trio.Event()

    def take(self) -> list[ShardStatus]:
        items, self.items = self.items, []
        return items

"""The nodes of the fleet, by id, kept across control plane restarts.

What runs is rebuilt from what agents report; this is not a record of it. It
is only the list of nodes that a control plane which just started should
expect to come back: while one of them has neither registered nor been
declared Lost (``lost_after`` from the start), what it runs is unknown, and a
replica placed then would double one it may still be serving. A node leaves
the list when it is Lost. Written atomically, and only when it changes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import msgspec

from llmgw.files import write_atomic

log = logging.getLogger("llmgw.controlplane")


class _Known(msgspec.Struct, kw_only=True):
    nodes: list[str] = []


class KnownNodes:
    """``<state_dir>/nodes.json``; without a state directory, nothing is kept."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = state_dir / "nodes.json" if state_dir is not None else None
        self._saved: frozenset[str] | None = None

    def load(self) -> list[str]:
        if self.path is None or not self.path.exists():
            return []
        try:
            nodes = msgspec.json.decode(self.path.read_bytes(), type=_Known).nodes
        except (OSError, msgspec.DecodeError) as exc:
            log.error(
                "cannot read %s (%s); expecting no nodes from before this start: "
                "agents that come back later than reconcile.settle_s may find their "
                "replicas placed a second time",
                self.path,
                exc,
            )
            return []
        self._saved = frozenset(nodes)
        return sorted(self._saved)

    def save(self, nodes: Iterable[str]) -> None:
        """Keep ``nodes`` (written only when they differ from what was kept)."""
        now = frozenset(nodes)
        if self.path is None or now == self._saved:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, msgspec.json.encode(_Known(nodes=sorted(now))), 0o644)
        except OSError as exc:
            log.error("cannot write %s: %s", self.path, exc.strerror or exc)
        self._saved = now

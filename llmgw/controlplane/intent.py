"""The operator's intent (cordoned and draining nodes, pinned counts), kept across
restarts.

This is not fleet state, which is rebuilt from agents: nothing on a node
remembers that an operator asked to drain it. So it lives in the control
plane's state directory, written atomically on every change.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from llmgw.files import write_atomic

log = logging.getLogger("llmgw.controlplane")


class Intent(msgspec.Struct, kw_only=True):
    cordoned: list[str] = []
    draining: list[str] = []
    # ranged models held at a count by ``ctl scale`` until released
    pinned: dict[str, int] = {}


class IntentStore:
    def __init__(self, state_dir: Path | None) -> None:
        self.path = state_dir / "intent.json" if state_dir is not None else None

    def load(self) -> Intent:
        if self.path is None or not self.path.exists():
            return Intent()
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=Intent)
        except (OSError, msgspec.DecodeError) as exc:
            log.error(
                "cannot read %s (%s); starting with no cordoned or draining nodes and no "
                "pinned counts",
                self.path,
                exc,
            )
            return Intent()

    def save(self, cordoned: set[str], draining: set[str], pinned: dict[str, int]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        intent = Intent(cordoned=sorted(cordoned), draining=sorted(draining), pinned=pinned)
        write_atomic(self.path, msgspec.json.encode(intent), 0o644)

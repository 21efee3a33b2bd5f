"""What ``ctl bench`` sent the control plane: each model's last runs, for the console.

``ctl bench`` posts every finished run (``POST /v1/bench``); the newest ``KEEP`` of
each model are kept under ``<state_dir>/bench/<model>/``, so they outlive a restart,
and drawn as curves by the server (``llmgw.bench.svg``) when the console asks.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from urllib.parse import quote

import msgspec

from llmgw.bench import results
from llmgw.bench.ladder import Level
from llmgw.files import write_atomic

log = logging.getLogger("llmgw.bench")

KEEP = 5
MAX_BYTES = 512 * 1024  # a run is a few KiB: more is not a run


class RunSummary(msgspec.Struct, kw_only=True):
    date: str
    profile: str
    target: str  # router or replica
    slo: str
    capacity: int | None
    levels: list[Level]


class BenchList(msgspec.Struct, kw_only=True):
    runs: list[RunSummary]  # newest first


class BenchStore:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def keep(self, data: bytes) -> results.Run:
        """Keep a run ``ctl bench`` sent; the oldest beyond ``KEEP`` go.

        Raises:
            ValueError: it is not a bench result (in words for the 400).
            OSError: the state directory refused it.
        """
        if len(data) > MAX_BYTES:
            raise ValueError(f"a bench result is at most {MAX_BYTES} bytes")
        run = results.load(data, "the body")
        if not run.model:
            raise ValueError("the body is not a bench result: it names no model")
        folder = self._of(run.model)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = "".join(c for c in run.date if c.isalnum())
        write_atomic(folder / f"{stamp}-{secrets.token_hex(3)}.json", data, 0o644)
        for old in self._files(run.model)[KEEP:]:
            try:
                old.unlink()
            except OSError:
                pass
        return run

    def runs(self, model: str) -> list[results.Run]:
        """The model's kept runs, newest first; a file that no longer reads is skipped."""
        found: list[results.Run] = []
        for path in self._files(model):
            try:
                found.append(results.load(path.read_bytes(), str(path)))
            except (OSError, ValueError) as exc:
                log.debug("bench result %s skipped: %s", path, exc)
        return found

    def listed(self, model: str) -> BenchList:
        return BenchList(
            runs=[
                RunSummary(
                    date=r.date,
                    profile=r.profile,
                    target=r.target.kind,
                    slo=r.slo,
                    capacity=r.capacity,
                    levels=r.levels,
                )
                for r in self.runs(model)
            ]
        )

    def _of(self, model: str) -> Path:
        return self.folder / quote(model, safe="")

    def _files(self, model: str) -> list[Path]:
        try:
            entries = list(os.scandir(self._of(model)))
        except OSError:
            return []
        files = [Path(e.path) for e in entries if e.name.endswith(".json") and e.is_file()]
        return sorted(files, key=lambda p: p.name, reverse=True)

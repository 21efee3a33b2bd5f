"""What the agent writes about each shard it runs, so a restarted agent can adopt it.

The *full* shard spec is written, not just a pid and a command line: a pid
identifies a process, the spec is what lets it be described back to the
control plane and matched to a replica. Written atomically (temp file,
fsync, rename) before the shard is reported started, so a record never
describes half a shard.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from llmgw.files import write_atomic
from llmgw.protocol.messages import ShardSpec

log = logging.getLogger("llmgw.agent.supervisor")


class ShardRecord(msgspec.Struct, kw_only=True):
    spec: ShardSpec
    pid: int
    pgid: int
    start_time: int  # /proc/<pid>/stat field 22: with the pid, names one process
    cmdline: list[str]
    log_path: str
    launched_at: float  # wall clock
    health_url: str | None = None
    metrics_url: str | None = None
    cleanup: list[str] | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ShardRecord)


class RecordStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "shards"

    def path(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.json"

    def log_path(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.log"

    def write(self, record: ShardRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path(record.spec.shard_id), _encoder.encode(record), 0o600)

    def remove(self, shard_id: str) -> None:
        try:
            self.path(shard_id).unlink()
        except FileNotFoundError:
            pass

    def load_all(self) -> list[ShardRecord]:
        """Every readable record; a corrupt one is logged and set aside, not fatal."""
        out = []
        try:
            paths = sorted(self.dir.glob("*.json"))
        except OSError:
            return []
        for path in paths:
            try:
                out.append(_decoder.decode(path.read_bytes()))
            except (OSError, msgspec.DecodeError) as exc:
                log.error("cannot read shard record %s (%s); moving it aside", path, exc)
                try:
                    path.rename(path.with_suffix(".json.bad"))
                except OSError:
                    pass
        return out

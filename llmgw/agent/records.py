"""What the agent writes about each shard it runs, so a restarted agent can adopt it.

The *full* shard spec is written, not just a pid and a command line: a pid
identifies a process, the spec is what lets it be described back to the
control plane and matched to a replica. A record holds the engine's secret
key too, so it is written mode 0600 in a directory of mode 0700. Written atomically (temp file,
fsync, rename) before the shard is reported started, so a record never
describes half a shard.

The previous copy of each record is kept beside it (``<id>.json.prev``; at
the first write, a second copy of the first), and read when the record
itself cannot be: a disk error or a hand edit that spoils one file leaves the
engine adoptable. A record that cannot be read is moved aside as
``<id>.json.bad`` for whoever wants to see what went wrong.
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
    # the engine's secret key: why a record is 0600 in a 0700 directory. A restarted
    # agent needs it to health-check and to report the engine it adopts
    engine_key: str = ""
    # where its engine is told to sleep and to wake, and asked whether it sleeps: set
    # only for an engine launched able to (``Launch``), so a restarted agent can
    sleep_url: str | None = None
    wake_url: str | None = None
    sleeping_url: str | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ShardRecord)


class RecordStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "shards"

    def path(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.json"

    def log_path(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.log"

    def previous(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.json.prev"

    def write(self, record: ShardRecord) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.dir.stat().st_mode & 0o077:
            self.dir.chmod(0o700)  # it holds the engines' keys: nobody else's to list
        path = self.path(record.spec.shard_id)
        data = _encoder.encode(record)
        old = _read(path)
        # the previous copy is written first: at every moment one of the two is whole
        write_atomic(self.previous(record.spec.shard_id), data if old is None else old[1], 0o600)
        write_atomic(path, data, 0o600)

    def remove(self, shard_id: str) -> None:
        for path in (self.path(shard_id), self.previous(shard_id)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def shard_ids(self) -> set[str]:
        """Every shard with a record or a previous copy of one."""
        try:
            names = [p.name for p in self.dir.iterdir()]
        except OSError:
            return set()
        ids = set()
        for name in names:
            for suffix in (".json", ".json.prev"):
                if name.endswith(suffix) and len(name) > len(suffix):
                    ids.add(name[: -len(suffix)])
        return ids

    def load_all(self) -> list[ShardRecord]:
        """Every readable record, the previous copy where the record is not readable.

        A corrupt record is logged and set aside, not fatal.
        """
        out = []
        for sid in sorted(self.shard_ids()):
            path = self.path(sid)
            try:
                out.append(_decoder.decode(path.read_bytes()))
                continue
            except FileNotFoundError:
                pass
            except (OSError, msgspec.DecodeError) as exc:
                log.error("cannot read shard record %s (%s); moving it aside", path, exc)
                try:
                    path.rename(path.with_suffix(".json.bad"))
                except OSError:
                    pass
            prev = _read(self.previous(sid))
            if prev is None:
                log.error(
                    "shard %s has no readable record and no readable previous copy; "
                    "an engine of it that still runs is left running, unmanaged",
                    sid,
                )
                continue
            log.warning("shard %s: using the previous copy of its record", sid)
            out.append(prev[0])
        return out


def _read(path: Path) -> tuple[ShardRecord, bytes] | None:
    """The record at ``path`` and its bytes; None when it is missing or unreadable."""
    try:
        data = path.read_bytes()
        return _decoder.decode(data), data
    except (OSError, msgspec.DecodeError):
        return None

"""Shard records: the previous copy, and a spoiled record read from it."""

from __future__ import annotations

from pathlib import Path

from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.protocol.messages import ShardSpec


def record(pid: int, shard: str = "s1") -> ShardRecord:
    spec = ShardSpec(
        shard_id=shard, replica_id="r", model="m", profile="p", engine="llama.cpp", port=1
    )
    return ShardRecord(
        spec=spec, pid=pid, pgid=pid, start_time=1, cmdline=["x"], log_path="l", launched_at=0
    )


def test_the_previous_copy_is_read_when_the_record_is_spoiled(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.write(record(10))
    assert [r.pid for r in store.load_all()] == [10]  # a first record has a copy too
    store.path("s1").write_bytes(b"{")
    assert [r.pid for r in store.load_all()] == [10]
    assert store.path("s1").with_suffix(".json.bad").exists()

    store.write(record(11))
    store.write(record(12))
    store.path("s1").write_bytes(b"")
    assert [r.pid for r in store.load_all()] == [11]  # the one before the last


def test_nothing_readable_is_nothing_loaded_and_remove_removes_both(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.write(record(10))
    store.write(record(20, "s2"))
    store.path("s1").write_bytes(b"{")
    store.previous("s1").write_bytes(b"garbage")
    assert [r.spec.shard_id for r in store.load_all()] == ["s2"]
    store.remove("s2")
    assert not store.path("s2").exists() and not store.previous("s2").exists()
    assert store.load_all() == []

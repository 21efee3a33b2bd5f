"""Engine logs: rotation under a real O_APPEND writer, and what the sweep deletes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

from llmgw.agent.logs import LogFile, expired, listing, rotate, shard_of

WRITER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
for line in sys.stdin:
    os.write(fd, line.encode())
    print("ok", flush=True)
"""


async def test_rotation_under_an_appending_writer_leaves_no_hole(tmp_path: Path) -> None:
    log = tmp_path / "s1.log"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(log)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None

    def write(line: str) -> None:
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(line + "\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "ok\n"

    try:
        with trio.fail_after(10):
            write("a" * 3000)
            write("b" * 3000)
            assert not rotate(log, 10_000)  # under the limit: untouched
            write("c" * 5000)
            assert await trio.to_thread.run_sync(rotate, log, 10_000)
            assert log.stat().st_size == 0
            old = (tmp_path / "s1.log.1").read_bytes()
            assert len(old) == 10_000 and old.endswith(b"c" * 5000 + b"\n")
            write("after")
            # the writer's next write lands at the new end, not its old offset
            assert log.read_bytes() == b"after\n"
    finally:
        writer.kill()
        writer.wait(5)


def test_the_sweep_deletes_old_logs_then_the_oldest_past_the_size() -> None:
    def f(name: str, size: int, age: float) -> LogFile:
        sid = shard_of(name)
        assert sid is not None
        return LogFile(Path(name), sid, size, 1000.0 - age)

    files = [
        f("run.log", 500, 900),  # running: never
        f("run.log.1", 500, 900),
        f("old.log", 1, 200),  # past keep_s
        f("new.log", 40, 1),
        f("new.log.1", 40, 2),
        f("mid.log", 40, 10),  # past the size, oldest first
        f("mid.json.bad", 1, 11),
    ]
    doomed = expired(files, {"run"}, 1000.0, keep_s=100, keep_bytes=100)
    assert doomed == [Path("mid.json.bad"), Path("mid.log"), Path("old.log")]
    assert expired(files, {"run", "old", "new", "mid"}, 1000.0, keep_s=1, keep_bytes=0) == []


def test_shard_files_are_named_and_others_are_not_swept(tmp_path: Path) -> None:
    assert shard_of("a.b.log") == "a.b"
    assert shard_of("s1.log.1") == "s1"
    assert shard_of("s1.json") is None  # records are not the sweep's
    assert shard_of("s1.json.prev") is None
    assert shard_of(".log") is None
    for name in ("s1.log", "s1.json", "s1.json.prev", "notes.txt"):
        (tmp_path / name).write_text("x")
    os.mkdir(tmp_path / "d.log")
    (tmp_path / "link.log").symlink_to(tmp_path / "notes.txt")
    assert [f.shard_id for f in listing(tmp_path)] == ["s1"]  # no directories, no links

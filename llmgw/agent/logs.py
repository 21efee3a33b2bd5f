"""Engine log files: bounded while the engine runs, and kept only so long after it stops.

Theory of operation
-------------------
An engine writes its output straight into ``shards/<id>.log``, a file it
opened with ``O_APPEND`` (``output``). Not a pipe the agent drains: engines
outlive agent restarts, and while no agent reads the pipe the engine's
writes would block once it filled (stalling the engine) or die of SIGPIPE
once the reader was gone. The agent therefore bounds the file from outside,
without the engine's help:

- **Rotation by copy and truncate.** Every ``CHECK_S`` the agent stats the
  log of each engine it runs (one ``stat`` each: nothing is read while the
  file is small). Past ``max_bytes`` it copies the file's last ``max_bytes``
  into ``<id>.log.1`` (in a worker thread, replacing the previous one
  atomically) and truncates ``<id>.log`` to zero. The engine never notices:
  with ``O_APPEND`` each of its writes goes to the file's end *at the time of
  the write*, so after the truncation it writes at offset 0 and the file
  does not become sparse. (Renaming the file instead would not work: the
  engine's descriptor follows the inode, and it would fill the renamed file
  for ever.) What the engine writes between the copy and the truncation is
  lost; that is a few lines at most, once per ``max_bytes`` of output.
  Disk use per engine is at most two files of ``max_bytes`` plus what the
  engine writes in ``CHECK_S``.

- **Retention.** The logs of shards that no longer run here (not running,
  no record) stay for whoever wants to read why an engine failed, but for at
  most ``keep_s`` after their last write, and the newest of them only up to
  ``keep_bytes`` in all; the sweep runs with the check. A shard started
  again under the same id appends to its old log, which then counts as
  running again.

What to delete is decided in ``expired``, a function of the directory's
listing and ``now``; the loop only stats, copies, truncates and unlinks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import trio

from llmgw.files import write_atomic

log = logging.getLogger("llmgw.agent.supervisor")

CHECK_S = 1.0

#: The files of a shard in the state dir that the sweep may delete, by suffix.
SWEPT_SUFFIXES = (".log", ".log.1", ".json.bad")


@attrs.frozen
class LogFile:
    path: Path
    shard_id: str
    size: int
    mtime: float


def shard_of(name: str) -> str | None:
    """The shard a file of the state dir belongs to, for the files the sweep may delete."""
    for suffix in SWEPT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def expired(
    files: Iterable[LogFile], live: set[str], now: float, keep_s: float, keep_bytes: int
) -> list[Path]:
    """The files to delete: those of shards not in ``live`` older than ``keep_s``,
    then the oldest of the rest until they add up to at most ``keep_bytes``."""
    stale = [f for f in files if f.shard_id not in live]
    doomed = [f for f in stale if now - f.mtime > keep_s]
    kept = sorted((f for f in stale if now - f.mtime <= keep_s), key=lambda f: -f.mtime)
    total = 0
    for f in kept:
        total += f.size
        if total > keep_bytes:
            doomed.append(f)
    return sorted(f.path for f in doomed)


def listing(directory: Path) -> list[LogFile]:
    """The files of ``directory`` the sweep may delete; what vanishes meanwhile is skipped."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        sid = shard_of(entry.name)
        if sid is None:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        out.append(LogFile(Path(entry.path), sid, st.st_size, st.st_mtime))
    return out


def rotate(path: Path, max_bytes: int) -> bool:
    """Copy the last ``max_bytes`` of ``path`` to ``<path>.1`` and truncate ``path``,
    if it is over ``max_bytes``; True when it was. Blocking: run it in a thread."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= max_bytes:
                return False
            f.seek(size - max_bytes)
            kept = f.read(max_bytes)
        write_atomic(path.with_name(path.name + ".1"), kept, 0o640)
        os.truncate(path, 0)
    except OSError as exc:
        log.warning("cannot rotate engine log %s (%s); it keeps growing", path, exc)
        return False
    return True


def over(path: Path, max_bytes: int) -> bool:
    try:
        return path.stat().st_size > max_bytes
    except OSError:
        return False


async def mind(
    running: Callable[[], Iterable[Path]],
    live: Callable[[], set[str]],
    directory: Path,
    *,
    max_bytes: int,
    keep_s: float,
    keep_bytes: int,
) -> None:
    """For ever: rotate the logs of running engines, and sweep those of stopped shards.

    ``running`` gives the log paths of the engines that run now; ``live`` the
    shards whose files must stay (running, or with a record).
    """
    while True:
        for path in list(running()):
            if over(path, max_bytes):
                await trio.to_thread.run_sync(rotate, path, max_bytes)
        for path in expired(listing(directory), live(), time.time(), keep_s, keep_bytes):
            try:
                path.unlink()
            except OSError:
                continue
            log.info("deleted %s, left by a shard that no longer runs here", path.name)
        await trio.sleep(CHECK_S)

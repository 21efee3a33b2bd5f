"""One agent per state dir: a lock held on a file in it for the agent's life.

Two agents sharing a state dir would each adopt the other's engines, read the
other's records as their own, and kill what they cannot describe. The second
one to start refuses, naming the first one's pid, which the lock file holds.
The lock is ``flock``: the kernel lets it go when the holder exits, however it
exits, so a killed agent never leaves a stale lock behind. The file's
descriptor is not inherited, so an engine that outlives its agent holds none.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw.config import ConfigError

LOCK_FILE = "agent.lock"


class StateDirBusy(ConfigError):
    """Another agent holds this state dir."""

    def __init__(self, pid: str, state_dir: Path) -> None:
        Exception.__init__(
            self,
            f"another agent (pid {pid}) runs with state dir {state_dir}; stop it first, "
            "or give this one another state_dir",
        )
        self.source, self.key, self.problem = str(state_dir), "state_dir", str(self)


@contextmanager
def hold(state_dir: Path) -> Iterator[None]:
    """Hold the state dir's lock until the block ends; StateDirBusy when another agent has it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise StateDirBusy(holder, state_dir) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)

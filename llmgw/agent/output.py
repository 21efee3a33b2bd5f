"""An engine's output: a log file it appends to, and the tail the agent keeps.

Engines write to a file, not a pipe: a pipe would break when the agent
restarts (the engine would die of SIGPIPE), and engines must outlive agent
restarts. The agent follows the file into a bounded ring of lines, whose
tail travels with every failure report. The file is bounded by ``logs``,
which rotates it (copy, then truncate) while the engine runs; a read that
finds the file shorter than where it stopped starts again from the top, and
a read that is far behind skips to the last ``READ_MAX`` bytes: the tail is
about how the engine ended.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

TAIL_LINES = 200
MAX_LINE = 1000
READ_MAX = 4 << 20


class OutputTail:
    def __init__(self, path: Path, *, lines: int = TAIL_LINES) -> None:
        self.path = path
        self.lines: deque[str] = deque(maxlen=lines)
        self._offset = 0
        self._partial = b""

    def open_for_engine(self) -> int:
        """A file descriptor the engine writes to (the caller closes it after spawning)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self._offset = os.fstat(fd).st_size
        return fd

    def skip_to_end(self) -> None:
        """Follow only what is written from now on (an adopted engine's earlier output)."""
        try:
            self._offset = self.path.stat().st_size
        except OSError:
            self._offset = 0

    def poll(self) -> None:
        """Read whatever the engine wrote since the last poll."""
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # rotated under us
                    self._offset = 0
                if size - self._offset > READ_MAX:
                    self._offset = size - READ_MAX
                    self._partial = b""
                f.seek(self._offset)
                data = f.read(READ_MAX)
                self._offset += len(data)
        except OSError:
            return
        if data:
            chunks = (self._partial + data).split(b"\n")
            self._partial = chunks.pop()[-MAX_LINE:]
            for raw in chunks:
                self.lines.append(raw[:MAX_LINE].decode(errors="replace").rstrip("\r"))

    def tail(self, n: int = 40) -> list[str]:
        self.poll()
        out = list(self.lines)[-n:]
        if self._partial:
            out.append(self._partial.decode(errors="replace"))
        return out

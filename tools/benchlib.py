"""What the benchmarks under ``tools/`` share: process CPU, percentiles, ports, and
the ``llmgw`` daemons they start.

Standard library only: ``bench_router.py``'s load generator imports it from
another virtualenv. The scripts run as ``python tools/NAME.py``, so this is
imported as ``benchlib`` (or as ``tools.benchlib`` by a script that tests import
too: one name in one script, or ``Failed`` is two classes).
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid``, from the scheduler's own nanosecond
    account (/proc/<pid>/task/*/schedstat).

    utime+stime in /proc/<pid>/stat is charged by whole clock ticks to whatever
    runs when a tick lands, which skews work that wakes in step with a timer
    (paced streaming, heartbeats) badly; it is the fallback where schedstat is
    missing. 0.0 for a process that is gone."""
    total, found = 0.0, False
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
                found = True
            except (OSError, IndexError, ValueError):
                continue
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return 0.0
    if found:
        return total
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu(pid: int) -> float:
    """CPU time of ``pid`` and every process below it."""
    return sum(cpu_seconds(p) for p in descendants(pid))


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; None if empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Failed(Exception):
    """The benchmark cannot go on; the message says why."""


class LlmgwProc:
    """``python -m llmgw ARGS``, run in ``workdir`` in a session of its own (Ctrl-C
    reaches the benchmark only, which stops it), its output in ``workdir/NAME.log``."""

    def __init__(
        self,
        name: str,
        args: list[str],
        workdir: Path,
        *,
        preexec_fn: Callable[[], None] | None = None,
        grace_s: float = 5,
    ) -> None:
        self.name = name
        self.grace_s = grace_s
        self.log_path = workdir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", *args],
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True,
                preexec_fn=preexec_fn,
            )
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 20) -> re.Match[str]:
        """The first match of ``pattern`` in its log, within ``timeout`` s and while it
        runs; else ``Failed``, with the end of its log."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.log())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise Failed(
            f"{self.name}: no {pattern!r} in its log (exit {self.proc.poll()}):\n"
            + self.log()[-3000:]
        )

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise Failed(f"the {self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, and SIGKILL ``grace_s`` later if it is still there."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

"""What the benchmarks under ``tools/`` measure with: process CPU, percentiles, ports.
(The processes they start are ``procs``'s.)

Standard library only at import: ``tools/bench_router.py``'s load generator imports it
from another virtualenv (``server_head`` imports llmgw when it is called).
"""

from __future__ import annotations

import math
import os
import socket
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


def pin(pid: int, cores: set[int]) -> None:
    """Run every thread of ``pid`` and of the processes below it on ``cores`` only
    (threads started later inherit it). Gone processes are passed over."""
    for p in descendants(pid):
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                os.sched_setaffinity(int(task.name), cores)
        except (OSError, ValueError):
            continue


def tree_cpu(pid: int) -> float:
    """CPU time of ``pid`` and every process below it."""
    return sum(cpu_seconds(p) for p in descendants(pid))


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; None if empty."""
    if not 0 < q <= 1:  # a percent (50 for the median) would be the maximum, silently
        raise ValueError(f"percentile: q = {q} is not a fraction in (0, 1]")
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_head(workdir: Path, admin: str = "127.0.0.1:0") -> str:
    """The start of a benchmark's ``server.toml``: its state and catalog in ``workdir``,
    an agent stream on a free loopback port with a CA and certificate made under
    ``workdir/pki``, and the admin listener at ``admin``; the caller adds the rest."""
    from llmgw.tls import init_ca, issue_server, load_ca

    pki = workdir / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    init_ca(pki)
    cert, key = issue_server(load_ca(pki), ["127.0.0.1"], pki)
    return f"""state_dir = "state"
catalog = "catalog.toml"
[agent_stream]
listen = "127.0.0.1:0"
ca = "{pki / "ca.pem"}"
cert = "{cert}"
key = "{key}"
[admin]
listen = "{admin}"
"""

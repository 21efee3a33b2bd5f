"""The one harness for the processes that the benchmarks, the lab, ``tools/fleet`` and
the tests start: ``python -m llmgw ...`` daemons, llama-servers, other routers, helpers.

A ``Proc`` is one command (an argv) run in a working directory with its stdout and
stderr appended to ``workdir/NAME.log``; started again, it appends, so the log keeps
what every run said. What it reads of its log (``log()``, the waits) is what its own
runs wrote: a folder used again holds an earlier ``Proc``'s log of that name, whose
lines (a llama-server's port) would otherwise answer a wait for this one's. What
each caller needed is an option, read when it starts:
``env`` (added to this process's environment; ``PYTHONUNBUFFERED=1`` always, so a
Python child's lines reach its log as it writes them), ``session`` (a session and
process group of its own: Ctrl-C reaches the caller only, which stops it, and a stop
signals the whole group, the process and its workers), ``nofile`` (its open-files
limit), ``core`` (the one CPU it runs on), ``preexec`` (anything else, run in the child
before it executes), and ``output``: ``log`` (the default), ``pipes`` (stdin and
stdout are pipes to the caller, stderr alone goes to the log) or ``terminal`` (the
caller's own stdout and stderr: ``tools/fleet``); ``fresh`` empties the log first.

Reading: ``log()`` is the whole log, read again at each call (these logs are small).
Waiting: ``wait_log`` polls the log every 50 ms until it holds ``count`` matches of a
pattern, and ``wait_until`` polls any check; either gives up, with ``Failed`` and the
end of the log, when the process exits first or the timeout passes. ``TrioProc`` has the
same waits as trio functions, for the tests; trio is imported there only, because the
router benchmarks' load generators import this module from virtualenvs without it.

Stopping: ``stop()`` sends SIGTERM (or a signal given), waits ``grace_s``, then sends
SIGKILL, and returns the seconds the process took to exit; in a session of its own
whatever is left of its group is killed too (a tool's worker processes that outlive
their leader). A ``pipes`` process is first asked by closing its stdin.
``TrioProc.stop`` times the exit under trio and fails when it is late: a test's claim.

``Procs`` holds one run's processes by name and ends them all on the way out; a tool
that calls ``interrupt_on_sigterm`` first ends them on SIGTERM too (``timeout``, a
killed job), as on Ctrl-C, rather than dying with its children left running. ``alive``
and ``started`` read /proc for a process some other process started (the lab's record
of its daemons, kept across commands): whether it runs, and when it started, which
tells it from a later process that has its number.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal, Self, TypeVar

ROOT = Path(__file__).resolve().parents[2]  # the checkout: ``tools`` is imported from here
POLL_S = 0.05
T = TypeVar("T")
Output = Literal["log", "pipes", "terminal"]


class Failed(RuntimeError):
    """A process did not do what was waited for; the message says why, with its log."""


def llmgw(*args: str, module: str = "llmgw") -> list[str]:
    """The argv of ``python -m llmgw ARGS`` (or of another module that runs llmgw)."""
    return [sys.executable, "-m", module, *args]


def python_path() -> dict[str, str]:
    """``PYTHONPATH`` with the checkout first, to add to a child Python's environment
    (another virtualenv's, or one that runs elsewhere than the checkout) that imports
    ``tools``: the child is told where it is, nothing edits its ``sys.path``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def interrupt_on_sigterm() -> None:
    """SIGTERM to this process raises KeyboardInterrupt, as Ctrl-C does: the ``finally``
    blocks that stop its children run (Python's default for SIGTERM runs none)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def stop_engines(workdir: Path, sig: int = signal.SIGTERM) -> None:
    """Engines outlive their agents by design: ``sig`` to every engine the agents under
    ``workdir`` recorded (``*/shards/*.json``, each agent's state dir), and the records
    gone, so that a fleet started here that stops takes them along."""
    for record in workdir.glob("*/shards/*.json"):
        try:
            os.killpg(int(json.loads(record.read_text())["pid"]), sig)
        except (OSError, ValueError, KeyError):
            pass
        record.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def started(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot), to tell it from a later process
    that reuses its number; empty when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


class Process:
    """One command, its output in ``workdir/NAME.log`` (see the module docstring): all
    but the waits, which are ``Proc``'s (blocking) and ``TrioProc``'s (trio)."""

    shown: int | None = 3000  # characters of the end of its log a failure shows; None: all

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        *,
        env: Mapping[str, str] | None = None,
        session: bool = False,
        nofile: int | tuple[int, int] | None = None,
        core: int | None = None,
        preexec: Callable[[], None] | None = None,
        output: Output = "log",
        fresh: bool = False,
        grace_s: float = 5.0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.workdir = workdir
        self.env = dict(env or {})
        self.session = session
        self.nofile = nofile  # soft and hard; one number for both
        self.core = core
        self.preexec = preexec
        self.output = output
        self.fresh = fresh  # its log emptied when it starts, not appended to
        self.grace_s = grace_s
        self.log_path = workdir / f"{name}.log"
        self._since = 0  # where in the log its first start (or a fresh one) began writing
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # a child of this Python (``llmgw()``) imports this checkout, as this process
        # does, not what its virtualenv has installed: a benchmark run from a worktree
        # otherwise measured the main checkout's router, started from the run's folder
        if self.argv[:1] == [sys.executable]:
            env.update(python_path())
        env.update(self.env)
        needs_preexec = self.nofile is not None or self.core is not None or self.preexec
        stdin: int | None = subprocess.PIPE if self.output == "pipes" else subprocess.DEVNULL
        log: IO[bytes] | None = None
        if self.output != "terminal":
            log = self.log_path.open("wb" if self.fresh else "ab")
            if self.fresh or self.proc is None:
                self._since = log.tell()  # the end: an earlier Proc's lines are not its own
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.workdir,
                stdin=stdin,
                stdout=subprocess.PIPE if self.output == "pipes" else log,
                stderr=log if self.output == "pipes" else subprocess.STDOUT if log else None,
                env=env,
                start_new_session=self.session,
                preexec_fn=self._in_child if needs_preexec else None,
            )
        finally:
            if log is not None:
                log.close()  # the child has its own
        return self

    def _in_child(self) -> None:
        if self.nofile is not None:
            soft, hard = (self.nofile, self.nofile) if isinstance(self.nofile, int) else self.nofile
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if self.core is not None:
            os.sched_setaffinity(0, {self.core})
        if self.preexec is not None:
            self.preexec()

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise Failed(f"{self.name} was never started")
        return self.proc

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        """What its runs wrote to its log (not an earlier ``Proc``'s of the same name)."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self._since)
            return f.read().decode(errors="replace")

    def tail(self) -> str:
        """The end of its log, as much as a failure shows (``shown`` characters)."""
        log = self.log()
        return log if self.shown is None else log[-self.shown :]

    def returncode(self) -> int | None:
        """Its exit status once it has exited; None while it runs or before it starts."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_running(self) -> None:
        """Nothing while it runs; else ``Failed``, with the end of its log."""
        if not self.running():
            raise Failed(f"{self.name} exited ({self.returncode()}):\n{self.tail()}")

    def send_signal(self, sig: int) -> None:
        """``sig`` to the process itself (not its group); nothing once it has exited."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """``sig`` to its group when it has a session of its own, else to it."""
        if not self.session:
            self.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def _found(self, rx: re.Pattern[str], count: int) -> re.Match[str] | None:
        found = list(rx.finditer(self.log()))
        return found[count - 1] if len(found) >= count else None

    def _no_log(self, pattern: str, count: int) -> Failed:
        times = f"{count}x " if count > 1 else ""
        return Failed(
            f"{self.name}: no {times}{pattern!r} in its log (exit {self.returncode()}):\n"
            + self.tail()
        )

    def kill(self) -> None:
        """SIGKILL, now (its group too, with a session of its own)."""
        if self.running():
            self.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)


class Proc(Process):
    """A ``Process`` whose waits block: for the benchmarks, the lab and ``tools/fleet``."""

    def wait_log(self, pattern: str, *, count: int = 1, timeout: float = 20) -> re.Match[str]:
        """The ``count``-th match of ``pattern`` in its log, within ``timeout`` s and while
        it runs; else ``Failed``, with the end of its log."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = self._found(rx, count)
            if m is not None:
                return m
            if not self.running() or time.monotonic() > deadline:
                raise self._no_log(pattern, count)
            time.sleep(POLL_S)

    def wait_until(self, check: Callable[[], T | None], what: str, timeout: float) -> T:
        """What ``check`` returns once it is true, polled while the process runs (an
        OSError or ValueError from it counts as not yet); else ``Failed``."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                raise Failed(
                    f"{self.name} exited ({self.returncode()}); its log ends:\n{self.tail()}"
                )
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
                found = check()
                if found:
                    return found
            if time.monotonic() > deadline:
                raise Failed(
                    f"{self.name}: no {what} after {timeout:g} s; its log ends:\n{self.tail()}"
                )
            time.sleep(0.1)

    def stop(self, sig: int | None = signal.SIGTERM, grace_s: float | None = None) -> float:
        """Ask it to exit (``sig``; a ``pipes`` process first by closing its stdin; None:
        it was asked already), SIGKILL after ``grace_s`` (default: its own), and return the
        seconds it took to exit."""
        t0 = time.monotonic()
        if self.proc is None:
            return 0.0
        grace = self.grace_s if grace_s is None else grace_s
        if self.output == "pipes" and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        for s, wait in ((sig, grace), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            if s is not None:
                self.signal_group(s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        took = time.monotonic() - t0
        if self.session:  # what is left of its group: workers that outlived it
            self.signal_group(signal.SIGKILL)
        return took


class TrioProc(Process):
    """A ``Process`` whose waits are trio's: for tests, which run under trio. A failure
    shows its whole log."""

    shown = None

    async def wait_log(self, pattern: str, *, count: int = 1, timeout: float = 15) -> re.Match[str]:
        """As ``Proc.wait_log``, sleeping in trio."""
        import trio

        rx = re.compile(pattern)
        with trio.move_on_after(timeout):
            while True:
                m = self._found(rx, count)
                if m is not None:
                    return m
                if not self.running():
                    break
                await trio.sleep(POLL_S)
        raise self._no_log(pattern, count)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> float:
        """Send ``sig`` and return how long it took to exit; trio.TooSlowError when it has
        not within ``timeout`` (the caller kills it)."""
        import trio

        start = trio.current_time()
        self.popen.send_signal(sig)
        with trio.fail_after(timeout):
            while self.popen.poll() is None:
                await trio.sleep(0.005)
        return trio.current_time() - start


class Procs:
    """One run's processes, by name, each in a session of its own; ``stop_all`` ends
    every one (the caller's ``finally``)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, Proc] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        core: int | None = None,
        nofile: int | None = None,
    ) -> Proc:
        proc = Proc(name, argv, self.workdir, env=env, session=True, core=core, nofile=nofile)
        self.procs[name] = proc.start()
        return proc

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    def log(self, name: str) -> str:
        proc = self.procs.get(name)
        return proc.log() if proc is not None else ""

    def wait_until(
        self, name: str, check: Callable[[], T | None], timeout: float, what: str = "readiness"
    ) -> T:
        return self.procs[name].wait_until(check, what, timeout)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.stop()

    def stop_all(self) -> None:
        """SIGTERM to every one at once, then each waited for (SIGKILL after its grace)."""
        for proc in self.procs.values():
            if proc.running():
                proc.signal_group(signal.SIGTERM)
        for name in list(self.procs):
            self.procs.pop(name).stop(None)

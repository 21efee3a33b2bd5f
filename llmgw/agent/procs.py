"""Engine processes as /proc sees them: identity, process groups, port holders.

The agent starts engines in process groups of their own
(``start_new_session=True``) with their output going to a log file, so they
outlive an agent restart. A restarted agent must *adopt* them, and for that it
must be sure that the process it finds is the one it started.

The identity rule
-----------------
A process is the engine recorded in the state dir when **all three** match:

- the **pid** exists and is not a zombie;
- its **start time** (field 22 of ``/proc/<pid>/stat``, clock ticks since
  boot) equals the recorded one. Pids are recycled: after an engine dies,
  its pid may be handed to any other process, and a pid alone would let the
  agent adopt (and later signal) a stranger. Two processes cannot hold the
  same pid at the same tick, so pid + start time names one process for the
  lifetime of the boot;
- its **command line** (``/proc/<pid>/cmdline``) equals the recorded one. This
  is a second guard, for a state dir carried over a reboot (start times
  restart from zero) or written by mistake: an agent must never adopt, and
  so never kill or route traffic to, a process that is not running the engine
  it believes it is.

Recording an identity: the start time is fixed at fork, but the command line
is only there once exec has laid out the new image. ``Popen`` (and
``trio.lowlevel.open_process``) return as soon as exec passed its point of no
return, and for a short moment after that ``/proc/<pid>/cmdline`` reads empty
(``identity`` then reports ``cmdline=()``). Record the argv the engine was
started with, together with the start time ``identity`` reads, or poll
``identity`` until its command line is the argv; never record the first read.
An engine that execs again (a wrapper script) changes its command line
under the same pid and start time: record the final argv.

Processes that hold an engine port (or a GPU, found elsewhere) but match no
recorded identity are unidentified engines: the agent kills them, because
placement would otherwise hand their port or GPUs to a new engine.

Reading /proc races with processes coming and going. Every read here
tolerates the process vanishing, or turning unreadable, mid-scan
(``FileNotFoundError``, ``ProcessLookupError``, ``PermissionError``): such a
process is skipped, or reported as gone. Scans of all processes skip
non-numeric entries and read a handful of small files per process.

Zombies count as gone. A child of ours that was killed stays a zombie until
its parent reaps it: the supervisor reaps its own children (``Popen.wait`` /
``trio.Process.wait``). For an adopted engine, which is not our child, the
zombie state means it is dead and its parent (init or a subreaper) will reap
it; nothing is left for us to do but read how it ended, from its stat while it
is a zombie (``zombie_exit``) or from its pidfd once reaped (``reaped_exit``).

Limits: ``net/tcp`` shows the sockets of the reader's network namespace only,
and ``/proc/<pid>/fd`` of another user's process is readable only by that user
or root; the agent runs as root or as the user its engines run as. Every
function takes ``proc_root`` so tests can point it at a fixture tree; the
signalling helper still signals real processes.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import trio

from llmgw.protocol.exits import exit_fields, exit_words

PROC = Path("/proc")

#: Errors that mean "the process went away or is not ours to read": skip it.
_GONE: tuple[type[OSError], ...] = (FileNotFoundError, ProcessLookupError, PermissionError)

#: States a process is in once it has exited (zombie, dead).
_DEAD_STATES = frozenset({"Z", "X", "x"})

#: ``st`` column value of a listening TCP socket in ``/proc/net/tcp{,6}``.
_TCP_LISTEN = "0A"

_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")

#: How long ``terminate_group`` waits after SIGKILL before giving up.
KILL_WAIT = 5.0


@attrs.frozen
class ProcessIdentity:
    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat: clock ticks since boot
    cmdline: tuple[str, ...]
    pgid: int  # field 5
    state: str  # field 3: 'R', 'S', 'D', 'Z', ...


@attrs.frozen
class StatFields:
    """The fields of ``/proc/<pid>/stat`` this module uses."""

    pid: int
    comm: str
    state: str
    pgid: int
    start_time: int


def parse_stat(text: str) -> StatFields | None:
    """Parse one ``/proc/<pid>/stat`` line; None when it is not one.

    ``comm`` (field 2) is the process name in parentheses and may itself hold
    spaces and parentheses, so the line is split at the *last* ``)``; the
    fields after it are space-separated. Never raises.
    """
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        return None
    pid_text = text[:open_paren].strip()
    rest = text[close_paren + 1 :].split()
    # rest[0] is field 3 (state); field n is rest[n - 3].
    if len(rest) < 20 or not pid_text.isascii() or not pid_text.isdigit():
        return None
    state = rest[0]
    pgid_text, start_text = rest[2], rest[19]
    # isdigit() alone admits non-ASCII digits; int() must not see those.
    if len(state) != 1 or not state.isalpha() or not state.isascii():
        return None
    if not (pgid_text.isascii() and pgid_text.isdigit()):
        return None
    if not (start_text.isascii() and start_text.isdigit()):
        return None
    return StatFields(
        pid=int(pid_text),
        comm=text[open_paren + 1 : close_paren],
        state=state,
        pgid=int(pgid_text),
        start_time=int(start_text),
    )


def parse_cmdline(raw: bytes) -> tuple[str, ...]:
    """``/proc/<pid>/cmdline``: NUL-separated, NUL-terminated arguments.

    Decoded as the OS decodes argv (``os.fsdecode``), so it compares equal to
    the argv the agent recorded when it started the engine.
    """
    if not raw:
        return ()
    parts = raw.split(b"\0")
    if parts[-1] == b"":
        parts.pop()
    return tuple(os.fsdecode(p) for p in parts)


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/<pid>/environ``: NUL-separated ``NAME=value`` entries.

    An entry without ``=`` is skipped; decoded as the OS decodes the
    environment (``os.fsdecode``). Never raises.
    """
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env


def environ(pid: int, proc_root: Path = PROC) -> dict[str, str] | None:
    """The environment ``pid`` was started with; None when it is gone or not ours to read.

    This is the environment at exec: a process changing its own variables
    later does not change it, which is what makes it a tag.
    """
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:  # gone, not ours (another user's), or a kernel thread
        return None
    return parse_environ(raw)


def _read_stat(pid: int, proc_root: Path) -> StatFields | None:
    try:
        raw = (proc_root / str(pid) / "stat").read_bytes()
    except _GONE:
        return None
    return parse_stat(raw.decode("utf-8", "surrogateescape"))


def all_pids(proc_root: Path = PROC) -> list[int]:
    """Every pid there is now."""
    return _pids(proc_root)


def _pids(proc_root: Path) -> list[int]:
    """Every pid in ``proc_root``; other entries (self, net, sys, ...) are skipped."""
    try:
        names = os.listdir(proc_root)
    except _GONE:
        return []
    return [int(n) for n in names if n.isascii() and n.isdigit()]


def identity(pid: int, proc_root: Path = PROC) -> ProcessIdentity | None:
    """What /proc says about ``pid`` now; None when it is gone or unreadable.

    ``stat`` is read again after ``cmdline``: if the start time changed in
    between, the pid was recycled mid-read and the pair would describe two
    processes; the read is retried.
    """
    for _ in range(3):
        first = _read_stat(pid, proc_root)
        if first is None:
            return None
        try:
            raw_cmdline = (proc_root / str(pid) / "cmdline").read_bytes()
        except _GONE:
            return None
        second = _read_stat(pid, proc_root)
        if second is None:
            return None
        if second.start_time == first.start_time:
            return ProcessIdentity(
                pid=pid,
                start_time=second.start_time,
                cmdline=parse_cmdline(raw_cmdline),
                pgid=second.pgid,
                state=second.state,
            )
    return None


def is_same_process(recorded: ProcessIdentity, proc_root: Path = PROC) -> bool:
    """True when ``recorded.pid`` is alive and is the process recorded.

    Alive (not a zombie), same start time, same command line; the pgid and
    state of ``recorded`` are not compared (a state changes all the time).
    """
    now = identity(recorded.pid, proc_root)
    return (
        now is not None
        and now.state not in _DEAD_STATES
        and now.start_time == recorded.start_time
        and now.cmdline == recorded.cmdline
    )


def alive(pid: int, proc_root: Path = PROC) -> bool:
    """``pid`` exists and is not a zombie (a zombie has exited: it counts as gone)."""
    st = _read_stat(pid, proc_root)
    return st is not None and st.state not in _DEAD_STATES


def describe_exit(returncode: int) -> str:
    """How a process ended, in words: ``exited with code 1``, ``killed by signal 9 (SIGKILL)``.

    ``returncode`` as ``subprocess`` gives it: negative for a signal.
    """
    return exit_words(*exit_fields(returncode))


# PIDFD_GET_INFO (linux/pidfd.h): _IOWR(0xFF, 11, struct pidfd_info), here with
# the struct's first 64 bytes, which end with the exit status. The kernel keeps
# a process's exit status for the holders of its pidfd once it is reaped, by
# whomever (Linux 6.15 and later): the status of an engine that is not our child.
_PIDFD_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_EXIT_CODE_AT = 60  # __s32 exit_code, after mask, cgroupid and eleven __u32 ids


def reaped_exit(pidfd: int) -> int | None:
    """The returncode of the process behind ``pidfd`` once it has been reaped; None
    while it has not, or where the kernel does not keep it (before Linux 6.15)."""
    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf, True)
    except OSError:
        return None
    (mask,) = struct.unpack_from("=Q", buf, 0)
    if not mask & _PIDFD_INFO_EXIT:
        return None
    (status,) = struct.unpack_from("=i", buf, _PIDFD_EXIT_CODE_AT)
    return _returncode(status)


def zombie_exit(recorded: ProcessIdentity, proc_root: Path = PROC) -> int | None:
    """The returncode of ``recorded`` while it is a zombie nobody has reaped yet
    (field 52 of its stat, Linux 3.5 and later); None otherwise."""
    try:
        text = (proc_root / str(recorded.pid) / "stat").read_bytes().decode("ascii", "replace")
    except _GONE:
        return None
    st = parse_stat(text)
    rest = text[text.rfind(")") + 1 :].split()
    if st is None or st.start_time != recorded.start_time or st.state != "Z" or len(rest) < 50:
        return None
    status = rest[49]  # field 52: exit_code, as waitpid would give it
    return _returncode(int(status)) if status.isascii() and status.isdigit() else None


def _returncode(status: int) -> int | None:
    try:
        return os.waitstatus_to_exitcode(status)
    except ValueError:  # not an exit (a stopped process)
        return None


def group_members(pgid: int, proc_root: Path = PROC, *, include_zombies: bool = False) -> list[int]:
    """Every pid whose process group is ``pgid``, sorted.

    Zombies are left out unless ``include_zombies``: they have exited, and a
    group whose members are all zombies has nothing left to signal.
    """
    members = []
    for pid in _pids(proc_root):
        st = _read_stat(pid, proc_root)
        if st is None or st.pgid != pgid:
            continue
        if not include_zombies and st.state in _DEAD_STATES:
            continue
        members.append(pid)
    return sorted(members)


def parse_net_tcp(text: str) -> dict[int, set[int]]:
    """Listening sockets of one ``/proc/net/tcp`` or ``tcp6`` table: port -> inodes.

    Columns: ``sl local_address rem_address st ... inode``; the local address
    is ``HEXADDR:HEXPORT`` and ``st`` 0A is LISTEN. Malformed lines are skipped.
    """
    ports: dict[int, set[int]] = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3].upper() != _TCP_LISTEN:
            continue
        _, sep, port_hex = cols[1].rpartition(":")
        try:
            port = int(port_hex, 16)
            inode = int(cols[9])
        except ValueError:
            continue
        if not sep or inode == 0:
            continue
        ports.setdefault(port, set()).add(inode)
    return ports


def listening_ports(proc_root: Path = PROC) -> dict[int, set[int]]:
    """TCP port -> inodes of the sockets listening on it, IPv4 and IPv6.

    A missing table (IPv6 disabled) is skipped. A port can have several
    inodes: v4 and v6 sockets, or ``SO_REUSEPORT``.
    """
    ports: dict[int, set[int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            text = (proc_root / "net" / table).read_text()
        except _GONE:
            continue
        for port, inodes in parse_net_tcp(text).items():
            ports.setdefault(port, set()).update(inodes)
    return ports


def socket_owners(inodes: set[int], proc_root: Path = PROC) -> dict[int, set[int]]:
    """Socket inode -> pids holding a descriptor to it (only inodes that were found).

    Scans ``/proc/<pid>/fd/*`` of every process for ``socket:[N]`` links;
    processes that vanish or that we may not read are skipped. A socket is
    shared by every process that inherited it, so an inode may have several
    owners.
    """
    owners: dict[int, set[int]] = {}
    if not inodes:
        return owners
    for pid in _pids(proc_root):
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue  # closed meanwhile, unreadable, or not a link
            m = _SOCKET_LINK.fullmatch(target)
            if m is None:
                continue
            inode = int(m.group(1))
            if inode in inodes:
                owners.setdefault(inode, set()).add(pid)
    return owners


def port_holders(ports: Iterable[int], proc_root: Path = PROC) -> dict[int, set[int]]:
    """Port -> pids listening on it, for those of ``ports`` that someone listens on.

    A port nobody listens on is absent. A port that is listened on by a
    process we cannot see (another user's, read without root) maps to an
    empty set: the port is taken even though no pid can be named.
    """
    wanted = set(ports)
    listening = {p: inodes for p, inodes in listening_ports(proc_root).items() if p in wanted}
    all_inodes = set().union(*listening.values()) if listening else set()
    owners = socket_owners(all_inodes, proc_root)
    holders: dict[int, set[int]] = {}
    for port, inodes in listening.items():
        pids: set[int] = set()
        for inode in inodes:
            pids |= owners.get(inode, set())
        holders[port] = pids
    return holders


def _check_pgid(pgid: int) -> None:
    if pgid <= 1:
        raise ValueError(f"refusing to signal process group {pgid}")
    if pgid == os.getpgrp():
        raise ValueError(f"refusing to signal our own process group {pgid}")


def _killpg(pgid: int, sig: signal.Signals) -> bool:
    """Signal the group; False when it no longer exists."""
    _check_pgid(pgid)
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


async def terminate_group(
    pgid: int,
    *,
    grace: float,
    poll: float = 0.05,
    proc_root: Path = PROC,
    on_sigkill: Callable[[Sequence[int]], None] | None = None,
) -> bool:
    """SIGTERM process group ``pgid``, SIGKILL it after ``grace`` s; True once it is empty.

    ``on_sigkill`` hears the members still there when the grace is over, just
    before the SIGKILL: the caller logs and reports that kill.

    "Empty" means no member is left but zombies (see the module docstring:
    the supervisor reaps its own children). Gives up ``KILL_WAIT`` s after
    the SIGKILL and returns False: a process in uninterruptible sleep (state
    D, e.g. stuck on a dead GPU driver or NFS) can outlive SIGKILL.

    Raises ``ValueError`` for pgid 0, 1 (or below) and for our own process
    group: a safety net against signalling the agent itself or init. The
    caller must have established that ``pgid`` still names the engine's
    group (``is_same_process`` on its leader, or the members it found).
    """
    _check_pgid(pgid)
    if not _killpg(pgid, signal.SIGTERM):
        return True
    if await _wait_empty(pgid, grace, poll, proc_root):
        return True
    if on_sigkill is not None:
        left = group_members(pgid, proc_root)
        if not left:
            return True
        on_sigkill(left)
    if not _killpg(pgid, signal.SIGKILL):
        return True
    return await _wait_empty(pgid, KILL_WAIT, poll, proc_root)


async def _wait_empty(pgid: int, seconds: float, poll: float, proc_root: Path) -> bool:
    deadline = trio.current_time() + seconds
    while True:
        if not group_members(pgid, proc_root):
            return True
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            return False
        await trio.sleep(min(poll, remaining))

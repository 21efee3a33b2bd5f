"""Engine processes seen through /proc: identity, groups, port holders, termination.

Real processes on this machine for what the agent will meet (children in
sessions of their own, listeners on loopback, a child that ignores SIGTERM);
fixture /proc trees in tmp_path for the parsing edge cases a live system
will not produce on demand. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw.agent import procs
from llmgw.agent.procs import (
    ProcessIdentity,
    alive,
    group_members,
    identity,
    is_same_process,
    listening_ports,
    parse_cmdline,
    parse_net_tcp,
    parse_stat,
    port_holders,
    socket_owners,
    terminate_group,
)

DEADLINE = 10.0
SLEEP = "import time; time.sleep(30)"


# -- helpers -----------------------------------------------------------------


class Spawner:
    """Starts children in sessions of their own; kills whatever is left at teardown."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[str]] = []

    def __call__(self, code: str, *args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            start_new_session=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.children.append(p)
        return p

    def cleanup(self) -> None:
        for p in self.children:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the group: grandchildren too
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=5)
            finally:
                if p.stdout is not None:
                    p.stdout.close()


@pytest.fixture
def spawn() -> Iterator[Spawner]:
    s = Spawner()
    try:
        yield s
    finally:
        s.cleanup()


async def read_line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    with trio.fail_after(DEADLINE):
        line = await trio.to_thread.run_sync(p.stdout.readline, abandon_on_cancel=True)
    assert line, f"child {p.pid} exited early (rc={p.poll()})"
    return line.strip()


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    with trio.fail_after(DEADLINE):
        while not predicate():
            await trio.sleep(0.02)
    assert predicate(), what


async def settled(pid: int) -> ProcessIdentity:
    """The identity once exec is done.

    Popen returns as soon as exec passed its point of no return, before the
    kernel has laid out the new image's arguments: for that moment the child's
    cmdline reads empty (about one immediate read in fifteen here). The
    supervisor must not record an identity from /proc in that window either.
    """
    with trio.fail_after(DEADLINE):
        while True:
            ident = identity(pid)
            assert ident is not None, f"{pid} is gone"
            if ident.cmdline:
                return ident
            await trio.sleep(0.005)


def stat_text(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text()


def stat_line(pid: int, comm: str, *, state: str = "S", pgid: int = 100, start: int = 4242) -> str:
    """A /proc/<pid>/stat line in the kernel's layout (fields 1..44)."""
    after = [state, "1", str(pgid), str(pgid), "0", "-1", "4194304"] + ["0"] * 8
    after += ["20", "0", "1", "0", str(start), "3133440", "387"] + ["0"] * 22
    return f"{pid} ({comm}) " + " ".join(after) + "\n"


def fake_proc(
    root: Path,
    pid: int,
    comm: str = "engine",
    *,
    cmdline: bytes = b"engine\0--port\x0020001\0",
    state: str = "S",
    pgid: int = 100,
    start: int = 4242,
    sockets: tuple[int, ...] = (),
) -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_text(stat_line(pid, comm, state=state, pgid=pgid, start=start))
    (d / "cmdline").write_bytes(cmdline)
    for n, inode in enumerate(sockets, start=3):
        os.symlink(f"socket:[{inode}]", d / "fd" / str(n))
    os.symlink("/dev/null", d / "fd" / "0")


def net_row(sl: int, local: str, state: str, inode: int) -> str:
    return (
        f"{sl:4}: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000"
        f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


TCP_HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
    "   uid  timeout inode\n"
)


# -- identity ----------------------------------------------------------------


async def test_identity_of_a_real_child(spawn: Spawner) -> None:
    p = spawn(SLEEP)
    ident = await settled(p.pid)
    assert ident.pid == p.pid
    assert ident.cmdline == (sys.executable, "-c", SLEEP)
    assert ident.pgid == p.pid  # start_new_session: leader of its own group
    assert ident.state in ("R", "S")
    mine = identity(os.getpid())
    assert mine is not None and mine.pgid == os.getpgrp()
    assert ident.start_time >= mine.start_time > 0  # started after us
    again = identity(p.pid)
    assert again is not None and again.start_time == ident.start_time
    assert is_same_process(ident)
    assert alive(p.pid)

    p.kill()
    # Killed but not reaped: a zombie still has its /proc entry, and counts as gone.
    await wait_until(lambda: (i := identity(p.pid)) is not None and i.state == "Z", "zombie")
    assert not alive(p.pid)
    assert not is_same_process(ident)
    assert group_members(p.pid) == []
    assert group_members(p.pid, include_zombies=True) == [p.pid]

    p.wait(timeout=5)
    assert identity(p.pid) is None
    assert not is_same_process(ident)
    assert not alive(p.pid)


async def test_a_recycled_pid_or_another_command_is_not_the_same_process(
    spawn: Spawner,
) -> None:
    p = spawn(SLEEP)
    ident = await settled(p.pid)
    assert is_same_process(ident)
    # The pid reused by another process: same pid, other start time.
    assert not is_same_process(attrs.evolve(ident, start_time=ident.start_time + 1))
    assert not is_same_process(attrs.evolve(ident, start_time=ident.start_time - 1))
    # Same pid and start time but another command line (a state dir gone stale).
    assert not is_same_process(attrs.evolve(ident, cmdline=(sys.executable, "-c", "pass")))
    assert not is_same_process(attrs.evolve(ident, cmdline=ident.cmdline[:-1]))
    # pgid and state are not part of the identity.
    assert is_same_process(attrs.evolve(ident, pgid=ident.pgid + 1, state="R"))


def test_identity_of_a_pid_that_never_existed(tmp_path: Path) -> None:
    fake_proc(tmp_path, 200)
    assert identity(201, tmp_path) is None
    assert not alive(201, tmp_path)
    recorded = ProcessIdentity(pid=201, start_time=4242, cmdline=("engine",), pgid=100, state="S")
    assert not is_same_process(recorded, tmp_path)


def test_comm_with_spaces_and_parentheses_in_a_fixture_tree(tmp_path: Path) -> None:
    fake_proc(tmp_path, 321, "my (weird) proc", state="S", pgid=300, start=987654)
    ident = identity(321, tmp_path)
    assert ident == ProcessIdentity(
        pid=321,
        start_time=987654,
        cmdline=("engine", "--port", "20001"),
        pgid=300,
        state="S",
    )
    assert is_same_process(ident, tmp_path)
    st_ = parse_stat((tmp_path / "321" / "stat").read_text())
    assert st_ is not None and st_.comm == "my (weird) proc"
    # A comm that looks like more fields must not shift them.
    fake_proc(tmp_path, 322, ") Z 1 2 3 ) S", state="R", pgid=301, start=5)
    assert identity(322, tmp_path) == attrs.evolve(
        ident, pid=322, start_time=5, pgid=301, state="R"
    )


def test_zombie_in_a_fixture_tree_is_not_alive(tmp_path: Path) -> None:
    fake_proc(tmp_path, 400, state="Z")
    ident = identity(400, tmp_path)
    assert ident is not None and ident.state == "Z"
    assert not alive(400, tmp_path)
    # Same pid, start time and command line, but it has exited.
    assert not is_same_process(attrs.evolve(ident, state="S"), tmp_path)
    fake_proc(tmp_path, 401, state="X")
    assert not alive(401, tmp_path)


def test_unparseable_stat_reads_as_gone(tmp_path: Path) -> None:
    (tmp_path / "500").mkdir()
    (tmp_path / "500" / "stat").write_text("500 (truncated")
    (tmp_path / "500" / "cmdline").write_bytes(b"x\0")
    assert identity(500, tmp_path) is None
    assert not alive(500, tmp_path)
    (tmp_path / "501").mkdir()  # vanished between listdir and read
    assert identity(501, tmp_path) is None


def test_identity_retries_when_the_pid_is_recycled_mid_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stat, cmdline, stat again: a changed start time means cmdline may be another's."""
    fake_proc(tmp_path, 600, cmdline=b"new\0", start=2)
    old = procs.StatFields(pid=600, comm="old", state="S", pgid=100, start_time=1)
    new = procs.StatFields(pid=600, comm="new", state="S", pgid=100, start_time=2)
    reads = [old, new, new, new]
    monkeypatch.setattr(procs, "_read_stat", lambda pid, root: reads.pop(0))
    ident = identity(600, tmp_path)
    assert reads == []
    assert ident is not None and (ident.start_time, ident.cmdline) == (2, ("new",))
    reads[:] = [old, new] * 3  # never settles
    assert identity(600, tmp_path) is None


async def test_real_comm_with_a_space_and_parentheses(spawn: Spawner) -> None:
    code = (
        "import ctypes, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "rc = libc.prctl(15, b'eng (x) 1', 0, 0, 0)\n"  # PR_SET_NAME
        "print(rc, flush=True)\n"
        "time.sleep(30)\n"
    )
    p = spawn(code)
    if await read_line(p) != "0":
        pytest.skip("prctl(PR_SET_NAME) unavailable")
    parsed = parse_stat(stat_text(p.pid))
    assert parsed is not None and parsed.comm == "eng (x) 1"
    ident = identity(p.pid)
    assert ident is not None
    assert ident.pgid == p.pid and ident.state in ("R", "S")
    assert ident.cmdline == (sys.executable, "-c", code)
    assert is_same_process(ident)


def test_parse_stat_of_our_own_process() -> None:
    parsed = parse_stat(Path("/proc/self/stat").read_text())
    assert parsed is not None
    assert parsed.pid == os.getpid()
    assert parsed.pgid == os.getpgrp()
    assert parsed.state == "R"


def test_parse_cmdline() -> None:
    assert parse_cmdline(b"") == ()
    assert parse_cmdline(b"a\0") == ("a",)
    assert parse_cmdline(b"a\0\0b\0") == ("a", "", "b")  # an empty argument survives
    assert parse_cmdline(b"no-terminator") == ("no-terminator",)  # rewritten argv
    assert parse_cmdline(b"caf\xe9\0") == (os.fsdecode(b"caf\xe9"),)


STAT_FIELD = st.one_of(st.integers(min_value=-5, max_value=10**20).map(str), st.text(max_size=3))
STAT_LIKE = st.builds(
    lambda pid, comm, fields: f"{pid} ({comm}) " + " ".join(fields),
    st.integers(min_value=0, max_value=99999),
    st.text(),
    st.lists(STAT_FIELD, max_size=25),
)


@given(st.one_of(st.text(), STAT_LIKE))
@example(stat_line(1, "x", start=4242).replace(" 4242 ", " \u00b2 "))  # isdigit, not int()
@example(stat_line(1, "x", pgid=7).replace(" 7 ", " \u0661 "))  # an Arabic-Indic one
def test_parse_stat_never_raises(text: str) -> None:
    """Arbitrary text, and stat-shaped lines that are truncated or carry junk fields."""
    parsed = parse_stat(text)
    assert parsed is None or (parsed.pid >= 0 and parsed.start_time >= 0)


@given(
    pid=st.integers(min_value=1, max_value=2**22),
    comm=st.text(),
    state=st.sampled_from("RSDZTtXI"),
    pgid=st.integers(min_value=0, max_value=2**22),
    start=st.integers(min_value=0, max_value=2**63),
)
def test_parse_stat_round_trips_any_comm(
    pid: int, comm: str, state: str, pgid: int, start: int
) -> None:
    parsed = parse_stat(stat_line(pid, comm, state=state, pgid=pgid, start=start))
    assert parsed is not None
    assert (parsed.pid, parsed.comm, parsed.state, parsed.pgid, parsed.start_time) == (
        pid,
        comm,
        state,
        pgid,
        start,
    )


@given(st.text())
def test_parse_net_tcp_never_raises(text: str) -> None:
    for port, inodes in parse_net_tcp(text).items():
        assert port >= 0 and inodes


# -- groups ------------------------------------------------------------------


def test_group_members_in_a_fixture_tree(tmp_path: Path) -> None:
    fake_proc(tmp_path, 10, pgid=10)
    fake_proc(tmp_path, 11, pgid=10)
    fake_proc(tmp_path, 12, pgid=10, state="Z")
    fake_proc(tmp_path, 13, pgid=99)
    (tmp_path / "self").mkdir()  # non-numeric entries are not processes
    (tmp_path / "net").mkdir()
    (tmp_path / "14").mkdir()  # vanished: no stat
    assert group_members(10, tmp_path) == [10, 11]
    assert group_members(10, tmp_path, include_zombies=True) == [10, 11, 12]
    assert group_members(99, tmp_path) == [13]
    assert group_members(7, tmp_path) == []


async def test_group_members_of_a_real_group(spawn: Spawner) -> None:
    p = spawn(
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    grandchild = int(await read_line(p))
    assert group_members(p.pid) == sorted([p.pid, grandchild])
    assert os.getpid() not in group_members(p.pid)


# -- ports -------------------------------------------------------------------


LISTENER = """
import socket, sys, time
host = sys.argv[1]
s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET)
s.bind((host, 0))
s.listen()
print(s.getsockname()[1], flush=True)
conns = []
while True:
    conns.append(s.accept()[0])
"""


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return Path("/proc/net/tcp6").exists()


def raw_states(port: int) -> set[str]:
    """The st column of every socket whose local port is ``port``, v4 and v6."""
    states = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rpartition(":")[2], 16) == port:
                states.add(cols[3])
    return states


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        pytest.param(
            "::1",
            marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback"),
        ),
    ],
)
async def test_port_holders_of_a_real_listener(spawn: Spawner, host: str) -> None:
    p = spawn(LISTENER, host)
    port = int(await read_line(p))
    assert port in listening_ports()
    assert port_holders([port]) == {port: {p.pid}}
    inodes = listening_ports()[port]
    assert socket_owners(inodes) == {i: {p.pid} for i in inodes}

    # A connected socket is not a listener: our end holds a local port too.
    with trio.fail_after(DEADLINE):
        stream = await trio.open_tcp_stream(host, port)
    async with stream:
        client_port = stream.socket.getsockname()[1]
        await wait_until(lambda: "01" in raw_states(client_port), "established")
        assert port_holders([client_port]) == {}
        assert client_port not in listening_ports()
        # The child's accepted end shares the listening port but is not counted twice.
        assert port_holders([port]) == {port: {p.pid}}


def test_a_port_nobody_listens_on_has_no_holders() -> None:
    # Bound but not listening, and held by us so nobody else can take it meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_holders([port]) == {}
        assert port_holders([]) == {}


async def test_a_shared_listening_socket_has_every_holder(spawn: Spawner) -> None:
    p = spawn(
        "import os, socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "port = s.getsockname()[1]\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(30); os._exit(0)\n"
        "print(port, pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    port_text, forked_text = (await read_line(p)).split()
    port, forked = int(port_text), int(forked_text)
    assert port_holders([port, 1]) == {port: {p.pid, forked}}


def test_listening_ports_from_a_fixture_tree(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        TCP_HEADER
        + net_row(0, "0100007F:4E20", "0A", 1001)  # 127.0.0.1:20000 LISTEN
        + net_row(1, "0100007F:4E21", "01", 1002)  # 20001 ESTABLISHED: not a listener
        + net_row(2, "00000000:4E22", "0A", 0)  # inode 0: nobody's (TIME_WAIT-like)
        + "garbage line\n"
    )
    (net / "tcp6").write_text(
        TCP_HEADER
        + net_row(0, "00000000000000000000000001000000:4E20", "0A", 1003)
        + net_row(1, "00000000000000000000000000000000:52AB", "0A", 1004)
    )
    assert listening_ports(tmp_path) == {20000: {1001, 1003}, 0x52AB: {1004}}

    fake_proc(tmp_path, 10, sockets=(1001, 9999))
    fake_proc(tmp_path, 11, sockets=(1003,))
    fake_proc(tmp_path, 12, sockets=(1002,))
    (tmp_path / "13").mkdir()  # no fd dir: vanished or unreadable
    (tmp_path / "self").mkdir()
    assert socket_owners({1001, 1003, 1004}, tmp_path) == {1001: {10}, 1003: {11}}
    assert socket_owners(set(), tmp_path) == {}
    # 20001 is only established; 0x52AB listens but its owner cannot be seen.
    assert port_holders([20000, 20001, 0x52AB, 20999], tmp_path) == {
        20000: {10, 11},
        0x52AB: set(),
    }


def test_no_ipv6_table_is_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP_HEADER + net_row(0, "0100007F:4E20", "0A", 7))
    assert listening_ports(tmp_path) == {20000: {7}}
    assert listening_ports(tmp_path / "missing") == {}


# -- terminate_group -----------------------------------------------------------


async def test_terminate_group_kills_child_and_grandchild(spawn: Spawner) -> None:
    p = spawn(
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    grandchild = int(await read_line(p))
    assert alive(grandchild) and identity(grandchild) is not None
    began = time.monotonic()
    with trio.fail_after(DEADLINE):
        assert await terminate_group(p.pid, grace=5)
    assert time.monotonic() - began < 4  # both obeyed SIGTERM; no wait for the grace
    assert group_members(p.pid) == []
    assert not alive(p.pid)  # our zombie until reaped
    g = identity(grandchild)
    assert g is None or g.state == "Z"  # reparented; reaped by whoever adopted it
    assert p.wait(timeout=5) == -signal.SIGTERM
    assert identity(p.pid) is None


async def test_terminate_group_sigkills_a_child_that_ignores_sigterm(spawn: Spawner) -> None:
    p = spawn(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    assert await read_line(p) == "ready"
    grace = 1.0
    began = time.monotonic()
    with trio.fail_after(DEADLINE):
        assert await terminate_group(p.pid, grace=grace)
    took = time.monotonic() - began
    assert grace <= took < grace + 2
    assert p.wait(timeout=5) == -signal.SIGKILL


async def test_terminate_group_gives_up_when_members_remain(
    spawn: Spawner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that survives SIGKILL (state D) is reported, after a bounded wait."""
    p = spawn(SLEEP)
    fake_proc(tmp_path, p.pid, pgid=p.pid, state="D")  # /proc that never lets it go
    monkeypatch.setattr(procs, "KILL_WAIT", 0.3)
    began = time.monotonic()
    with trio.fail_after(DEADLINE):
        assert not await terminate_group(p.pid, grace=0.2, proc_root=tmp_path)
    assert 0.5 <= time.monotonic() - began < 2.5
    assert p.wait(timeout=5) == -signal.SIGTERM  # the real process was signalled


async def test_terminate_group_of_a_group_that_is_gone(spawn: Spawner) -> None:
    p = spawn(SLEEP)
    p.kill()
    p.wait(timeout=5)
    with trio.fail_after(DEADLINE):
        assert await terminate_group(p.pid, grace=1)


@pytest.fixture
def killpg_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record os.killpg instead of signalling: a regression must not hit init or pytest."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: calls.append((pgid, sig)))
    return calls


@pytest.mark.parametrize("pgid", [0, 1, -1, -4242])
async def test_terminate_group_refuses_init_and_all(
    pgid: int, killpg_calls: list[tuple[int, int]]
) -> None:
    with pytest.raises(ValueError, match="refusing"):
        await terminate_group(pgid, grace=0.1)
    assert killpg_calls == []


async def test_terminate_group_refuses_our_own_group(killpg_calls: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match="our own"):
        await terminate_group(os.getpgrp(), grace=0.1)
    assert killpg_calls == []

"""The lab's wire (``tools/support/labwire.py``): real latency and loss on a node's link
without sch_netem. Two network namespaces of the test's own on a bridge of its own
(no fleet); the wire goes on one of them. Root only; fails, never skips."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.support.labwire import (
    WireError,
    get_offloads,
    impair,
    ns_socket,
    restore,
    restore_all,
    set_offloads,
    tap_name,
)

DELAY_MS = 100  # each way: the round trip grows by 200 ms
SO_RCVBUFFORCE = 33


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out or "0"


def _ip(*argv: str, check: bool = True) -> None:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {r.stderr.strip()}")


class Bench:
    """Nodes a and b (namespaces, veths, addresses 10.213.77.10/.11) on a bridge, shaped
    as the lab's record is; everything made is recorded first and removed by close."""

    def __init__(self, tag: str) -> None:
        self.prefix = f"lw{tag}"  # links: lwTAG-br, lwTAG-na, lwTAG-wa: at most 15 chars
        self.state: dict[str, Any] = {"bridge": self.prefix + "-br", "nodes": {}}
        self.links: list[str] = []
        self.namespaces: list[str] = []

    def record(self, kind: str, name: str) -> None:
        assert kind == "links"
        self.links.append(name)

    def build(self) -> None:
        bridge = self.state["bridge"]
        self.record("links", bridge)
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i, node in enumerate(("a", "b")):
            ns = veth = f"{self.prefix}-n{node}"
            self.namespaces.append(ns)
            _ip("netns", "add", ns)
            self.record("links", veth)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            ip = f"10.213.77.{10 + i}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.state["nodes"][node] = {"ns": ns, "veth": veth, "ip": ip}

    def close(self) -> list[str]:
        """Remove everything; what could not be removed."""
        pids = [int(w["pid"]) for w in self.state.get("wires", {}).values()]
        with contextlib.suppress(Exception):
            restore_all(self.state)
        for pid in pids:  # a wire restore could not stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        for link in self.links:
            if Path(f"/sys/class/net/{link}").exists():
                _ip("link", "del", link, check=False)
        left = [ns for ns in self.namespaces if Path(f"/run/netns/{ns}").exists()]
        left += [lk for lk in self.links if Path(f"/sys/class/net/{lk}").exists()]
        left += [str(p) for p in pids if _running(p)]
        return left

    def ip(self, node: str) -> str:
        return str(self.state["nodes"][node]["ip"])

    def ns(self, node: str) -> str:
        return str(self.state["nodes"][node]["ns"])


def _running(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def bench(tag: str) -> Iterator[Bench]:
    if os.geteuid() != 0:
        pytest.fail("the wire's tests need root (namespaces, a bridge, a TAP): run as root")
    b = Bench(tag)
    try:
        b.build()
        yield b
    finally:
        left = b.close()
        assert not left, f"left behind: {left}"


@pytest.fixture(scope="module")
def lab() -> Iterator[Bench]:
    with bench(_base36(os.getpid())[-5:]) as b:
        yield b


@pytest.fixture
def wired(lab: Bench) -> Iterator[Bench]:
    """Whatever a test put on the link comes off after it."""
    try:
        yield lab
    finally:
        restore_all(lab.state)


# -- measuring ---------------------------------------------------------------------


def _tcp_server(lab: Bench, node: str) -> tuple[socket.socket, int]:
    srv = ns_socket(lab.ns(node), socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((lab.ip(node), 0))
    srv.listen(4)
    srv.settimeout(15)
    return srv, srv.getsockname()[1]


def rtt(lab: Bench, rounds: int = 5) -> float:
    """The median round trip of a 1-byte echo over TCP from a to b, in seconds."""
    srv, port = _tcp_server(lab, "b")

    def echo() -> None:
        with contextlib.suppress(OSError), srv, srv.accept()[0] as c:
            c.settimeout(15)
            while data := c.recv(64):
                c.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    with ns_socket(lab.ns("a"), socket.AF_INET, socket.SOCK_STREAM) as c:
        c.settimeout(10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.connect((lab.ip("b"), port))
        times = []
        for _ in range(rounds):
            start = time.monotonic()
            c.sendall(b"x")
            assert c.recv(64) == b"x"
            times.append(time.monotonic() - start)
    t.join(10)
    return sorted(times)[len(times) // 2]


def transfer(lab: Bench, size: int) -> tuple[bool, float, int]:
    """Send SIZE random bytes over TCP from a to b: (intact, MB/s, segments the sender
    retransmitted)."""
    payload = os.urandom(size)
    srv, port = _tcp_server(lab, "b")
    got: list[bytes] = []

    def sink() -> None:
        h = hashlib.sha256()
        with contextlib.suppress(OSError), srv, srv.accept()[0] as c:
            c.settimeout(20)
            while data := c.recv(1 << 16):
                h.update(data)
        got.append(h.digest())

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    with ns_socket(lab.ns("a"), socket.AF_INET, socket.SOCK_STREAM) as c:
        c.settimeout(20)
        c.connect((lab.ip("b"), port))
        start = time.monotonic()
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        t.join(25)
        took = time.monotonic() - start
        info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        retrans: int = struct.unpack_from("I", info, 100)[0]  # tcpi_total_retrans
    return got == [hashlib.sha256(payload).digest()], size / took / 1e6, retrans


def one_way_loss(lab: Bench, src: str, dst: str, count: int = 1000) -> float:
    """The fraction of COUNT UDP datagrams from SRC that DST did not get."""
    rx = ns_socket(lab.ns(dst), socket.AF_INET, socket.SOCK_DGRAM)
    tx = ns_socket(lab.ns(src), socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        rx.bind((lab.ip(dst), 0))
        seen: set[int] = set()
        stop = threading.Event()

        def receive() -> None:
            rx.settimeout(0.1)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    seen.add(int(rx.recv(64)))

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while -1 not in seen:  # the neighbours known (ARP crosses the lossy wire too)
            assert time.monotonic() < deadline, "nothing crossed the wire in 10 s"
            tx.sendto(b"-1", rx.getsockname())
            time.sleep(0.05)
        time.sleep(2 * DELAY_MS / 1000 + 0.1)
        seen.clear()
        for i in range(count):
            tx.sendto(b"%d" % i, rx.getsockname())
            if i % 50 == 49:
                time.sleep(0.005)  # not a burst beyond any queue
        time.sleep(2 * DELAY_MS / 1000 + 0.5)
        stop.set()
        t.join(5)
    return 1 - len(seen - {-1}) / count


# -- the tests ---------------------------------------------------------------------


def test_the_link_is_fast_without_the_wire(wired: Bench) -> None:
    """The measure tells: without the wire, the round trip is far below the delay."""
    assert rtt(wired) < 0.05


def test_the_round_trip_grows_by_twice_the_delay(wired: Bench) -> None:
    impair(wired.state, "a", DELAY_MS, 0.0, wired.record)
    measured = rtt(wired)
    assert 2 * DELAY_MS / 1000 <= measured < 1.0, measured


def test_a_bulk_transfer_arrives_intact_across_the_delay(wired: Bench) -> None:
    impair(wired.state, "a", DELAY_MS, 0.0, wired.record)
    intact, mb_s, _ = transfer(wired, 4 << 20)
    assert intact
    assert mb_s > 1, f"{mb_s:.1f} MB/s"


def test_offloaded_frames_cross_intact(wired: Bench) -> None:
    """With the node's offloads back on (a wire that could not turn them off), frames
    with checksums left to offload and GSO super-frames still cross, whole."""
    impair(wired.state, "a", 0, 0.0, wired.record)
    set_offloads(wired.ns("a"), "eth0", {"tx-checksum": 1, "tso": 1, "gso": 1})
    intact, _, _ = transfer(wired, 8 << 20)
    assert intact


def test_loss_is_real_loss_each_way(wired: Bench) -> None:
    impair(wired.state, "a", DELAY_MS, 0.05, wired.record, seed=7)
    from_a, to_a = one_way_loss(wired, "a", "b"), one_way_loss(wired, "b", "a")
    assert 0.02 <= from_a <= 0.10, from_a
    assert 0.02 <= to_a <= 0.10, to_a


def test_tcp_retransmits_through_loss_and_the_data_arrives_intact(wired: Bench) -> None:
    impair(wired.state, "a", 2, 0.05, wired.record, seed=7)
    intact, _, retransmitted = transfer(wired, 1 << 20)
    assert intact
    assert retransmitted > 0


def test_restore_gives_the_link_back(wired: Bench) -> None:
    veth, bridge = wired.state["nodes"]["a"]["veth"], wired.state["bridge"]
    before = get_offloads(wired.ns("a"), "eth0")
    pid = impair(wired.state, "a", DELAY_MS, 0.0, wired.record)
    assert get_offloads(wired.ns("a"), "eth0") == {"tx-checksum": 0, "tso": 0, "gso": 0}
    tap = tap_name(veth)
    assert Path(f"/sys/class/net/{tap}/master").resolve().name == bridge
    assert not Path(f"/sys/class/net/{veth}/master").exists()
    assert tap in wired.links  # recorded for the lab's `down`
    restore(wired.state, "a")
    assert not _running(pid)
    assert not Path(f"/sys/class/net/{tap}").exists()
    assert Path(f"/sys/class/net/{veth}/master").resolve().name == bridge
    assert "a" not in wired.state["wires"]
    assert get_offloads(wired.ns("a"), "eth0") == before
    assert rtt(wired) < 0.05


def test_the_wire_ends_on_sigterm_within_a_second_and_gives_the_link_back(
    wired: Bench,
) -> None:
    veth, bridge = wired.state["nodes"]["a"]["veth"], wired.state["bridge"]
    pid = impair(wired.state, "a", DELAY_MS, 0.0, wired.record)
    start = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while _running(pid) and time.monotonic() - start < 3:
        time.sleep(0.01)
    assert time.monotonic() - start < 1
    assert Path(f"/sys/class/net/{veth}/master").resolve().name == bridge
    assert not Path(f"/sys/class/net/{tap_name(veth)}").exists()


def test_the_wire_outlasts_its_link_going_down_and_up(wired: Bench) -> None:
    """A partition (the veth down) under the wire: the wire stays and carries again
    once the link is up; it does not bring the link up itself."""
    veth = wired.state["nodes"]["a"]["veth"]
    pid = impair(wired.state, "a", DELAY_MS, 0.0, wired.record)
    _ip("link", "set", veth, "down")
    try:
        time.sleep(0.3)
        assert _running(pid)
        assert "UP" not in Path(f"/sys/class/net/{veth}/operstate").read_text().upper()
    finally:
        _ip("link", "set", veth, "up")
    deadline = time.monotonic() + 5
    while "UP" not in Path(f"/sys/class/net/{veth}/operstate").read_text().upper():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert 2 * DELAY_MS / 1000 <= rtt(wired) < 1.0
    assert _running(pid)


def test_a_wire_that_cannot_start_says_why_and_leaves_nothing(wired: Bench) -> None:
    state = {**wired.state, "bridge": "lw-nobridge"}
    with pytest.raises(WireError, match="did not start"):
        impair(state, "a", DELAY_MS, 0.0, wired.record)
    veth = wired.state["nodes"]["a"]["veth"]
    assert not Path(f"/sys/class/net/{tap_name(veth)}").exists()
    assert Path(f"/sys/class/net/{veth}/master").resolve().name == wired.state["bridge"]


def test_teardown_removes_everything_even_on_failure() -> None:
    made: list[Bench] = []
    pids: list[int] = []

    def fail_with_the_wire_on() -> None:
        with bench(_base36(os.getpid() + 1)[-5:]) as b:
            made.append(b)
            pids.append(impair(b.state, "a", DELAY_MS, 0.05, b.record))
            raise RuntimeError("a test failed with the wire on")

    with pytest.raises(RuntimeError, match="a test failed"):
        fail_with_the_wire_on()
    (b,) = made
    assert pids and not _running(pids[0])
    assert not [ns for ns in b.namespaces if Path(f"/run/netns/{ns}").exists()]
    assert not [lk for lk in b.links if Path(f"/sys/class/net/{lk}").exists()]
    assert len(b.links) == 4  # the bridge, two veths and the wire's TAP

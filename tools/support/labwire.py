"""The lab's wire: real packet-level latency and loss on one node's link, in userspace.

Why: ``tools/lab netem`` uses ``tc ... netem``, and some kernels have no sch_netem
(nor tc classifiers or actions to build a substitute from). The wire does the same
job from a process: it sits in the node's link and carries every Ethernet frame
across, each one a configured time late, dropping a configured fraction at random,
independently each way, in order within each direction.

How: the node's host-side veth leaves the lab's bridge; a TAP device (same MAC as
the veth, so the bridge's own address does not change) joins the bridge in its
place; the wire reads frames from the veth with an AF_PACKET socket (ignoring what
is sent out of it) and writes them to the TAP, and reads the TAP and sends to the
veth. Both ends carry a virtio-net header (PACKET_VNET_HDR, IFF_VNET_HDR), so a
frame whose checksum is left to offload, or a GSO super-frame, crosses intact.
To make every frame one real packet (so loss hits single segments, as on a wire),
the wire turns off TX checksum offload, TSO and GSO on the node's ``eth0`` while it
runs, and puts them back when it stops. When it stops (SIGTERM, SIGINT) it puts
the veth back on the bridge and its TAP goes away with it; ``restore`` does the
same for a wire that was killed.

Limits: the delay is constant (no jitter, so no reordering) and the same for every
frame; loss is independent per frame (no bursts); at most ``--limit`` frames wait in
each direction (more are dropped, as netem's limit); throughput is that of one
Python process (tens of MB/s, plenty for the lab); ARP and every other frame is
delayed and dropped too, as on a real lossy link. Root only. The standard library (and ``procs``) only.

    python -m tools.support.labwire run --ns NS --veth VETH --bridge BR --tap TAP \\
        --delay-ms 100 --loss 0.05      # 100 ms each way: the round trip grows by 200 ms
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import json
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tools.support.procs import alive, python_path, started

CLONE_NEWNET = 0x40000000
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
SIOCETHTOOL = 0x8946
VNET_HDR_LEN = 10  # struct virtio_net_hdr, the default on both ends
# legacy ethtool get/set pairs: what the wire turns off on the node's eth0
OFFLOADS = {"tx-checksum": (0x16, 0x17), "tso": (0x1E, 0x1F), "gso": (0x23, 0x24)}
MAX_FRAME = VNET_HDR_LEN + 65536 + 64
DRAIN = 256  # frames read from one side before looking at the other


class WireError(Exception):
    """One line for the operator: what went wrong and what to do."""


# -- namespaces and devices ------------------------------------------------------


def ns_socket(ns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket in network namespace NS (``ip netns``): made in a thread that enters
    NS, so this process stays where it is; usable from any thread afterwards."""
    out: list[socket.socket] = []
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"setns into {ns}: {os.strerror(e)}")
            finally:
                os.close(fd)
            out.append(socket.socket(family, kind, proto))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=enter, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join(5)
    if errors:
        raise errors[0]
    if not out:
        raise WireError(f"could not enter network namespace {ns} within 5 s")
    return out[0]


def _ethtool(sock: socket.socket, dev: str, cmd: int, data: int = 0) -> int:
    value = ctypes.create_string_buffer(struct.pack("II", cmd, data), 8)
    ifreq = struct.pack("16sP", dev.encode(), ctypes.addressof(value))
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
    result: int = struct.unpack("II", value.raw)[1]
    return result


def get_offloads(ns: str, dev: str) -> dict[str, int]:
    with ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM) as s:
        return {name: _ethtool(s, dev, get) for name, (get, _) in OFFLOADS.items()}


def set_offloads(ns: str, dev: str, values: dict[str, int]) -> None:
    """Set NS's DEV offloads (in the order given: turning TX checksums on before TSO)."""
    with ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name, value in values.items():
            with contextlib.suppress(OSError):  # a device without it: nothing to undo
                _ethtool(s, dev, OFFLOADS[name][1], value)


def _ip(*argv: str, check: bool = True) -> None:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10)
    if check and r.returncode != 0:
        raise WireError(f"ip {' '.join(argv)} failed: {(r.stderr or r.stdout).strip()}")


def _exists(link: str) -> bool:
    return Path(f"/sys/class/net/{link}").exists()


def _open_tap(name: str) -> int:
    """A TAP device NAME (gone when this fd closes), carrying virtio-net headers and
    asking the kernel for whole, checksummed frames (no offloads towards us)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(
            fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        )
        fcntl.ioctl(fd, TUNSETOFFLOAD, 0)
        os.set_blocking(fd, False)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- the wire --------------------------------------------------------------------


class Direction:
    """One way across: frames in arrival order, each with the time it is due."""

    def __init__(self, name: str, delay_s: float, loss: float, limit: int, rng: random.Random):
        self.name, self.delay_s, self.loss, self.limit, self.rng = name, delay_s, loss, limit, rng
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.passed = self.lost = self.overflow = self.failed = 0

    def take(self, frame: bytes, now: float) -> None:
        if self.loss > 0 and self.rng.random() < self.loss:
            self.lost += 1
        elif len(self.queue) >= self.limit:
            self.overflow += 1
        else:
            self.queue.append((now + self.delay_s, frame))

    def due(self, now: float) -> Iterator[bytes]:
        while self.queue and self.queue[0][0] <= now:
            yield self.queue.popleft()[1]

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def stats(self) -> str:
        return (
            f"{self.name}: {self.passed} passed, {self.lost} lost, "
            f"{self.overflow} over the limit, {self.failed} not written"
        )


class Wire:
    """The wire on one node's link (see the module's docstring)."""

    def __init__(
        self,
        *,
        ns: str,
        veth: str,
        bridge: str,
        tap: str,
        delay_ms: float,
        loss: float,
        delay_back_ms: float | None = None,
        loss_back: float | None = None,
        limit: int = 10000,
        seed: int | None = None,
        dev: str = "eth0",
    ) -> None:
        for what, v in (("loss", loss), ("loss_back", loss_back)):
            if v is not None and not 0 <= v < 1:
                raise WireError(f"{what} {v}: a fraction, 0 <= loss < 1 (0.05 is 5 %)")
        for what, d in (("delay", delay_ms), ("delay_back", delay_back_ms)):
            if d is not None and not 0 <= d <= 60_000:
                raise WireError(f"{what} {d} ms: 0 to 60000 ms")
        if len(tap) > 15:
            raise WireError(f"TAP name {tap!r}: at most 15 characters")
        self.ns, self.veth, self.bridge, self.tap, self.dev = ns, veth, bridge, tap, dev
        rng = random.Random(seed)
        back_ms = delay_ms if delay_back_ms is None else delay_back_ms
        # out: from the node towards the bridge; back: from the bridge to the node
        self.out = Direction("from the node", delay_ms / 1000, loss, limit, rng)
        self.back = Direction(
            "to the node", back_ms / 1000, loss if loss_back is None else loss_back, limit, rng
        )
        self.offloads: dict[str, int] = {}
        self.wakeup_fd: int | None = None  # readable when a signal came (``main``)
        self.troubles = 0
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def _trouble(self, e: OSError) -> None:
        """A read that failed (not for want of frames): said once, and not in a hot loop."""
        if not self.troubles:
            print(f"wire {self.veth}: {e} (the wire carries on)", file=sys.stderr, flush=True)
        self.troubles += 1
        time.sleep(0.01)

    def run(self, ready: Callable[[dict[str, Any]], None] = lambda _: None) -> None:
        """Take over the link, carry frames until ``stop`` (or SIGTERM in ``main``), and
        give the link back, whatever happens."""
        tap_fd = -1
        pkt: socket.socket | None = None
        detached = False
        try:
            if not _exists(self.veth):
                raise WireError(f"no link {self.veth}")
            if _exists(self.tap):
                raise WireError(
                    f"{self.tap} exists already: another wire? (`ip link del {self.tap}`)"
                )
            mac = Path(f"/sys/class/net/{self.veth}/address").read_text().strip()
            mtu = Path(f"/sys/class/net/{self.veth}/mtu").read_text().strip()
            self.offloads = get_offloads(self.ns, self.dev)
            set_offloads(self.ns, self.dev, {"tso": 0, "gso": 0, "tx-checksum": 0})
            tap_fd = _open_tap(self.tap)
            with contextlib.suppress(OSError):  # no IPv6 chatter of the host's own
                Path(f"/proc/sys/net/ipv6/conf/{self.tap}/disable_ipv6").write_text("1\n")
            _ip("link", "set", self.tap, "address", mac, "mtu", mtu)
            _ip("link", "set", self.tap, "master", self.bridge, "up")
            detached = True
            _ip("link", "set", self.veth, "nomaster")
            pkt = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            pkt.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            with contextlib.suppress(OSError):  # 4.20+; the pkttype check below anyway
                pkt.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            pkt.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            pkt.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            pkt.bind((self.veth, ETH_P_ALL))
            pkt.setblocking(False)
            ready({"offloads": self.offloads})
            self._carry(pkt, tap_fd)
        finally:
            if pkt is not None:
                pkt.close()
            if detached:  # the veth first: the bridge keeps its address (same MAC)
                _ip("link", "set", self.veth, "master", self.bridge, check=False)
            if tap_fd >= 0:
                os.close(tap_fd)  # the TAP goes with it
            if self.offloads:
                with contextlib.suppress(OSError, WireError):
                    set_offloads(self.ns, self.dev, self.offloads)
            print(f"wire {self.veth}: {self.out.stats()}; {self.back.stats()}", file=sys.stderr)

    def _carry(self, pkt: socket.socket, tap_fd: int) -> None:
        sel = selectors.DefaultSelector()
        sel.register(pkt, selectors.EVENT_READ, "veth")
        sel.register(tap_fd, selectors.EVENT_READ, "tap")
        if self.wakeup_fd is not None:  # a signal's byte: look at _stop now
            sel.register(self.wakeup_fd, selectors.EVENT_READ, self.wakeup_fd)
        buf = bytearray(MAX_FRAME)
        view = memoryview(buf)
        try:
            while not self._stop:
                now = time.monotonic()
                dues = [d for d in (self.out.next_due(), self.back.next_due()) if d is not None]
                timeout = max(0.0, min([*dues, now + 0.5]) - now)
                for key, _ in sel.select(timeout):
                    now = time.monotonic()
                    if key.data == "veth":
                        for _ in range(DRAIN):
                            try:
                                n, addr = pkt.recvfrom_into(buf)
                            except (BlockingIOError, InterruptedError):
                                break
                            except OSError as e:  # ENETDOWN: the link went down (a partition)
                                self._trouble(e)
                                break
                            if addr[2] != socket.PACKET_OUTGOING:
                                self.out.take(bytes(view[:n]), now)
                    elif key.data == "tap":
                        for _ in range(DRAIN):
                            try:
                                n = os.readv(tap_fd, [buf])
                            except (BlockingIOError, InterruptedError):
                                break
                            except OSError as e:
                                self._trouble(e)
                                break
                            self.back.take(bytes(view[:n]), now)
                    else:
                        with contextlib.suppress(OSError):
                            os.read(key.data, 4096)
                now = time.monotonic()
                for frame in self.out.due(now):
                    try:
                        os.write(tap_fd, frame)
                        self.out.passed += 1
                    except OSError:  # full, or a frame the TAP will not take
                        self.out.failed += 1
                for frame in self.back.due(now):
                    try:
                        pkt.send(frame)
                        self.back.passed += 1
                    except OSError:  # ENOBUFS: the node's queue is full, as a drop
                        self.back.failed += 1
        finally:
            sel.close()


# -- the lab's API ---------------------------------------------------------------


def tap_name(veth: str) -> str:
    """The TAP for a veth of the lab: llmgw-NAME-n3 -> llmgw-NAME-w3."""
    base, _, member = veth.rpartition("-")
    name = f"{base}-w{member[1:] if member.startswith('n') else member}"
    if not base or len(name) > 15:
        raise WireError(f"no TAP name for {veth!r} within 15 characters")
    return name


def _reap(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # ours: no zombie left behind
        if not alive(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def impair(
    lab_state: dict[str, Any],
    node: str,
    delay_ms: float,
    loss: float,
    record: Callable[[str, str], None],
    *,
    delay_back_ms: float | None = None,
    loss_back: float | None = None,
    seed: int | None = None,
    log: Path | None = None,
    timeout: float = 10.0,
) -> int:
    """Put a wire on NODE's link: every frame ``delay_ms`` late each way (the round
    trip grows by twice that; ``delay_back_ms``: towards the node, if different) and
    a fraction ``loss`` dropped each way. Replaces a wire already there. Records its
    TAP with ``record("links", tap)`` before making it, and the wire itself in
    ``lab_state["wires"][node]`` (the caller saves lab_state). Returns its pid."""
    n = lab_state["nodes"][node]
    restore(lab_state, node)
    tap = tap_name(n["veth"])
    record("links", tap)
    argv = [sys.executable, "-m", "tools.support.labwire", "run", "--ns", n["ns"],
            "--veth", n["veth"], "--bridge", lab_state["bridge"], "--tap", tap,
            "--delay-ms", str(delay_ms), "--loss", str(loss)]  # fmt: skip
    if delay_back_ms is not None:
        argv += ["--delay-back-ms", str(delay_back_ms)]
    if loss_back is not None:
        argv += ["--loss-back", str(loss_back)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    r, w = os.pipe()
    try:
        with open(log or os.devnull, "ab") as err:
            p = subprocess.Popen(
                [*argv, "--ready-fd", str(w)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=(w,),
                env=dict(os.environ, **python_path()),  # this checkout's tools, wherever
                start_new_session=True,  # outlives a `tools/lab netem` that started it
            )
        os.close(w)
        w = -1
        lab_state.setdefault("wires", {})[node] = {
            "pid": p.pid,
            "started": started(p.pid),
            "tap": tap,
            "delay_ms": delay_ms,
            "delay_back_ms": delay_ms if delay_back_ms is None else delay_back_ms,
            "loss": loss,
            "loss_back": loss if loss_back is None else loss_back,
        }
        said = _read_line(r, timeout)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    if not said.startswith("ready "):
        restore(lab_state, node)
        why = said.removeprefix("error ").strip() or f"it said nothing within {timeout:g} s"
        raise WireError(f"the wire on {node} did not start: {why}")
    lab_state["wires"][node]["offloads"] = json.loads(said.removeprefix("ready "))["offloads"]
    return p.pid


def _read_line(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").split("\n", 1)[0]


def restore(lab_state: dict[str, Any], node: str) -> None:
    """Take the wire off NODE's link (TERM, then KILL after 1 s): the veth back on the
    bridge, the TAP gone, the node's offloads as they were. Nothing if it has none.
    The caller saves lab_state."""
    wire = lab_state.get("wires", {}).get(node)
    if wire is None:
        return
    pid = int(wire["pid"])
    if started(pid) == wire.get("started"):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
            if _reap(pid, 2 if sig == signal.SIGTERM else 5):
                break
    n = lab_state["nodes"][node]
    if _exists(n["veth"]):  # what a killed wire could not put back
        _ip("link", "set", n["veth"], "master", lab_state["bridge"], check=False)
    if _exists(wire["tap"]):
        _ip("link", "del", wire["tap"], check=False)
    if wire.get("offloads"):
        with contextlib.suppress(OSError, WireError):
            set_offloads(n["ns"], "eth0", wire["offloads"])
    del lab_state["wires"][node]


def restore_all(lab_state: dict[str, Any]) -> None:
    """Every wire off (for ``down``, before the links go)."""
    for node in list(lab_state.get("wires", {})):
        restore(lab_state, node)


# -- the command -----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.support.labwire",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("run", help="carry a node's link with latency and loss, until SIGTERM")
    p.add_argument("--ns", required=True, help="the node's network namespace")
    p.add_argument("--veth", required=True, help="the node's host-side veth")
    p.add_argument("--bridge", required=True)
    p.add_argument("--tap", required=True, help="the TAP to make (at most 15 characters)")
    p.add_argument("--dev", default="eth0", help="the node's end of the veth (eth0)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="each way (0)")
    p.add_argument("--delay-back-ms", type=float, help="towards the node, if not --delay-ms")
    p.add_argument("--loss", type=float, default=0.0, help="fraction dropped each way (0)")
    p.add_argument("--loss-back", type=float, help="towards the node, if not --loss")
    p.add_argument("--limit", type=int, default=10000, help="frames waiting each way (10000)")
    p.add_argument("--seed", type=int)
    p.add_argument("--ready-fd", type=int, help="write 'ready {json}' or 'error ...' here")
    args = parser.parse_args(argv)

    ready_fd: int | None = args.ready_fd

    def say(line: str) -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, (line + "\n").encode())
            os.close(ready_fd)
            ready_fd = None

    try:
        wire = Wire(ns=args.ns, veth=args.veth, bridge=args.bridge, tap=args.tap,
                    delay_ms=args.delay_ms, loss=args.loss, delay_back_ms=args.delay_back_ms,
                    loss_back=args.loss_back, limit=args.limit, seed=args.seed, dev=args.dev)  # fmt: skip
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        wire.wakeup_fd = r.fileno()
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: wire.stop())
        wire.run(lambda info: say("ready " + json.dumps(info)))
    except (OSError, WireError) as e:
        say(f"error {e}")
        print(f"labwire: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

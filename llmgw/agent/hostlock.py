"""One agent per node on a host: a lock named after the node, held for the agent's life.

Theory of operation
-------------------
The state dir's lock (``lock.py``) keeps two agents off one state dir, but not
off one node: an agent run by hand with the config file's own state dir,
beside the unit's agent with the unit's, registered as the same node, and the
two took the stream from each other and killed each other's engines as
strays. So an agent first takes a lock that names the node itself.

The lock is an abstract Unix socket (``@llmgw-agent:NODE:FLEET``, where FLEET
is a digest of the CA certificate: two fleets on one machine, such as two test
runs, each have their own ``n1``). The kernel drops it when its holder exits,
however it exits, so a killed agent never leaves a stale lock; it needs no
file, no directory and no permission. Abstract sockets belong to the network
namespace, which is what a host is: two agents in two containers or lab nodes
with their own network are two hosts, and the control plane decides between
them (a node whose stream is live refuses a second one).

The holder listens and answers each connection by closing it. A second agent
connects, reads the holder's pid from the connection's peer credentials
(``SO_PEERCRED``: the kernel's word, not the holder's), and refuses in one
line naming that pid and how to stop it (``systemctl stop llmgw-agent`` when
the pid runs in that unit). ``probe`` does only that read, for ``agent --check``.

Any local user could bind the name first; the refusal then names that
process, which says who to look at.
"""

from __future__ import annotations

import errno
import hashlib
import socket
import ssl
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import trio

from llmgw.config import ConfigError

PREFIX = "llmgw-agent:"
_MAX_NAME = 107  # sun_path is 108 bytes; the abstract name's leading NUL takes one
_PROBE_TIMEOUT_S = 1.0
_UNIT = "llmgw-agent.service"


def fleet_digest(ca_file: Path) -> str:
    """A short digest of the fleet's CA certificate (the first in ``ca_file``, as DER,
    so the file's layout does not matter); of the path when the file cannot be read
    (the agent then stops at its certificates, right after)."""
    try:
        text = ca_file.read_text()
        start = text.index("-----BEGIN CERTIFICATE-----")
        end = text.index("-----END CERTIFICATE-----", start) + len("-----END CERTIFICATE-----")
        data = ssl.PEM_cert_to_DER_cert(text[start:end])
    except (OSError, ValueError, UnicodeDecodeError):
        data = str(ca_file).encode()
    return hashlib.sha256(data).hexdigest()[:12]


def lock_name(node_id: str, fleet: str) -> str:
    """The abstract socket's name (without its leading NUL); a node id too long for
    it is shortened to a digest, which is as unique."""
    name = f"{PREFIX}{node_id}:{fleet}"
    if len(name.encode()) > _MAX_NAME:
        name = f"{PREFIX}{hashlib.sha256(node_id.encode()).hexdigest()[:32]}:{fleet}"
    return name


@attrs.frozen
class Holder:
    """Who holds a node's lock: its pid (None when the kernel would not say), its
    command line and the systemd unit it runs in ("" when none)."""

    pid: int | None
    command: str = ""
    unit: str = ""

    def how_to_stop(self) -> str:
        if self.unit:
            return f"systemctl stop {self.unit.removesuffix('.service')}"
        if self.pid is not None:
            return f"kill {self.pid}"
        return "ss -xlp | grep llmgw-agent names it"


class NodeBusy(ConfigError):
    """Another agent runs as this node on this host."""

    def __init__(self, node_id: str, holder: Holder) -> None:
        who = f"pid {holder.pid}" if holder.pid is not None else "pid unknown"
        if holder.unit:
            who += f", {holder.unit}"
        elif holder.command and "llmgw" not in holder.command:
            who += f", {holder.command}"
        Exception.__init__(
            self,
            f"another agent ({who}) runs as node {node_id} on this host; stop it first"
            f" ({holder.how_to_stop()}): two agents for one node take the stream from"
            " each other and kill each other's engines",
        )
        self.source, self.key, self.problem = node_id, "node_id", str(self)


def _address(name: str) -> bytes:
    return b"\0" + name.encode()


@contextmanager
def hold_node(node_id: str, fleet: str) -> Iterator[socket.socket]:
    """Hold the node's lock until the block ends; the listening socket is yielded for
    :func:`answer` to serve. Raises :class:`NodeBusy` when another process holds it."""
    name = lock_name(node_id, fleet)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.bind(_address(name))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ConfigError(
                    node_id, "node_id", f"cannot take the node's lock on this host: {exc.strerror}"
                ) from None
            raise NodeBusy(node_id, probe(node_id, fleet) or Holder(None)) from None
        sock.listen(16)
        sock.setblocking(False)
        yield sock
    finally:
        sock.close()


def probe(node_id: str, fleet: str) -> Holder | None:
    """Who holds the node's lock on this host, or None when nobody does. Takes
    nothing: it connects, reads the peer's credentials and closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(_PROBE_TIMEOUT_S)
        try:
            sock.connect(_address(lock_name(node_id, fleet)))
        except (ConnectionRefusedError, FileNotFoundError):
            # nobody has the name (or has it without listening, for an instant while an
            # agent starts, or a squatter: hold_node still finds it taken)
            return None
        except OSError:
            return Holder(None)
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return Holder(None)
        pid, _, _ = struct.unpack("3i", creds)
        if pid <= 0:  # in another pid namespace
            return Holder(None)
        return Holder(pid, _command(pid), _unit(pid))


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(w.decode(errors="replace") for w in raw.split(b"\0") if w)[:200]


def _unit(pid: int) -> str:
    """The systemd service the pid runs in, when it is llmgw's agent unit."""
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    for line in cgroup.splitlines():
        for part in line.split(":", 2)[-1].split("/"):
            if part.endswith(".service") and part.startswith("llmgw-agent"):
                return part
    return ""


async def answer(sock: socket.socket) -> None:
    """Serve the lock for the agent's life: close each connection at once (a second
    agent has read what it wanted from the kernel by then); forever, until cancelled."""
    listener = trio.socket.from_stdlib_socket(sock)
    while True:
        conn, _ = await listener.accept()
        conn.close()

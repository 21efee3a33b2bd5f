"""One agent per node: a second ``llmgw agent`` for the same node refuses in one line
and kills nothing, whatever its state dir; and two agents for one node on two hosts
(two network namespaces, so that the host's lock cannot see the other) keep one
stream: the control plane refuses the second while the first is live.

The engine is a real llama-server the control plane placed on the first agent; the
control plane runs in the test, so every registration it accepted is counted.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.agent.procs import terminate_group
from llmgw.controlplane.nodes import LivenessPolicy
from llmgw.controlplane.service import ControlPlane
from llmgw.controlplane.stream import AgentStreamServer, StreamLimits
from llmgw.protocol.messages import Register, StartShard
from llmgw.tls import issue_server, load_ca, server_context
from tests.cluster.procs import Daemon, lasting, write_agent_config
from tests.cluster.test_engine_processes import chat, fleet, llama_spec, tiny  # noqa: F401 (fixture)
from tests.conftest import Pki
from tests.ports import own_port
from tests.realparts import needs_server
from tests.stream.harness import wait_for


@needs_server
async def test_a_second_agent_for_the_node_with_another_state_dir_refuses_and_kills_nothing(
    tmp_path: Path,
    pki: Pki,
    tiny: Path,  # noqa: F811 (the fixture)
) -> None:
    async with fleet(tmp_path, pki) as f:
        first = f.start_agent()
        spec = llama_spec(tiny)
        await f.send("n1", StartShard(spec=spec))
        ready = await f.status("s1", "ready")
        assert ready.pid is not None
        engine = lasting(ready.pid)
        # by hand, beside it: the same agent.toml, with the state dir a unit would not use
        config = tmp_path / "agent-n1.toml"
        by_hand = Daemon(
            "agent-by-hand",
            ["agent", "--config", config.name, "--set", 'state_dir="by-hand-state"'],
            tmp_path,
        )
        f.agents.append(by_hand.start())
        with trio.move_on_after(20):
            while by_hand.returncode() is None:
                await trio.sleep(0.05)
        # the control plane accepted one registration, the first agent's; its stream
        # was never replaced, and its engine serves on
        assert len(f.registers) == 1, [r.agent_instance for r in f.registers]
        assert by_hand.returncode() == 2, by_hand.log()
        assert first.proc is not None
        assert by_hand.log().splitlines() == [
            f"llmgw agent: another agent (pid {first.proc.pid}) runs as node n1 on this host;"
            f" stop it first (kill {first.proc.pid}): two agents for one node take the stream"
            " from each other and kill each other's engines"
        ]
        assert not (tmp_path / "by-hand-state").exists()  # refused before it made anything
        assert lasting(ready.pid) == engine
        await chat(spec.port, ready.engine_key)
        assert [s.state for _, s in f.statuses] == ["starting", "ready"]
        assert "closed the stream" not in first.log()
        assert first.returncode() is None


# --- two hosts, one node id --------------------------------------------------------


@attrs.frozen
class Host:
    """A network namespace linked to this one: a second host on this machine."""

    ns: str
    host_ip: str  # this side's address on the link
    ns_ip: str  # the namespace's


def _ip(*argv: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"ip {' '.join(argv)} failed: {done.stderr.strip()}")


def _free_link_net() -> ipaddress.IPv4Network:
    """A /30 in 10.251.0.0/16 that no address or route of this machine overlaps."""
    text = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    text += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    used = []
    for word in text.split():
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    start = os.getpid() % 16384
    for k in range(16384):
        i = (start + k) % 16384
        net = ipaddress.ip_network(f"10.251.{i // 64}.{i % 64 * 4}/30")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise AssertionError("no free /30 in 10.251.0.0/16 for the second host's link")


@contextmanager
def second_host() -> Iterator[Host]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a second host is a network namespace: run as root with iproute2 (CI does)")
    tag = f"{os.getpid() % 100000}"
    ns, veth = f"llmgw-t{tag}", f"lt{tag}"
    net = _free_link_net()
    host_ip, ns_ip = (str(a) for a in list(net.hosts())[:2])
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield Host(ns, host_ip, ns_ip)
    finally:
        _ip("netns", "del", ns, check=False)  # takes its end of the link, and so the link
        _ip("link", "del", veth, check=False)


def in_namespace(ns: str, daemon: Daemon) -> Daemon:
    """``daemon``, run in network namespace ``ns``."""
    daemon.argv = ["ip", "netns", "exec", ns, *daemon.argv]
    return daemon


@asynccontextmanager
async def plane_on(host: str, pki: Pki, tmp: Path) -> AsyncIterator[tuple[ControlPlane, int]]:
    """An in-process control plane listening on ``host``, with a certificate for it."""
    cert, key = issue_server(load_ca(pki.dir), [host], tmp)
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=1.0, lost_after=5.0), heartbeat_interval=0.2
    )
    server = AgentStreamServer(
        control,
        server_context(pki.ca, cert, key),
        StreamLimits(handshake_timeout=2, idle_timeout=5, send_timeout=1),
    )
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(server.serve, host, 0)
        await nursery.start(control.run_liveness)
        yield control, listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def test_two_hosts_with_one_node_id_keep_one_stream_and_the_refused_one_kills_nothing(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.controlplane")
    port = own_port()
    engines = (
        f'[engines]\nport_range = [{port}, {port}]\n[discovery]\nnvidia_smi = "/nonexistent"\n'
    )
    started: list[Daemon] = []
    with second_host() as h:
        # on the second host, a process on the engine port range that no shard there
        # describes: an agent the control plane accepted would kill it
        stray = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, sys.executable, "-m", "http.server", str(port),
             "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            async with plane_on(h.host_ip, pki, tmp_path) as (control, cp_port):
                accepted: list[Register] = []
                control.on_register.append(lambda node, r: accepted.append(r))
                one, two = tmp_path / "host1", tmp_path / "host2"
                for d in (one, two):
                    d.mkdir()
                    config = write_agent_config(d, pki, "n1", cp_port, extra=engines)
                    config.write_text(config.read_text().replace("127.0.0.1:", f"{h.host_ip}:"))
                first = Daemon("agent-n1", ["agent", "--config", "agent-n1.toml"], one)
                started.append(first.start())
                await first.wait_log(r"registered with control plane .* as node n1")
                peer = control.dispatcher.connections["n1"].peer
                copy = in_namespace(
                    h.ns, Daemon("agent-n1-copy", ["agent", "--config", "agent-n1.toml"], two)
                )
                started.append(copy.start())
                refused = (
                    rf"control plane {h.host_ip}:{cp_port} refused this agent \(node n1\):"
                    rf" 4008 NODE_TAKEN: node n1 is live from {peer}; stop the second agent for it"
                )
                await copy.wait_log(refused, count=3, timeout=30)  # it retries, with backoff
                await wait_for(lambda: control.nodes.nodes["n1"].last_heartbeat_seq > 0)
                assert len(accepted) == 1, [r.agent_instance for r in accepted]
                assert control.dispatcher.connections["n1"].peer == peer
                assert copy.returncode() is None and first.returncode() is None
                assert stray.poll() is None  # the refused agent killed nothing
                assert "killing pid" not in copy.log()
                assert "closed the stream" not in first.log()
                # one line for each attempt, and nothing else about them
                attempts = copy.log().count("refused this agent")
                assert attempts >= 3
                # and the start: starting, the open files limit, the stray's port (held
                # by no shard: placement is told to leave it), what discovery found
                assert "engine ports held by processes no shard describes" in copy.log()
                assert copy.log().count("\n") <= attempts + 4, copy.log()
                lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
                assert len(lines) >= attempts
                assert f"node n1 is already connected from {peer}, and heartbeating" in lines[0]
                assert "from " + h.ns_ip in lines[0]  # the refused one's address, too
        finally:
            for d in started:
                d.kill()
            if stray.poll() is None:
                await terminate_group(stray.pid, grace=1.0)
            stray.wait(5)

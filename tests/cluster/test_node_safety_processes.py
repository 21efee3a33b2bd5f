"""Safety on a node: one agent per state dir (one per node is
test_one_agent_per_node_processes), no kills before the control plane has accepted
the agent's registration, and every kill reported to the control plane, which logs
and counts it."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.agent.procs import alive, identity, terminate_group
from llmgw.agent.strays import kill_report
from llmgw.protocol.messages import StartShard, StopShard
from tests.cluster.procs import Daemon, Server, http_server, listening, write_agent_config
from tests.cluster.test_engine_processes import PORT_BASE, fleet, llama_spec, tiny  # noqa: F401 (fixture)
from tests.cluster.test_processes import start_server
from tests.conftest import Pki
from tests.ports import own_port
from tests.realparts import LLAMA_SERVER, needs_server
from tests.stream.harness import control_plane, supervised, wait_for


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        d.kill()


def engines(port: int) -> str:
    """An engine port range of one port, a port of this test process's own."""
    return f"[engines]\nport_range = [{port}, {port}]\n"


async def test_a_second_agent_on_the_same_state_dir_refuses_naming_the_first(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server: Server = await start_server(cluster, tmp_path, pki)
    config = write_agent_config(tmp_path, pki, "n1", server.stream_port, extra=engines(own_port()))
    first = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path)
    cluster.append(first.start())
    await first.wait_log(r"registered with control plane .* as node n1")
    # another node's agent, given this one's state dir
    other = write_agent_config(tmp_path, pki, "n2", server.stream_port, extra=engines(own_port()))
    with trio.fail_after(30):
        second = await trio.run_process(
            [
                sys.executable,
                "-m",
                "llmgw",
                "agent",
                "--config",
                other.name,
                "--set",
                'state_dir="agent-n1"',
            ],
            cwd=tmp_path,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert second.returncode == 2
    assert first.proc is not None
    assert second.stderr.decode().splitlines() == [
        f"llmgw agent: another agent (pid {first.proc.pid}) runs with state dir "
        f"{tmp_path / 'agent-n1'}; stop it first, or give this one another state_dir"
    ]
    assert first.returncode() is None  # the first runs on, still registered
    await server.wait_node("n1", "Ready")
    # once the first is gone, its lock goes with it, however it ended
    first.kill()
    again = Daemon("agent-n1-again", ["agent", "--config", config.name], tmp_path)
    cluster.append(again.start())
    await again.wait_log(r"registered with control plane .* as node n1")


async def test_a_refused_agent_kills_nothing_on_its_engine_ports(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    port = own_port()
    async with http_server(port) as engine:
        before = identity(engine.pid)
        assert before is not None
        # an agent claiming node n2 with n1's certificate, whose engine ports hold
        # a process it cannot describe
        config = write_agent_config(
            tmp_path, pki, "n2", server.stream_port, cert_node="n1", extra=engines(port)
        )
        impostor = Daemon("agent-n2", ["agent", "--config", config.name], tmp_path)
        cluster.append(impostor.start())
        refused = r"refused this agent \(node n2\): 4001 IDENTITY_MISMATCH"
        await impostor.wait_log(refused, count=2)
        assert engine.poll() is None
        after = identity(engine.pid)
        assert after is not None and after.start_time == before.start_time
        assert "killing pid" not in impostor.log()
        assert "n2" not in await server.nodes()


async def test_a_stray_the_agent_kills_is_logged_by_the_control_plane_with_why(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    port = own_port()
    # the node's text reaches the server's log: a command line that would forge a
    # line, or colour the terminal, is written escaped
    odd = "www\nWARNING forged \x1b[31m"
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", odd]
    stray = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        with trio.fail_after(10):
            while not listening(port):
                await trio.sleep(0.05)
        config = write_agent_config(tmp_path, pki, "n1", server.stream_port, extra=engines(port))
        agent = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path)
        cluster.append(agent.start())
        with trio.fail_after(30):
            while stray.poll() is None:
                await trio.sleep(0.05)
        await agent.wait_log(rf"killing pid {stray.pid} \(.*http\.server.*\): it holds port {port}")
        why = (
            f"held port {port}, which this agent assigns to engines, and no shard spec describes it"
        )
        line = await server.wait_log(rf"WARNING .*node n1 killed pid {stray.pid} .*")
        command = " ".join(argv[:-1]) + " www\\x0aWARNING forged \\x1b[31m"
        assert f"killing pid {stray.pid} ({command}): it holds port {port}" in agent.log()
        assert line.group(0).endswith(f"node n1 killed pid {stray.pid} ({command}): {why}"), (
            line.group(0)
        )
    finally:
        if stray.poll() is None:
            await terminate_group(stray.pid, grace=1.0)
        stray.wait(5)
    for log in (server.log(), agent.log()):
        assert "\nWARNING forged" not in log and "\x1b" not in log
    assert server.log().count(f"killed pid {stray.pid} ") == 1  # reported once
    assert 'llmgw_agent_kills_total{node="n1",reason_kind="stray"} 1.0' in await server.metrics()


@needs_server
async def test_a_shard_that_outlives_its_stop_grace_is_killed_and_the_control_plane_says_so(
    tmp_path: Path,
    pki: Pki,
    tiny: Path,  # noqa: F811 (the fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a real llama-server, with a child in its process group that ignores SIGTERM
    engine = tmp_path / "llama-server"
    engine.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --port "*) (trap \'\' TERM; exec sleep 120) & ;; esac\n'
        f'exec "{LLAMA_SERVER}" "$@"\n'
    )
    engine.chmod(0o755)
    caplog.set_level(logging.WARNING, logger="llmgw.controlplane")
    async with fleet(tmp_path, pki) as f:
        config = write_agent_config(
            tmp_path,
            pki,
            "n1",
            f.plane.port,
            extra=(
                f'[engines]\nllama_server = "{engine}"\n'
                f"port_range = [{PORT_BASE}, {PORT_BASE + 9}]\n"
                '[discovery]\nnvidia_smi = "/nonexistent"\n'
                '[metrics]\nlisten = "127.0.0.1:0"\n'
            ),
        )
        agent = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path)
        f.agents.append(agent.start())
        await f.send("n1", StartShard(spec=llama_spec(tiny)))
        await f.status("s1", "ready")
        await f.send("n1", StopShard(shard_id="s1", grace_s=1))
        await f.status("s1", "stopped", timeout=20)
        killed = await agent.wait_log(
            r"shard s1: pid (\d+) \(sleep 120\) did not stop 1 s after SIGTERM; sending SIGKILL"
        )
        pid = int(killed.group(1))

        def reported() -> list[str]:
            return [r.getMessage() for r in caplog.records if "killed pid" in r.getMessage()]

        await wait_for(lambda: bool(reported()), timeout=10)
        assert reported() == [
            f"node n1 killed pid {pid} of shard s1 (sleep 120): did not stop 1 s after SIGTERM"
        ]
        kills = f.plane.control.metrics.registry.get_sample_value(
            "llmgw_agent_kills_total", {"node": "n1", "reason_kind": "stop_timeout"}
        )
        assert kills == 1.0
        assert not alive(pid)
        m = await agent.wait_log(r"agent metrics on (http://\S+/metrics)")
        async with httpx.AsyncClient(timeout=5) as client:
            metrics = (await client.get(m.group(1))).text
        assert 'llmgw_agent_engine_events_total{event="killed_after_grace"} 1.0' in metrics


async def test_kills_made_while_no_stream_is_up_are_reported_once_on_the_next(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.controlplane")
    async with control_plane(pki) as plane:
        agent = plane.agent("n1")
        kills = agent.supervisor.kills
        kills.put(kill_report(101, ["llama-server", "--port", "20001"], "held port 20001", "stray"))
        kills.put(kill_report(102, ["sleep", "120"], "did not stop", "stop_timeout", "s1"))
        kills.put(kill_report(103, [], "a kind of a newer agent", "oom"))

        def count(kind: str) -> float:
            value = plane.control.metrics.registry.get_sample_value(
                "llmgw_agent_kills_total", {"node": "n1", "reason_kind": kind}
            )
            return value or 0.0

        async with supervised(agent):
            await wait_for(lambda: count("other") == 1)
            # heartbeats go on, and carry none of them again
            await wait_for(lambda: plane.control.nodes.nodes["n1"].last_heartbeat_seq >= 5)
        assert (count("stray"), count("stop_timeout"), count("other")) == (1, 1, 1)
        assert kills.items == []
        assert [r.getMessage() for r in caplog.records if "killed" in r.getMessage()] == [
            "node n1 killed pid 101 (llama-server --port 20001): held port 20001",
            "node n1 killed pid 102 of shard s1 (sleep 120): did not stop",
            "node n1 killed pid 103 (command unknown): a kind of a newer agent",
        ]

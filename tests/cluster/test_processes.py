"""``llmgw server``, ``llmgw agent`` and ``llmgw ctl`` as separate processes, over real TLS."""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.cluster.procs import Daemon, Server, write_agent_config, write_server_config
from tests.cluster.proxy import Proxy
from tests.conftest import Pki


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        d.kill()


async def start_server(cluster: list[Daemon], tmp_path: Path, pki: Pki, **kw: float) -> Server:
    write_server_config(tmp_path, pki, **kw)  # type: ignore[arg-type]
    server = Server("server", ["server", "--config", "server.toml"], tmp_path)
    cluster.append(server.start())
    return await server.ready()


def start_agent(
    cluster: list[Daemon], tmp_path: Path, pki: Pki, node: str, port: int, **kw: object
) -> Daemon:
    config = write_agent_config(tmp_path, pki, node, port, **kw)  # type: ignore[arg-type]
    agent = Daemon(f"agent-{node}", ["agent", "--config", config.name], tmp_path)
    cluster.append(agent.start())
    return agent


async def test_agent_registers_and_shows_in_ctl_nodes(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    start_agent(cluster, tmp_path, pki, "n1", server.stream_port, memory_gb=12)
    node = await server.wait_node("n1", "Ready")
    assert node["memory_total_bytes"] == 12 * 2**30
    assert node["address"] == "127.0.0.1"
    table = (await server.ctl("nodes")).stdout.decode()
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "NODE", "ADDRESS", "STATE", "SHARDS", "LAST", "SEEN", "VERSION", "MEM", "FABRIC",
        "ENGINES", "GPUS",
    ]  # fmt: skip
    cells = row.split()
    assert cells[:4] == ["n1", "127.0.0.1", "Ready", "0"]  # no control plane's shards there
    assert cells[6].startswith("0.1.0+")  # the agent's version and build
    assert cells[7:10] == ["12", "GiB", "-"]  # memory as written, no fabric
    assert cells[-1] == "0"  # no GPUs


async def test_killed_agent_goes_unreachable_then_lost(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki, unreachable_after=1.0, lost_after=2.5)
    agent = start_agent(cluster, tmp_path, pki, "n1", server.stream_port)
    await server.wait_node("n1", "Ready")
    await agent.stop(signal.SIGKILL)
    await server.wait_node("n1", "Unreachable", timeout=5)
    await server.wait_node("n1", "Lost", timeout=10)
    await server.wait_log(r"node n1 is Lost \(was Unreachable\): silent for")


async def test_agent_reconnects_by_itself_after_a_server_restart(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    agent = start_agent(cluster, tmp_path, pki, "n1", server.stream_port)
    await server.wait_node("n1", "Ready")
    port = server.stream_port
    await server.stop(signal.SIGKILL)
    # same port, fresh process, empty node table
    write_server_config(tmp_path, pki, stream_port=port)
    server.start()
    await server.ready(count=2)
    await server.wait_node("n1", "Ready")
    await agent.wait_log(r"registered with control plane .* as node n1", count=2)


async def test_an_agent_notices_a_control_plane_back_from_a_long_outage_within_seconds(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    """After a stream that worked ends, the agent's reconnect delays stay within 2 s
    for a minute, jittered, however long the control plane is away: a restarted one
    hears from its nodes before its settle time, not up to a backoff cap later. (Its
    first delay is short here, so that an exponential backoff would have grown well
    past that within the outage.)"""
    server = await start_server(cluster, tmp_path, pki)
    config = write_agent_config(tmp_path, pki, "n1", server.stream_port)
    config.write_text(
        config.read_text().replace("initial_s = 0.1\nmax_s = 0.5", "initial_s = 0.05\nmax_s = 30")
    )
    # each delay is logged at debug (each failed attempt is one line already)
    agent = Daemon("agent-n1", ["agent", "--config", config.name, "--log-level", "debug"], tmp_path)
    cluster.append(agent.start())
    await agent.wait_log(r"registered with control plane .* as node n1")
    port = server.stream_port
    await server.stop(signal.SIGKILL)
    await trio.sleep(8)  # the outage
    write_server_config(tmp_path, pki, stream_port=port)
    server.start()
    await server.ready(count=2)
    back = await agent.wait_log(r"(\S+ \S+) \S+ \S+ registered with control plane", count=2)
    listening = await server.wait_log(r"(\S+ \S+) \S+ \S+ agent stream listening", count=2)
    took = _logged_at(back[1]) - _logged_at(listening[1])
    delays = [float(d) for d in re.findall(r"reconnecting in ([\d.]+) s", agent.log())]
    assert len(delays) >= 5 and max(delays) <= 2.0, delays
    assert took < 4.0, f"registered {took:.1f} s after the control plane was back"


def _logged_at(stamp: str) -> float:
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def test_agent_reconnects_after_its_connection_is_severed(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    proxy = Proxy(server.stream_port)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(proxy.serve)
        agent = start_agent(cluster, tmp_path, pki, "n1", port)
        await agent.wait_log(r"registered with control plane")
        assert proxy.sever() == 1
        await agent.wait_log(r"registered with control plane", count=2)
        assert proxy.opened == 2
        await server.wait_log(r"node n1 registered from", count=2)
        await server.wait_node("n1", "Ready")
        nursery.cancel_scope.cancel()


async def test_refused_certificate_is_explained_in_both_logs(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    agent = start_agent(cluster, tmp_path, pki, "n3", server.stream_port, cert_node="n1")
    claim = r"certificate is for 'n1' but agent claims node id 'n3'"
    await agent.wait_log(r"refused this agent \(node n3\): 4001 IDENTITY_MISMATCH: " + claim)
    await server.wait_log(
        r"refused agent stream from 127\.0\.0\.1:\d+ \(certificate 'n1'\): " + claim
    )
    assert "n3" not in await server.nodes()
    assert "err=None" not in agent.log()


async def test_sigterm_stops_both_daemons_within_a_second_closing_cleanly(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    # an hour between heartbeats: the agent sits blocked reading the stream
    server = await start_server(
        cluster, tmp_path, pki, heartbeat=3600, unreachable_after=7200, lost_after=9000
    )
    agent = start_agent(cluster, tmp_path, pki, "n1", server.stream_port)
    await server.wait_node("n1", "Ready")
    await trio.sleep(0.3)
    took = await agent.stop(signal.SIGTERM)
    assert took < 1.0, f"agent took {took:.2f} s to stop"
    assert agent.returncode() == 0
    await server.wait_log(r"agent n1 \(.*\) closed its stream: 1001 agent shutting down")
    took = await server.stop(signal.SIGINT)
    assert took < 1.0, f"server took {took:.2f} s to stop"
    assert server.returncode() == 0


async def test_bad_config_exits_2_with_one_line_naming_file_and_key(
    tmp_path: Path, pki: Pki
) -> None:
    config = write_server_config(tmp_path, pki)
    config.write_text(config.read_text().replace("lost_after_s = 2.5", 'lost_after_s = "soon"'))
    result = await trio.run_process(
        [sys.executable, "-m", "llmgw", "server", "--config", str(config)],
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == (
        f"llmgw server: {config}: liveness.lost_after_s: expected `float`, got `str`"
    )
    result = await trio.run_process(
        [sys.executable, "-m", "llmgw", "agent", "--set", "backof.max_s=3"],
        capture_stderr=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.decode().strip() == (
        "llmgw agent: defaults (overridden on the command line): backof: unknown key (is it misspelt?)"
    )


CATALOG = '[models.m]\nstatic_endpoints = ["http://127.0.0.1:9/v1"]\n'
NOT_UTF8 = b'[models.m]\nstatic_endpoints = ["http://caf\xe9:9/v1"]\n'


async def test_a_catalog_that_is_not_utf8_exits_2_with_one_line_at_start(
    tmp_path: Path, pki: Pki
) -> None:
    config = write_server_config(tmp_path, pki)
    config.write_text('catalog = "catalog.toml"\n' + config.read_text())
    (tmp_path / "catalog.toml").write_bytes(NOT_UTF8)
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, "-m", "llmgw", "server", "--config", str(config)],
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert lines == [
        f"llmgw server: {tmp_path / 'catalog.toml'}: "
        "not UTF-8 text (byte 0xe9 on line 2): save it as UTF-8"
    ]


async def test_a_standalone_router_whose_token_file_is_not_utf8_exits_2_with_one_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "token").write_bytes(NOT_UTF8)
    (tmp_path / "router.toml").write_text(
        'admin_url = "http://127.0.0.1:1"\nadmin_token_file = "token"\n'
        '[router]\nlisten = "127.0.0.1:0"\n'
        f'[[router.keys]]\nname = "t"\nsha256 = "{"0" * 64}"\n'
    )
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, "-m", "llmgw", "router", "--config", str(tmp_path / "router.toml")],
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"llmgw router: {tmp_path / 'token'}")
    assert "not UTF-8 text" in lines[0]


async def test_a_bad_catalog_on_sighup_or_reload_keeps_the_server_and_the_old_catalog(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    import httpx

    config = write_server_config(tmp_path, pki)
    config.write_text('catalog = "catalog.toml"\n' + config.read_text())
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG)
    server = Server("server", ["server", "--config", "server.toml"], tmp_path)
    cluster.append(server.start())
    await server.ready()
    token = (tmp_path / "state" / "admin-token").read_text().strip()

    async def routes() -> list[str]:
        async with httpx.AsyncClient(base_url=server.admin_url, timeout=5) as client:
            r = await client.get("/v1/routing", headers={"authorization": f"Bearer {token}"})
        r.raise_for_status()
        return sorted(route["model"] for route in r.json()["routes"])

    assert await routes() == ["m"]
    catalog.write_bytes(NOT_UTF8)
    why = f"{catalog}: not UTF-8 text (byte 0xe9 on line 2): save it as UTF-8"
    assert server.proc is not None
    server.proc.send_signal(signal.SIGHUP)
    await server.wait_log("catalog not reloaded, nothing changed: " + re.escape(why))
    assert server.returncode() is None
    bad = await server.ctl("reload", check=False)
    assert bad.returncode == 2
    assert (
        bad.stderr.decode()
        .strip()
        .endswith(f"HTTP 400: catalog not reloaded, nothing changed: {why}")
    )
    assert server.returncode() is None
    assert await routes() == ["m"]  # the old catalog still routes
    catalog.write_text(CATALOG.replace("models.m", "models.n"))
    assert "catalog reloaded" in (await server.ctl("reload")).stdout.decode()
    assert await routes() == ["n"]
    assert "Traceback" not in server.log()


async def test_ctl_warns_about_a_token_on_its_command_line_and_reads_files_safely(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    server = await start_server(cluster, tmp_path, pki)
    token = (tmp_path / "state" / "admin-token").read_text().strip()
    ctl = [sys.executable, "-m", "llmgw", "ctl", "status", "--admin-url", server.admin_url]
    with trio.fail_after(30):
        given = await trio.run_process(
            [*ctl, "--token", token], capture_stdout=True, capture_stderr=True, check=False
        )
    assert given.returncode == 0
    assert given.stderr.decode().strip() == (
        "llmgw ctl: warning: --token is visible to every user of this machine"
        " (ps, /proc/PID/cmdline); use --token-file FILE or LLMGW_ADMIN_TOKEN"
    )
    with trio.fail_after(30):
        quiet = await trio.run_process(
            ctl,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "LLMGW_ADMIN_TOKEN": token},
        )
    assert quiet.returncode == 0
    assert quiet.stderr == b""
    bad = tmp_path / "latin1-token"
    bad.write_bytes(b"caf\xe9\n")
    with trio.fail_after(30):
        result = await trio.run_process(
            [*ctl, "--token-file", str(bad)], capture_stderr=True, check=False
        )
    assert result.returncode == 2
    assert result.stderr.decode().splitlines() == [
        f"llmgw ctl status: admin token file {bad}: "
        "not UTF-8 text (byte 0xe9 on line 1): save it as UTF-8"
    ]


async def test_an_admin_listener_beyond_loopback_needs_an_explicit_opt_in(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    config = write_server_config(tmp_path, pki)
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, "-m", "llmgw", "server", "--config", str(config)]
            + ["--admin-listen", "0.0.0.0:0"],
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 2
    assert result.stderr.decode().splitlines() == [
        f"llmgw server: {config} (overridden on the command line): admin.listen: '0.0.0.0:0'"
        " is not loopback, and the admin API is plain HTTP (its token would cross the network"
        " in clear): listen on 127.0.0.1 and reach it over SSH, or set"
        " admin.insecure_listen = true to accept that"
    ]
    assert not (tmp_path / "state").exists()  # refused before anything was written
    server = Server(
        "server",
        ["server", "--config", "server.toml", "--admin-listen", "0.0.0.0:0"]
        + ["--set", "admin.insecure_listen=true"],
        tmp_path,
    )
    cluster.append(server.start())
    await server.wait_log(
        r"WARNING llmgw.server: admin API on 0.0.0.0:0 is plain HTTP beyond loopback"
        r" \(admin.insecure_listen = true\): its token crosses the network in clear"
    )
    m = await server.wait_log(r"admin API listening on http://0\.0\.0\.0:(\d+)")
    server.admin_url = f"http://127.0.0.1:{m.group(1)}"
    await server.ctl("status")  # served, to whoever holds the token


def _start_with_open_files(
    cluster: list[Daemon], tmp_path: Path, name: str, args: list[str], soft: int, hard: int
) -> Daemon:
    """A daemon started under a given open-files limit, as a systemd unit would set it."""
    daemon = Daemon(name, args, tmp_path)
    daemon.nofile = (soft, hard)
    cluster.append(daemon.start())
    return daemon


def _open_files_limits(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return line.split()[3:5]
    raise AssertionError("no open files line in /proc/PID/limits")


async def test_daemons_raise_their_open_files_limit_to_the_hard_limit_and_say_so(
    cluster: list[Daemon], tmp_path: Path, pki: Pki
) -> None:
    write_server_config(tmp_path, pki)
    server = _start_with_open_files(
        cluster, tmp_path, "server", ["server", "--config", "server.toml"], 256, 8192
    )
    await server.wait_log(r"INFO llmgw: open files limit: 8192\n")
    assert server.proc is not None
    assert _open_files_limits(server.proc.pid) == ["8192", "8192"]
    port = int((await server.wait_log(r"agent stream listening on 127\.0\.0\.1:(\d+)")).group(1))
    config = write_agent_config(tmp_path, pki, "n1", port)
    agent = _start_with_open_files(
        cluster, tmp_path, "agent", ["agent", "--config", config.name], 256, 1024
    )
    await agent.wait_log(
        r"WARNING llmgw: open files limit is 1024: each connection holds one; raise the hard"
        r" limit \(LimitNOFILE= in the systemd unit, or ulimit -Hn\)"
    )
    assert agent.proc is not None
    assert _open_files_limits(agent.proc.pid) == ["1024", "1024"]

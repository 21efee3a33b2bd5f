"""Installing with real processes: ``llmgw init`` on the control-plane host, a server
started from what it wrote, ``ctl onboard`` a node into a bundle, an agent started
from the bundle, and ``agent --check`` against a running server, a stopped one and
one whose certificate names another host."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import openai
import pytest
import trio

from tests.cluster.procs import Daemon, Server, lasting
from tests.cluster.test_control_plane_processes import BASE
from tests.ports import own_port
from tests.realparts import LLAMA_SERVER, needs_server
from tools.support.tinymodel import write_model

LLMGW = [sys.executable, "-m", "llmgw"]


def llmgw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LLMGW, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def init(tmp: Path, *hosts: str) -> subprocess.CompletedProcess[str]:
    args = ["init", "--dir", str(tmp / "etc"), "--state-dir", str(tmp / "state")]
    for host in hosts:
        args += ["--address" if host[0].isdigit() else "--name", host]
    return llmgw(*args)


def test_init_writes_everything_once_and_never_overwrites(tmp_path: Path) -> None:
    first = init(tmp_path, "localhost", "127.0.0.1")
    assert first.returncode == 0, first.stderr
    etc = tmp_path / "etc"
    written = {
        "pki/ca.pem": 0o644,
        "pki/ca-key.pem": 0o600,
        "pki/server.pem": 0o644,
        "pki/server-key.pem": 0o600,
        "admin-token": 0o600,
        "catalog.toml": 0o644,
        "server.toml": 0o600,
        "router.toml": 0o600,
    }
    for name, want in written.items():
        assert mode(etc / name) == want, name
        assert f"wrote {etc / name} ({want:04o})" in first.stdout
    assert "API key for the endpoint" in first.stdout
    assert "systemctl enable --now llmgw-server llmgw-router" in first.stdout
    assert "llmgw ctl onboard NODE" in first.stdout
    before = {name: (etc / name).read_bytes() for name in written}

    (etc / "catalog.toml").unlink()  # only what is missing is written again
    again = init(tmp_path, "localhost", "127.0.0.1", "cp.example.net")
    assert again.returncode == 0, again.stderr
    assert f"wrote {etc / 'catalog.toml'} (0644)" in again.stdout
    for name in written:
        if name != "catalog.toml":
            assert f"{etc / name} already exists" in again.stdout
            assert (etc / name).read_bytes() == before[name], name
    # the certificate was kept, and the name it lacks is said with the command that mends it
    assert "not cp.example.net: reissue with llmgw ctl cert server" in again.stdout
    assert "API key" not in again.stdout

    third = init(tmp_path, "localhost")
    assert third.returncode == 0, third.stderr
    assert f"nothing written: {etc} is already set up" in third.stdout
    assert "wrote" not in third.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_init_gives_the_files_the_server_reads_to_its_user(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    made = llmgw("init", "--dir", str(tmp_path), "--name", "localhost", "--owner", "nobody")
    assert made.returncode == 0, made.stderr
    for name in ("pki/server-key.pem", "admin-token", "server.toml", "router.toml"):
        assert f"wrote {tmp_path / name} (0600, owner nobody)" in made.stdout
        assert os.stat(tmp_path / name).st_uid == nobody.pw_uid, name
    assert os.stat(tmp_path / "pki" / "ca-key.pem").st_uid == 0  # never leaves root
    unknown = llmgw("init", "--dir", str(tmp_path / "x"), "--name", "h", "--owner", "nosuch")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("llmgw init: --owner nosuch: no such user;")


def test_init_without_a_name_says_what_to_give() -> None:
    result = llmgw("init", "--dir", "/nonexistent/llmgw")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "llmgw init: give every name and address agents dial to reach this host, e.g."
        " --name cp.example.net --address 10.0.0.1: the server certificate must hold them"
    ]


class InitServer(Server):
    """``ctl`` with the token file that init wrote."""

    async def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        token = self.workdir / "etc" / "admin-token"
        cmd = [*LLMGW, "ctl", *args, "--admin-url", self.admin_url, "--token-file", str(token)]
        result = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"ctl {args} failed: {result.stderr.decode()}")
        return result


def start_server(tmp: Path) -> Server:
    """A server from init's server.toml; only the ports are moved (to free ones)."""
    server = InitServer(
        "server",
        [
            "server",
            "--config",
            str(tmp / "etc" / "server.toml"),
            "--set",
            'agent_stream.listen="127.0.0.1:0"',
            "--set",
            'admin.listen="127.0.0.1:0"',
            "--set",
            "liveness.heartbeat_interval_s=0.2",
        ],
        tmp,
    )
    server.start()
    return server


def agent_args(bundle: Path, tmp: Path) -> list[str]:
    """The bundle's agent.toml, with a state dir of its own, no GPUs, and too little
    memory for the example catalog's model."""
    return [
        "--config",
        str(bundle / "agent.toml"),
        "--set",
        f'state_dir="{tmp / "agent-state"}"',
        "--set",
        'discovery.nvidia_smi="/nonexistent"',
        "--set",
        "discovery.llama_server_search=[]",
        "--set",
        "backoff.max_s=0.5",
        "--set",
        "inventory.memory_gb=1",  # below the example catalog's model: nothing is placed
    ]


AGENT_ENV = {"PATH": "/nonexistent"}  # no engine on PATH


async def test_init_onboard_and_an_agent_from_the_bundle_is_ready(tmp_path: Path) -> None:
    assert init(tmp_path, "localhost", "127.0.0.1").returncode == 0
    server = start_server(tmp_path)
    agent = None
    try:
        await server.ready()
        dial = f"127.0.0.1:{server.stream_port}"
        config = str(tmp_path / "etc" / "server.toml")
        made = llmgw(
            "ctl", "onboard", "n1", "--config", config, "--server", dial,
            "--fabric", "ib-a", "--label", "role=coding", "--out", str(tmp_path / "n1"),
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        bundle = tmp_path / "n1"
        assert (bundle / "agent.toml").read_text().split("\n\n", 1)[1] == (
            f'control_plane = ["{dial}"]\nnode_id = "n1"\n'
            "# the unit's (llmgw-agent.service: StateDirectory=llmgw), so that an agent run by\n"
            "# hand with this file reads the same shard records\n"
            'state_dir = "/var/lib/llmgw"\n\n'
            '[inventory]\nfabric = "ib-a"\nlabels = { "role" = "coding" }\n'
        )
        assert mode(bundle / "pki" / "n1-key.pem") == 0o600
        assert "systemctl enable --now llmgw-agent" in (bundle / "INSTALL.txt").read_text()

        again = llmgw("ctl", "onboard", "n1", "--config", config, "--out", str(bundle))
        assert again.returncode == 2
        assert "already exists; refusing to overwrite a bundle" in again.stderr

        tar = llmgw("ctl", "onboard", "n2", "--config", config, "--out", str(tmp_path / "n2.tar"))
        assert tar.returncode == 0, tar.stderr
        assert mode(tmp_path / "n2.tar") == 0o600
        with tarfile.open(tmp_path / "n2.tar") as tf:
            names = {m.name: m.mode for m in tf.getmembers()}
            toml = tf.extractfile("agent.toml")
            assert toml is not None
            # no --server: the server certificate's first name and the listen port
            assert 'control_plane = ["localhost:7443"]' in toml.read().decode()
        assert names["pki/n2-key.pem"] == 0o600
        assert {"agent.toml", "INSTALL.txt", "pki/ca.pem", "pki/n2.pem"} <= set(names)

        agent = Daemon("agent", ["agent", *agent_args(bundle, tmp_path)], tmp_path, AGENT_ENV)
        agent.start()
        node = await server.wait_node("n1", "Ready")
        assert node["fabric"] == "ib-a"
        assert node["labels"] == {"role": "coding"}

        # the preflight passes beside the running agent, and leaves it be
        check = await check_agent(bundle, tmp_path)
        assert check.returncode == 0, check.stdout + check.stderr
        for step in ("config", "certificates", "name lookup", "TCP", "TLS", "identity"):
            assert f"\n{step}: ok: " in "\n" + check.stdout, step
        assert "identity: ok: control plane " + dial + " accepts node n1" in check.stdout
        assert "  GPUs: none\n" in check.stdout
        assert agent.proc is not None
        assert f"note: an agent runs on this state dir (pid {agent.proc.pid})" in check.stdout
        assert "  fabric: ib-a\n" in check.stdout
        assert check.stdout.rstrip().endswith("passed: node n1 can join the fleet")
        await trio.sleep(0.5)  # a replaced stream would show by now
        assert "connected again" not in server.log()
        await server.wait_log("node n1 passed a check from 127.0.0.1:")
        assert "closed the stream" not in agent.log()
        assert "going away" not in agent.log()
        after = (await server.nodes())["n1"]
        assert after["state"] == "Ready" and after["peer"] == node["peer"]
        assert agent.returncode() is None

        # a server whose certificate is for another name: the TLS step says so and how
        other = tmp_path / "other"
        issued = llmgw(
            "ctl", "cert", "server", "elsewhere.example", "--dir", str(tmp_path / "etc" / "pki"),
            "--out", str(other),
        )  # fmt: skip
        assert issued.returncode == 0, issued.stderr
        elsewhere = InitServer(
            "elsewhere",
            [
                *server.args,
                "--set",
                f'agent_stream.cert="{other / "server.pem"}"',
                "--set",
                f'agent_stream.key="{other / "server-key.pem"}"',
                "--set",
                f'state_dir="{tmp_path / "elsewhere-state"}"',
            ],
            tmp_path,
        )
        elsewhere.start()
        try:
            await elsewhere.ready()
            where = f"127.0.0.1:{elsewhere.stream_port}"
            bad = await check_agent(bundle, tmp_path, where)
        finally:
            elsewhere.kill()
        assert bad.returncode == 1, bad.stdout
        assert bad.stdout.splitlines()[-1] == (
            f"TLS: FAILED: control plane {where} presented a certificate that is not valid"
            " for 127.0.0.1 (it holds elsewhere.example): issue one that holds every name"
            " and address agents dial, with llmgw ctl cert server 127.0.0.1 elsewhere.example"
            " --dir pki"
        )
        assert "discovered" not in bad.stdout  # it stops at the first blocker

        # a certificate from another CA, or for another node, is caught before dialing
        foreign = tmp_path / "foreign"
        assert llmgw("ctl", "cert", "init", "--dir", str(foreign)).returncode == 0
        assert llmgw("ctl", "cert", "agent", "n1", "--dir", str(foreign)).returncode == 0
        crt, key = foreign / "n1.pem", foreign / "n1-key.pem"
        files = ["--set", f'cert="{crt}"', "--set", f'key="{key}"']
        other_ca = await check_agent(bundle, tmp_path, extra=files)
        assert other_ca.returncode == 1
        assert other_ca.stdout.splitlines()[-1] == (
            f"certificates: FAILED: {crt} is not signed by the CA in {bundle / 'pki' / 'ca.pem'}:"
            " the control plane would refuse it; issue one from the fleet's CA with"
            " llmgw ctl onboard n1"
        )
        mine = bundle / "pki" / "n1.pem"
        files = ["--set", f'cert="{mine}"', "--set", f'key="{bundle / "pki" / "n1-key.pem"}"']
        renamed = await check_agent(bundle, tmp_path, extra=[*files, "--set", 'node_id="n9"'])
        assert renamed.returncode == 1
        assert renamed.stdout.splitlines()[-1] == (
            f"certificates: FAILED: {mine} is for 'n1' but this agent's node id is 'n9':"
            " the control plane would refuse it; issue one with llmgw ctl onboard n9"
            " (or set node_id = 'n1')"
        )

        # a stopped server: TCP refused, in the agent's words
        await server.stop()
        down = await check_agent(bundle, tmp_path)
        assert down.returncode == 1
        assert down.stdout.splitlines()[-1] == (
            f"TCP: FAILED: connection refused by {dial}: is llmgw server running there"
            " and listening on that port?"
        )
    finally:
        if agent is not None:
            agent.kill()
        server.kill()


async def check_agent(
    bundle: Path, tmp: Path, control_plane: str | None = None, extra: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    args = [*LLMGW, "agent", "--check", *agent_args(bundle, tmp), *(extra or [])]
    if control_plane:
        args += ["--set", f'control_plane=["{control_plane}"]']
    result = await trio.run_process(
        args, capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, **AGENT_ENV}
    )
    return subprocess.CompletedProcess(
        args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def _tiny_catalog(tmp: Path) -> None:
    """What an operator puts in init's catalog: the tiny model, on any node."""
    model = tmp / "tiny.gguf"
    write_model(model, ends_after=4, context_length=512)
    (tmp / "etc" / "catalog.toml").write_text(
        f"""
[models.tiny]
replicas = 1
[[models.tiny.profiles]]
name = "cpu"
engine = "llama.cpp"
min_memory_gb = 1
model_path = "{model}"
settings = {{ context = 512, parallel = 1, threads = 1, threads_batch = 1 }}
startup_timeout_s = 60
"""
    )


@needs_server
async def test_the_default_install_serves_through_a_server_restart(tmp_path: Path) -> None:
    """What ``llmgw init`` writes, run as its units run it (``llmgw server`` and
    ``llmgw router``, ports moved to free ones), with one node from a bundle: the
    server restarted (SIGTERM, then kill -9) under the openai client's traffic fails
    no request, and the engine is not restarted."""
    made = init(tmp_path, "localhost", "127.0.0.1")
    assert made.returncode == 0, made.stderr
    key = re.search(r"API key for the endpoint .*: (\S+)", made.stdout)
    assert key is not None, made.stdout
    _tiny_catalog(tmp_path)
    etc = tmp_path / "etc"
    stream, admin, endpoint = own_port(), own_port(), own_port()
    server = InitServer(
        "server",
        [
            "server", "--config", str(etc / "server.toml"),
            "--set", f'agent_stream.listen="127.0.0.1:{stream}"',
            "--set", f'admin.listen="127.0.0.1:{admin}"',
            "--set", "liveness.heartbeat_interval_s=0.2",
            "--set", "reconcile.settle_s=1",
        ],
        tmp_path,
    )  # fmt: skip
    router = Daemon(
        "router",
        [
            "router", "--config", str(etc / "router.toml"),
            "--set", f'admin_url="http://127.0.0.1:{admin}"',
            "--set", f'router.listen="127.0.0.1:{endpoint}"',
        ],
        tmp_path,
    )  # fmt: skip
    daemons = [server, router]
    try:
        server.start()
        await server.ready()
        bundle = tmp_path / "n1"
        config = str(etc / "server.toml")
        dial = f"127.0.0.1:{stream}"
        made = llmgw(
            "ctl", "onboard", "n1", "--config", config, "--server", dial, "--out", str(bundle)
        )
        assert made.returncode == 0, made.stderr
        low = BASE + 10
        agent = Daemon(
            "agent",
            [
                "agent", *agent_args(bundle, tmp_path),
                "--set", "inventory.memory_gb=8",
                "--set", f'engines.llama_server="{LLAMA_SERVER}"',
                "--set", f"engines.port_range=[{low}, {low + 9}]",
            ],
            tmp_path,
        )  # fmt: skip
        daemons.append(agent.start())
        router.start()
        await router.wait_log(r"router with 2 process\(es\) serving on")
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{endpoint}/v1", api_key=key[1], max_retries=0
        )
        with trio.fail_after(90):
            while "tiny" not in [m.id for m in (await client.models.list()).data]:
                await trio.sleep(0.2)
        [record] = (tmp_path / "agent-state" / "shards").glob("*.json")
        pid = json.loads(record.read_text())["pid"]
        engine = lasting(pid)
        ok, failed = 0, []
        stop = trio.Event()

        async def traffic() -> None:
            nonlocal ok
            while not stop.is_set():
                try:
                    await client.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=4,
                        timeout=15,
                    )
                    ok += 1
                except openai.APIError as exc:
                    failed.append(repr(exc))
                await trio.sleep(0.02)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(traffic)
            for restart, sig in enumerate((signal.SIGTERM, signal.SIGKILL), start=2):
                await trio.sleep(1)
                await server.stop(sig)
                server.start()
                await server.ready(count=restart)
                await server.wait_node("n1", "Ready")
            await trio.sleep(2)
            stop.set()
        assert failed == [], f"{len(failed)} of {ok + len(failed)} failed: {failed[:5]}"
        assert ok > 20
        assert lasting(pid) == engine  # the engine served on, never restarted
    finally:
        if router.returncode() is None and router.proc is not None:
            with trio.move_on_after(5):  # SIGTERM: its first worker stops the other
                await router.stop(signal.SIGTERM)
        for d in daemons:
            d.kill()
        for record in (tmp_path / "agent-state" / "shards").glob("*.json"):
            try:
                os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError, KeyError):
                pass

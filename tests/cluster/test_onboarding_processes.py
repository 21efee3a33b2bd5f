"""Installing with real processes: ``llmgw init`` on the control-plane host, a server
started from what it wrote, ``ctl onboard`` a node into a bundle, an agent started
from the bundle, and ``agent --check`` against a running server, a stopped one and
one whose certificate names another host."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import trio

from tests.cluster.procs import Daemon, Server

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
    }
    for name, want in written.items():
        assert mode(etc / name) == want, name
        assert f"wrote {etc / name} ({want:04o})" in first.stdout
    assert "API key for the endpoint" in first.stdout
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
            'router.listen="127.0.0.1:0"',
            "--set",
            "liveness.heartbeat_interval_s=0.2",
        ],
        tmp,
    )
    server.start()
    return server


def agent_args(bundle: Path, tmp: Path) -> list[str]:
    """The bundle's agent.toml, with a state dir of its own and nothing to discover that
    could start an engine here."""
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
    ]


AGENT_ENV = {"PATH": "/nonexistent"}  # no llama-server on PATH: nothing is placed here


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
            f'control_plane = ["{dial}"]\nnode_id = "n1"\n\n'
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
    finally:
        if agent is not None:
            agent.kill()
        server.kill()

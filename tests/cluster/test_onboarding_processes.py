"""Installing with real processes: ``llmgw init`` on the control-plane host, a server
started from what it wrote, ``ctl onboard`` a node into a bundle, an agent started
from the bundle, and ``agent --check`` against a running server, a stopped one and
one whose certificate names another host."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

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

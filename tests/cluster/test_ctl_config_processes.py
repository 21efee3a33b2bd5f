"""``llmgw ctl`` as the install prints it: no ``--config``, no token flags.

It finds the server's config in ``LLMGW_SERVER_CONFIG``, else at
``/etc/llmgw/server.toml`` where ``llmgw init`` writes it (tried in a private
/etc, see tests/privateroot.py); with neither, it says in one line where it
looked and how to point it elsewhere.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.procs import Server, write_server_config
from tests.conftest import Pki
from tests.ports import own_port
from tests.privateroot import needs_root, run_private

NOT_FOUND = (
    "llmgw ctl nodes: no admin token: no /etc/llmgw/server.toml here (where llmgw init"
    " writes it): pass --config SERVER.toml or set LLMGW_SERVER_CONFIG=SERVER.toml"
    " (or give --token-file FILE or LLMGW_ADMIN_TOKEN)"
)


def bare_env(**extra: str) -> dict[str, str]:
    """This environment without anything that tells ctl where to go."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    return {**env, **extra}


def ctl(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def start(tmp: Path, pki: Pki) -> tuple[Server, Path]:
    """A server whose config says where its admin API is (a port of ours, not 0), with
    every path in it absolute, so the file can be read from anywhere."""
    config = write_server_config(tmp, pki)
    admin = '[admin]\nlisten = "127.0.0.1:0"'
    text = config.read_text()
    assert admin in text
    text = text.replace(admin, f'[admin]\nlisten = "127.0.0.1:{own_port()}"')
    text = text.replace('state_dir = "state"', f'state_dir = "{tmp / "state"}"')
    config.write_text(text)
    server = Server("server", ["server", "--config", str(config)], tmp)
    server.start()
    await server.ready()
    return server, config


async def test_ctl_reads_the_server_config_named_in_the_environment(
    tmp_path: Path, pki: Pki
) -> None:
    server, config = await start(tmp_path, pki)
    try:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        result = ctl(
            "nodes", "--json", env=bare_env(LLMGW_SERVER_CONFIG=str(config)), cwd=elsewhere
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["nodes"] == []
    finally:
        await server.stop()


def test_ctl_told_nothing_says_where_it_looked_in_one_line(tmp_path: Path) -> None:
    if Path("/etc/llmgw/server.toml").exists():
        pytest.skip("this host has /etc/llmgw/server.toml: ctl would read it")
    result = ctl("nodes", env=bare_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [NOT_FOUND]


@needs_root
async def test_ctl_reads_etc_llmgw_server_toml_by_default(tmp_path: Path, pki: Pki) -> None:
    """In a private /etc: with /etc/llmgw/server.toml, plain ``ctl nodes`` reaches the
    server; without it, the one line."""
    server, config = await start(tmp_path, pki)
    try:
        python = shlex.quote(sys.executable)
        script = f"""
mkdir -p /etc/llmgw
cp {shlex.quote(str(config))} /etc/llmgw/server.toml
{python} -m llmgw ctl nodes --json
echo "rc=$?"
rm -r /etc/llmgw
{python} -m llmgw ctl nodes
echo "rc=$?"
"""
        result = run_private(tmp_path, script, env=bare_env())
        found, missing = result.stdout.split("rc=", 1)[0], result.stdout.splitlines()
        assert "rc=0" in result.stdout, result.stderr
        assert json.loads(found)["nodes"] == []
        assert missing[-1] == "rc=2"
        assert result.stderr.splitlines() == [NOT_FOUND]
    finally:
        await server.stop()

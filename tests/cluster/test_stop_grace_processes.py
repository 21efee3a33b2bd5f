"""The stop grace through real processes: an engine that ignores SIGTERM is killed
after its profile's ``stop_grace_s``, or else its agent's ``[engines] stop_grace_s``,
whether it is stopped (still loading when its model leaves the catalog) or drained
(Ready when it does); never after a grace the control plane made up.

The engine is a real llama-server with a child in its process group that ignores
SIGTERM; a model whose path says ``never-ready`` gets a process that ignores
SIGTERM and never answers, so its replica is still starting when it is stopped.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.cluster.procs import Daemon, write_agent_config
from tests.cluster.test_control_plane_processes import BASE, Cluster, cluster
from tests.conftest import Pki
from tests.realparts import LLAMA_SERVER, needs_server

pytestmark = needs_server

SETTINGS = "{ context = 512, parallel = 1, threads = 1, threads_batch = 1 }"


def stubborn_engine(tmp: Path) -> Path:
    assert LLAMA_SERVER is not None
    script = tmp / "llama-server"
    script.write_text(
        "#!/bin/sh\n"
        "case \" $* \" in *never-ready*) trap '' TERM; exec sleep 120 ;; esac\n"
        'case " $* " in *" --port "*) (trap \'\' TERM; exec sleep 121) & ;; esac\n'
        f'exec "{LLAMA_SERVER}" "$@"\n'
    )
    script.chmod(0o755)
    return script


def start_agent(c: Cluster, tmp: Path, grace: float) -> Daemon:
    config = write_agent_config(
        tmp,
        c.pki,
        "n1",
        c.server.stream_port,
        memory_gb=16,
        extra=(
            f'[engines]\nllama_server = "{stubborn_engine(tmp)}"\n'
            f"port_range = [{BASE}, {BASE + 9}]\nstop_grace_s = {grace}\n"
            '[discovery]\nnvidia_smi = "/nonexistent"\n'
        ),
    )
    agent = Daemon("agent-n1", ["agent", "--config", config.name], tmp)
    c.agents["n1"] = agent.start()
    return agent


def model(name: str, path: Path, more: str = "") -> str:
    return f"""
[models.{name}]
replicas = 1
[[models.{name}.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "{path}"
settings = {SETTINGS}
startup_timeout_s = 120
{more}"""


async def remove_models(c: Cluster, tmp: Path, base: str) -> None:
    """The catalog back to what the cluster started with, reloaded: the models added
    leave it, and their replicas are stopped (or drained, if Ready)."""
    (tmp / "catalog.toml").write_text(base)
    await c.server.ctl("reload")


async def test_a_loading_engine_that_ignores_sigterm_is_killed_after_its_agents_grace(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki, replicas=0) as c:
        base = (tmp_path / "catalog.toml").read_text()
        never = tmp_path / "never-ready.gguf"
        shutil.copy(tmp_path / "tiny.gguf", never)
        (tmp_path / "catalog.toml").write_text(base + model("slow", never))
        await c.server.ctl("reload")
        agent = start_agent(c, tmp_path, grace=1)
        await agent.wait_log(r"shard slow-\S+: started ", timeout=30)
        await remove_models(c, tmp_path, base)
        await agent.wait_log(
            r"shard \S+: pid \d+ \(sleep 120\) did not stop 1 s after SIGTERM; sending SIGKILL",
            timeout=30,
        )


async def test_a_drained_engine_is_killed_after_its_profiles_grace_not_its_agents(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki, replicas=0) as c:
        base = (tmp_path / "catalog.toml").read_text()
        tiny = tmp_path / "tiny.gguf"
        (tmp_path / "catalog.toml").write_text(base + model("graceful", tiny, "stop_grace_s = 3"))
        await c.server.ctl("reload")
        agent = start_agent(c, tmp_path, grace=1)
        await c.wait_ready(1, model="graceful")
        await remove_models(c, tmp_path, base)
        await agent.wait_log(
            r"shard \S+: pid \d+ \(sleep 121\) did not stop 3 s after SIGTERM; sending SIGKILL",
            timeout=30,
        )

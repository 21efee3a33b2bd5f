"""Weights that no node looks for are not reported missing, through real agents and the
real CLI: a profile whose model_path lies outside every node's weights dirs raises no
"no node reports its weights" problem (nobody looked: an unknown is not a zero), one
whose file is found at its model_path under another name is held, and one inside a
weights dir that is not there still is a problem."""

from __future__ import annotations

from pathlib import Path

from tests.agent.discovery.test_weights import write_gguf
from tests.cluster.procs import Daemon, Server, write_agent_config, write_server_config
from tests.conftest import Pki


def profile(name: str, path: Path) -> str:
    return (
        f'[models.{name}]\n[[models.{name}.profiles]]\nname = "gpu"\nengine = "vllm"\n'
        f'gpus = 1\nmodel_path = "{path}"\n'
    )


async def test_weights_outside_every_weights_dir_are_no_problem(tmp_path: Path, pki: Pki) -> None:
    models = tmp_path / "models"  # the weights dir every node looks in
    default = tmp_path / "default"  # and the default one, there as a package makes it
    models.mkdir()
    default.mkdir()
    write_gguf(models / "tiny-llama.gguf")
    (tmp_path / "catalog.toml").write_text(
        profile("outside", tmp_path / "elsewhere" / "x.gguf")
        + profile("named-apart", models / "tiny-llama.gguf")
        + profile("absent", models / "absent.gguf")
    )
    config = write_server_config(tmp_path, pki)
    config.write_text('catalog = "catalog.toml"\n' + config.read_text())
    started: list[Daemon] = []
    try:
        server = Server("server", ["server", "--config", "server.toml"], tmp_path)
        started.append(server.start())
        await server.ready()
        for node in ("n1", "n2"):
            extra = (
                '[discovery]\nnvidia_smi = "/nonexistent"\n'
                f'[weights]\ndirs = ["{models}"]\ndefault_dir = "{default}"\n'
            )
            config = write_agent_config(tmp_path, pki, node, server.stream_port, extra=extra)
            started.append(
                Daemon(f"agent-{node}", ["agent", "--config", config.name], tmp_path).start()
            )
        await server.wait_node("n1", "Ready")
        await server.wait_node("n2", "Ready")
        # each node says where it looks
        looks = (await server.nodes())["n1"]["weights_dirs"]
        assert looks == [str(models), str(default)], looks

        status = (await server.ctl("status")).stdout.decode()
        assert "warning: no node reports the weights of absent (absent)" in status, status
        assert "weights of outside" not in status, status
        assert "weights of named-apart" not in status, status
        listed = (await server.ctl("models")).stdout.decode()
        rows = {line.split()[0]: line for line in listed.splitlines()[1:] if line.strip()}
        assert "no node reports its weights" in rows["absent"], listed
        assert "no node reports its weights" not in rows["outside"], listed
        assert "no node reports its weights" not in rows["named-apart"], listed
        metrics = await server.metrics()
        assert 'llmgw_model_problems{model="absent",reason="weights"} 1.0' in metrics, metrics
        assert 'model="outside",reason="weights"' not in metrics, metrics
        assert 'model="named-apart",reason="weights"' not in metrics, metrics
    finally:
        for d in started:
            d.kill()

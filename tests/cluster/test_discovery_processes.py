"""Discovery through real agent processes and the real stream, read back with ``ctl``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import trio

from tests.agent.discovery.test_gpus import FAKE
from tests.agent.discovery.test_weights import write_gguf
from tests.cluster.procs import Daemon, Server, write_agent_config, write_server_config
from tests.conftest import Pki

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MEMINFO = (FIXTURES / "nvidia-h200" / "meminfo.txt").read_text()


async def start(tmp_path: Path, pki: Pki, started: list[Daemon]) -> Server:
    write_server_config(tmp_path, pki)
    server = Server("server", ["server", "--config", "server.toml"], tmp_path)
    started.append(server.start())
    return await server.ready()


def agent(
    tmp_path: Path,
    pki: Pki,
    started: list[Daemon],
    node: str,
    port: int,
    extra: str,
    *,
    memory_gb: float | None = None,
    env: dict[str, str] | None = None,
) -> Daemon:
    config = write_agent_config(tmp_path, pki, node, port, extra=extra, memory_gb=memory_gb)
    d = Daemon(f"agent-{node}", ["agent", "--config", config.name], tmp_path, env=env)
    started.append(d.start())
    return d


def meminfo(path: Path, total_kb: int) -> Path:
    path.write_text(MEMINFO.replace("MemTotal:       131981020 kB", f"MemTotal: {total_kb} kB"))
    return path


def fake_nvidia_smi(bindir: Path) -> Path:
    bindir.mkdir(exist_ok=True)
    exe = bindir / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    exe.chmod(0o755)
    return exe


async def test_memory_growing_between_heartbeats_shows_without_a_restart(
    tmp_path: Path, pki: Pki
) -> None:
    started: list[Daemon] = []
    try:
        server = await start(tmp_path, pki, started)
        mem = meminfo(tmp_path / "meminfo", 8 * 2**20)
        extra = f'[discovery]\nmeminfo = "{mem}"\nnvidia_smi = "/nonexistent"\n'
        n1 = agent(tmp_path, pki, started, "n1", server.stream_port, extra)
        node = await server.wait_node("n1", "Ready")
        assert node["memory_total_bytes"] == 8 * 2**30
        meminfo(mem, 32 * 2**20)  # the VM was given more memory
        with trio.fail_after(15):
            while (await server.nodes())["n1"]["memory_total_bytes"] != 32 * 2**30:
                await trio.sleep(0.1)
        await server.wait_log(r"node n1 now has 32\.0 GiB of memory")
        assert " 32 GiB " in (await server.ctl("nodes")).stdout.decode()
        assert n1.log().count("registered with control plane") == 1  # no reconnect, no restart
    finally:
        for d in started:
            d.kill()


async def test_written_memory_beats_discovered_memory(tmp_path: Path, pki: Pki) -> None:
    started: list[Daemon] = []
    try:
        server = await start(tmp_path, pki, started)
        mem = meminfo(tmp_path / "meminfo", 8 * 2**20)
        extra = f'[discovery]\nmeminfo = "{mem}"\nnvidia_smi = "/nonexistent"\n'
        agent(tmp_path, pki, started, "n1", server.stream_port, extra, memory_gb=6)
        node = await server.wait_node("n1", "Ready")
        assert node["memory_total_bytes"] == 6 * 2**30
    finally:
        for d in started:
            d.kill()


async def test_gpus_from_nvidia_smi_and_an_engine_appearing_later(tmp_path: Path, pki: Pki) -> None:
    """The real H200 row (through the stand-in), and vLLM installed while the agent runs."""
    started: list[Daemon] = []
    try:
        server = await start(tmp_path, pki, started)
        bindir = tmp_path / "bin"
        exe = fake_nvidia_smi(bindir)
        extra = f'[discovery]\nnvidia_smi = "{exe}"\ninterval_s = 0.5\n'
        site = tmp_path / "site"
        env = {
            "PATH": f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin",
            "PYTHONPATH": str(site),
            "FAKE_NVIDIA_SMI_MODE": "unhealthy",
        }
        agent(tmp_path, pki, started, "n1", server.stream_port, extra, env=env)
        node = await server.wait_node("n1", "Ready")
        [gpu] = node["gpus"]
        assert gpu["name"] == "NVIDIA H200"
        assert gpu["memory_total_mib"] == 143771
        assert not gpu["healthy"]
        assert "2 uncorrected ECC errors" in gpu["problems"]
        table = (await server.ctl("nodes")).stdout.decode()
        assert "1 (1 unhealthy: GPU 0: 2 uncorrected ECC errors" in table
        # now install "vllm": a console script whose package metadata says 0.11.2
        info = site / "vllm-0.11.2.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.2\n")
        script = bindir / "vllm"
        script.write_text(f"#!{sys.executable}\nraise SystemExit(1)\n")
        script.chmod(0o755)
        await server.wait_log(r"node n1 now has vllm 0\.11\.2")
        node = (await server.nodes())["n1"]
        assert node["engines"]["vllm"] == "0.11.2"
    finally:
        for d in started:
            d.kill()


async def test_ctl_status_shows_what_each_fabric_holds(tmp_path: Path, pki: Pki) -> None:
    started: list[Daemon] = []
    try:
        # in the catalog: one model whose weights n1 holds, one that no node holds
        (tmp_path / "catalog.toml").write_text(
            "".join(
                f'[models.{m}]\n[[models.{m}.profiles]]\nname = "gpu"\nengine = "vllm"\ngpus = 1\n'
                for m in ("tiny-llama", "absent")
            )
        )
        config = write_server_config(tmp_path, pki)
        config.write_text('catalog = "catalog.toml"\n' + config.read_text())
        server = Server("server", ["server", "--config", "server.toml"], tmp_path)
        started.append(server.start())
        await server.ready()
        models = tmp_path / "models"
        models.mkdir()
        write_gguf(models / "tiny-llama.gguf")
        (models / "half-done").mkdir()  # an empty directory is not weights
        nfs = FIXTURES / "mounts" / "nfs-client.txt"
        for node, fabric, mounts in (("n1", "ib-a", nfs), ("n2", "ib-b", "/proc/mounts")):
            extra = (
                f'[discovery]\nnvidia_smi = "/nonexistent"\nmounts = "{mounts}"\n'
                f'[weights]\ndirs = ["{models if node == "n1" else tmp_path / "none"}"]\n'
                f'default_dir = "{tmp_path / "default"}"\n'
            )
            config = write_agent_config(
                tmp_path, pki, node, server.stream_port, extra=extra
            ).read_text()
            config = config.replace("[backoff]", f'[inventory]\nfabric = "{fabric}"\n[backoff]')
            (tmp_path / f"agent-{node}.toml").write_text(config)
            started.append(
                Daemon(
                    f"agent-{node}", ["agent", "--config", f"agent-{node}.toml"], tmp_path
                ).start()
            )
        await server.wait_node("n1", "Ready")
        await server.wait_node("n2", "Ready")
        text = (await server.ctl("status")).stdout.decode()
        assert "tiny-llama" in text
        assert "half-done" not in text
        assert "1 local copy (n1)" in text  # tmp_path is not under the fixture's NFS mount
        assert "warning: tiny-llama is held in fabric ib-a only: ib-b cannot serve it" in text, text
        as_json = (await server.ctl("status", "--json")).stdout.decode()
        assert '"fabric":"ib-b"' in as_json
        # the catalog's model no node holds is warned about, the one n1 holds is not
        assert "warning: no node reports the weights of absent (absent)" in text, text
        assert "weights of tiny-llama" not in text, text
        listed = (await server.ctl("models")).stdout.decode()
        row = next(line for line in listed.splitlines() if line.startswith("absent "))
        assert "no node reports its weights" in row, listed
        metrics = await server.metrics()
        assert 'llmgw_model_problems{model="absent",reason="weights"} 1.0' in metrics, metrics
        assert 'llmgw_model_problems{model="tiny-llama",reason="weights"}' not in metrics
    finally:
        for d in started:
            d.kill()

"""Engines through the real agent process and the real stream, with a real llama-server.

The control plane runs in the test (so it can send commands through its own
dispatcher and hear every status and registration); the agent is a separate
``llmgw agent`` process, and the engine a real llama-server serving the tiny
model from tools/support/tinymodel.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import msgspec
import pytest
import trio

from llmgw.agent.procs import alive, environ
from llmgw.protocol.messages import Register, ShardSpec, ShardStatus, StartShard, StopShard
from tests.cluster.procs import Daemon, http_server, lasting, listening, write_agent_config
from tests.conftest import Pki
from tests.realparts import LLAMA_SERVER, needs_server
from tests.stream.harness import Plane, control_plane, wait_for
from tools.support.tinymodel import write_model

pytestmark = needs_server

# a small port range of our own, away from the ephemeral range
PORT_BASE = 21000 + (os.getpid() % 400) * 10


def free_port(low: int = PORT_BASE, high: int = PORT_BASE + 9) -> int:
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the test's range")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_model(path, ends_after=4)
    return path


@attrs.define
class Fleet:
    plane: Plane
    tmp: Path
    pki: Pki
    statuses: list[tuple[str, ShardStatus]] = attrs.Factory(list)
    registers: list[Register] = attrs.Factory(list)
    agents: list[Daemon] = attrs.Factory(list)

    def start_agent(
        self, node: str = "n1", extra: str = "", env: dict[str, str] | None = None
    ) -> Daemon:
        config = write_agent_config(
            self.tmp,
            self.pki,
            node,
            self.plane.port,
            extra=(
                f'[engines]\nllama_server = "{LLAMA_SERVER}"\n'
                f"port_range = [{PORT_BASE}, {PORT_BASE + 9}]\nstop_grace_s = 5\n"
                '[discovery]\nnvidia_smi = "/nonexistent"\n' + extra
            ),
        )
        agent = Daemon(f"agent-{node}", ["agent", "--config", config.name], self.tmp, env=env)
        self.agents.append(agent.start())
        return agent

    async def status(self, shard: str, state: str, timeout: float = 60) -> ShardStatus:
        def find() -> ShardStatus | None:
            for _, s in self.statuses:
                if s.shard_id == shard and s.state == state:
                    return s
            return None

        await wait_for(lambda: find() is not None, timeout=timeout)
        found = find()
        assert found is not None
        return found

    async def send(self, node: str, message: StartShard | StopShard) -> None:
        await wait_for(lambda: self.plane.control.dispatcher.connected(node), timeout=20)
        await self.plane.control.dispatcher.send(node, message)


@asynccontextmanager
async def fleet(tmp_path: Path, pki: Pki) -> AsyncIterator[Fleet]:
    async with control_plane(pki, heartbeat=0.2, unreachable_after=5, lost_after=30) as plane:
        f = Fleet(plane, tmp_path, pki)
        plane.control.on_shard_status.append(lambda node, s: f.statuses.append((node, s)))
        plane.control.on_register.append(lambda node, r: f.registers.append(r))
        try:
            yield f
        finally:
            for agent in f.agents:
                agent.kill()
            # engines outlive agents by design; the test must not leave any behind
            for _, s in f.statuses:
                if s.pid:
                    try:
                        os.killpg(s.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass


def llama_spec(
    model: Path, shard: str = "s1", port: int | None = None, **settings: object
) -> ShardSpec:
    return ShardSpec(
        shard_id=shard,
        replica_id=f"r-{shard}",
        model="tiny",
        profile="cpu",
        engine="llama.cpp",
        host="127.0.0.1",
        port=port or free_port(),
        model_path=str(model),
        settings={"context": 512, "parallel": 1, "threads": 1, "threads_batch": 1, **settings},  # type: ignore[dict-item]
        startup_timeout_s=60,
    )


async def chat(port: int, key: str) -> dict[str, object]:
    """A chat straight to an engine, with the key its agent reported."""
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
            headers={"authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200, r.text
    body: dict[str, object] = r.json()
    return body


async def test_a_llama_server_shard_starts_and_serves(tmp_path: Path, pki: Pki, tiny: Path) -> None:
    async with fleet(tmp_path, pki) as f:
        f.start_agent()
        spec = llama_spec(tiny)
        await f.send("n1", StartShard(spec=spec))
        starting = await f.status("s1", "starting")
        ready = await f.status("s1", "ready")
        assert ready.pid == starting.pid
        reply = await chat(spec.port, ready.engine_key)
        assert reply["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
        # the record holds the full spec, written before the shard was reported started
        record = (tmp_path / "agent-n1" / "shards" / "s1.json").read_text()
        assert f'"model_path":"{tiny}"' in record


async def test_an_engine_gets_a_clean_environment_with_its_tag(
    tmp_path: Path, pki: Pki, tiny: Path
) -> None:
    """Secrets in the agent's environment stay there; the engine carries its shard's tag."""
    async with fleet(tmp_path, pki) as f:
        secrets = {"LLMGW_ADMIN_TOKEN": "admin-secret", "SOME_CLOUD_KEY": "cloud-secret"}
        f.start_agent(env={**secrets, "LC_ALL": "C.UTF-8"})
        spec = msgspec.structs.replace(llama_spec(tiny), env={"FROM_PROFILE": "yes"})
        await f.send("n1", StartShard(spec=spec))
        ready = await f.status("s1", "ready")
        assert ready.pid is not None
        env = environ(ready.pid)
        assert env is not None
        assert not set(secrets) & set(env), sorted(env)
        assert env["FROM_PROFILE"] == "yes"
        assert env["LC_ALL"] == "C.UTF-8"
        assert env["PATH"] == os.environ["PATH"]
        assert env["LLMGW_SHARD_ID"] == "s1"
        assert env["LLMGW_STATE_DIR"] == os.path.realpath(tmp_path / "agent-n1")
        await chat(spec.port, ready.engine_key)


async def test_a_killed_engine_is_reported_failed_with_its_output_tail(
    tmp_path: Path, pki: Pki, tiny: Path
) -> None:
    async with fleet(tmp_path, pki) as f:
        f.start_agent()
        await f.send("n1", StartShard(spec=llama_spec(tiny)))
        ready = await f.status("s1", "ready")
        assert ready.pid is not None
        os.kill(ready.pid, signal.SIGKILL)
        failed = await f.status("s1", "failed")
        assert failed.detail == "engine killed by signal 9 (SIGKILL)"
        tail = "\n".join(failed.output_tail)
        assert "llama" in tail.lower(), tail  # the engine's own words
        assert not (tmp_path / "agent-n1" / "shards" / "s1.json").exists()


async def test_a_restarted_agent_adopts_every_engine_and_can_stop_them(
    tmp_path: Path, pki: Pki, tiny: Path
) -> None:
    async with fleet(tmp_path, pki) as f:
        agent = f.start_agent(extra='[metrics]\nlisten = "127.0.0.1:0"\n')
        one, two = llama_spec(tiny, "s1"), llama_spec(tiny, "s2", port=free_port(PORT_BASE + 5))
        await f.send("n1", StartShard(spec=one))
        await f.send("n1", StartShard(spec=two))
        readies = {s: await f.status(s, "ready") for s in ("s1", "s2")}
        pids = {s: r.pid for s, r in readies.items()}
        keys = {s: r.engine_key for s, r in readies.items()}
        before = {s: lasting(pid) for s, pid in pids.items() if pid}

        await agent.stop(signal.SIGKILL)
        await chat(one.port, keys["s1"])  # the engines keep serving without their agent
        f.registers.clear()
        agent.start()
        await wait_for(lambda: bool(f.registers), timeout=30)
        reports = {r.spec.shard_id: r for r in f.registers[-1].shards}
        assert set(reports) == {"s1", "s2"}  # every running shard, not only the first
        assert {s: r.state for s, r in reports.items()} == {"s1": "ready", "s2": "ready"}
        assert {s: r.pid for s, r in reports.items()} == pids  # adopted, not restarted
        assert {s: r.engine_key for s, r in reports.items()} == keys  # from their records
        assert {s: lasting(p) for s, p in pids.items() if p} == before
        await agent.wait_log(r"adopted shard s1 \(pid \d+\) left running by a previous agent")
        assert "earlier output is gone" in agent.log()
        await chat(two.port, keys["s2"])

        m = await agent.wait_log(r"agent metrics on (http://\S+/metrics)", count=2)
        async with httpx.AsyncClient(timeout=5) as client:
            metrics = (await client.get(m.group(1))).text
        assert 'llmgw_agent_engine_events_total{event="adopted"} 2.0' in metrics
        assert 'llmgw_agent_shards{state="ready"} 2.0' in metrics

        await f.send("n1", StopShard(shard_id="s1", grace_s=5))
        await f.status("s1", "stopped")
        # the process is gone, not just reported gone (a zombie is gone: it was not our
        # child, and reaping it is its new parent's business)
        assert pids["s1"] is not None
        assert not alive(pids["s1"])
        await chat(two.port, keys["s2"])


async def test_an_engine_whose_record_is_spoiled_keeps_serving(
    tmp_path: Path, pki: Pki, tiny: Path
) -> None:
    """A truncated record: the engine is adopted from the record's previous copy; with
    that spoiled too, the engine is recognised by its tag and left serving, not killed."""
    async with fleet(tmp_path, pki) as f:
        agent = f.start_agent()
        spec = llama_spec(tiny)
        await f.send("n1", StartShard(spec=spec))
        ready = await f.status("s1", "ready")
        pid = ready.pid
        assert pid is not None
        before = lasting(pid)
        shards = tmp_path / "agent-n1" / "shards"
        record = shards / "s1.json"

        await agent.stop(signal.SIGKILL)
        record.write_bytes(record.read_bytes()[:40])
        f.registers.clear()
        agent.start()
        await wait_for(lambda: bool(f.registers), timeout=30)
        reports = {r.spec.shard_id: r for r in f.registers[-1].shards}
        assert {s: (r.state, r.pid) for s, r in reports.items()} == {"s1": ("ready", pid)}
        await agent.wait_log(r"shard s1: using the previous copy of its record")
        assert lasting(pid) == before
        assert msgspec.json.decode(record.read_bytes())["pid"] == pid  # whole again
        await chat(spec.port, ready.engine_key)

        await agent.stop(signal.SIGKILL)
        record.write_bytes(b"{")
        (shards / "s1.json.prev").write_bytes(b"")
        f.registers.clear()
        agent.start()
        await agent.wait_log(
            rf"pid {pid} is an engine this agent started for shard s1, but no readable "
            r"record describes it; it is left running"
        )
        # registered: the strays on the engine ports were dealt with before that
        await wait_for(lambda: bool(f.registers), timeout=30)
        assert f.registers[-1].shards == []  # it cannot say what the engine serves
        assert lasting(pid) == before
        assert "killing pid" not in agent.log()
        await chat(spec.port, ready.engine_key)
        # placed again on its port, the shard is refused with what to do
        await f.send("n1", StartShard(spec=msgspec.structs.replace(spec, shard_id="s2")))
        refused = await f.status("s2", "failed", timeout=20)
        assert refused.detail == (
            f"port {spec.port} is held by pid {pid}, an engine this agent started for shard "
            f"s1 that no readable record describes; stop it (kill -TERM -- -{pid}) to free "
            "the port"
        )
        assert lasting(pid) == before


async def test_an_engine_nobody_can_describe_is_killed(tmp_path: Path, pki: Pki) -> None:
    port = free_port()
    async with http_server(port) as rogue, fleet(tmp_path, pki) as f:
        agent = f.start_agent()
        with trio.fail_after(30):
            while rogue.poll() is None:
                await trio.sleep(0.05)
        await agent.wait_log(rf"killing pid {rogue.pid} \(.*http\.server.*\): it holds port {port}")


async def test_a_profile_the_engine_would_refuse_is_refused_before_launch(
    tmp_path: Path, pki: Pki, tiny: Path
) -> None:
    async with fleet(tmp_path, pki) as f:
        f.start_agent()
        spec = llama_spec(tiny, context=8)
        await f.send("n1", StartShard(spec=spec))
        failed = await f.status("s1", "failed", timeout=20)
        assert failed.detail == "refused before launch: context must be at least 16, got 8"
        assert failed.pid is None
        assert not (tmp_path / "agent-n1" / "shards" / "s1.log").exists()  # nothing ran
        partial = tmp_path / "partial.gguf"
        partial.write_bytes(tiny.read_bytes()[:50_000])
        await f.send("n1", StartShard(spec=llama_spec(partial, "s2")))
        failed = await f.status("s2", "failed", timeout=20)
        assert "is not a whole GGUF model: truncated" in failed.detail


async def test_a_vllm_shard_through_the_agent_with_the_stand_in(tmp_path: Path, pki: Pki) -> None:
    """vLLM cannot run here: its stand-in accepts vLLM's command line and serves its endpoints."""
    from tests.engines.test_vllm import wrapper

    bindir = tmp_path / "bin"
    wrapper(bindir, "vllm")
    async with fleet(tmp_path, pki) as f:
        config = write_agent_config(
            tmp_path,
            pki,
            "n1",
            f.plane.port,
            extra=(
                f"[engines]\nport_range = [{PORT_BASE}, {PORT_BASE + 9}]\n"
                '[discovery]\nnvidia_smi = "/nonexistent"\n'
            ),
        )
        env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
        agent = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path, env=env)
        f.agents.append(agent.start())
        port = free_port()
        spec = ShardSpec(
            shard_id="v1",
            replica_id="rv1",
            model="org/tiny-hf",
            profile="gpu",
            engine="vllm",
            gpus=[0],
            host="127.0.0.1",
            port=port,
            settings={"max_model_len": 512},
            env={"STANDIN_LOAD_S": "0.5"},
            startup_timeout_s=30,
        )
        await f.send("n1", StartShard(spec=spec))
        own = {"authorization": f"Bearer {(await f.status('v1', 'ready')).engine_key}"}
        async with httpx.AsyncClient(timeout=5) as client:
            models = (await client.get(f"http://127.0.0.1:{port}/v1/models", headers=own)).json()
            metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        assert [m["id"] for m in models["data"]] == ["org/tiny-hf"]
        assert "vllm:num_requests_waiting" in metrics
        log = (tmp_path / "agent-n1" / "shards" / "v1.log").read_text()
        assert "CUDA_VISIBLE_DEVICES" in log and "0" in log
        await f.send("n1", StopShard(shard_id="v1", grace_s=5))
        await f.status("v1", "stopped")
        assert not listening(port)


async def test_a_process_holding_a_gpu_that_no_spec_describes_is_killed(
    tmp_path: Path, pki: Pki
) -> None:
    """nvidia-smi (the stand-in, answering with busy.txt's compute-apps row) names a
    process holding GPU memory; the agent cannot describe it, so it kills it."""
    from tests.cluster.test_discovery_processes import fake_nvidia_smi

    exe = fake_nvidia_smi(tmp_path / "bin")
    rogue = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        async with fleet(tmp_path, pki) as f:
            config = write_agent_config(
                tmp_path,
                pki,
                "n1",
                f.plane.port,
                extra=f'[discovery]\nnvidia_smi = "{exe}"\n',
            )
            env = {"FAKE_NVIDIA_SMI_MODE": "busy", "FAKE_NVIDIA_SMI_APP_PID": str(rogue.pid)}
            agent = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path, env=env)
            f.agents.append(agent.start())
            with trio.fail_after(30):
                while rogue.poll() is None:
                    await trio.sleep(0.05)
            await agent.wait_log(
                rf"killing pid {rogue.pid} .*holds memory on GPU GPU-a28b07a0-4e77-4642-1c8d"
            )
    finally:
        if rogue.poll() is None:
            rogue.kill()
        rogue.wait(5)


async def test_startup_is_bounded_by_the_profiles_timeout(tmp_path: Path, pki: Pki) -> None:
    """An engine that never becomes healthy is failed, and its process group killed."""
    from tests.engines.test_vllm import wrapper

    bindir = tmp_path / "bin"
    wrapper(bindir, "vllm")
    async with fleet(tmp_path, pki) as f:
        config = write_agent_config(
            tmp_path, pki, "n1", f.plane.port, extra='[discovery]\nnvidia_smi = "/nonexistent"\n'
        )
        env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
        f.agents.append(
            Daemon("agent-n1", ["agent", "--config", config.name], tmp_path, env=env).start()
        )
        spec = ShardSpec(
            shard_id="slow",
            replica_id="r",
            model="m",
            profile="p",
            engine="vllm",
            gpus=[0],
            port=free_port(),
            env={"STANDIN_LOAD_S": "600"},
            startup_timeout_s=1.5,
        )
        await f.send("n1", StartShard(spec=spec))
        starting = await f.status("slow", "starting")
        failed = await f.status("slow", "failed", timeout=20)
        assert failed.detail == "not ready within the startup timeout of 1.5 s"
        assert any("vllm stand-in" in line for line in failed.output_tail)
        assert starting.pid is not None
        assert not alive(starting.pid)


CHATTY = """#!{python}
import sys, time
line = b"x" * 1023 + b"\\n"
for _ in range(8 * 1024):  # 8 MB, then quiet
    sys.stdout.buffer.write(line)
sys.stdout.buffer.flush()
time.sleep(600)
"""


async def test_an_engines_log_stays_within_its_limit_and_goes_after_it_stops(
    tmp_path: Path, pki: Pki, tiny: Path
) -> None:
    """A chatty engine's log is rotated while it runs; once the shard stopped, its logs
    are deleted after the time they may be kept."""
    chatty = tmp_path / "chatty-llama-server"
    chatty.write_text(CHATTY.format(python=sys.executable))
    chatty.chmod(0o755)
    async with fleet(tmp_path, pki) as f:
        config = write_agent_config(
            tmp_path,
            pki,
            "n1",
            f.plane.port,
            extra=(
                f'[engines]\nllama_server = "{chatty}"\n'
                f"port_range = [{PORT_BASE}, {PORT_BASE + 9}]\nstop_grace_s = 5\n"
                "log_max_mb = 1\nstopped_log_keep_hours = 0.001\n"
                '[discovery]\nnvidia_smi = "/nonexistent"\n'
            ),
        )
        agent = Daemon("agent-n1", ["agent", "--config", config.name], tmp_path)
        f.agents.append(agent.start())
        await f.send("n1", StartShard(spec=llama_spec(tiny)))
        await f.status("s1", "starting")
        shards = tmp_path / "agent-n1" / "shards"
        log, old = shards / "s1.log", shards / "s1.log.1"

        def bounded() -> bool:
            try:
                sizes = log.stat().st_size, old.stat().st_size
            except FileNotFoundError:
                return False
            return max(sizes) <= 1 << 20 and sizes[1] > 0

        await wait_for(bounded, timeout=30)
        assert old.read_bytes().endswith(b"x" * 1023 + b"\n")

        await f.send("n1", StopShard(shard_id="s1", grace_s=5))
        await f.status("s1", "stopped")
        await wait_for(lambda: not log.exists() and not old.exists(), timeout=30)
        await agent.wait_log(r"deleted s1\.log, left by a shard that no longer runs here")

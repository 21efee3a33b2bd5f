"""The supervisor with real processes and the real stream (no engines needed).

Every test here has a ``fail_after``: a supervisor that hangs must fail the
test, not the suite.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from llmgw.agent.procs import identity
from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.agent.supervisor import Supervisor, SupervisorSettings
from llmgw.engines import llamacpp
from llmgw.protocol.messages import ShardSpec, ShardStatus, StartShard
from tests.cluster.procs import http_server
from tests.conftest import Pki
from tests.ports import own_port
from tests.stream.harness import control_plane, supervised, wait_for


def _engine(
    tmp_path: Path, script: str, on_event: Callable[[str], None] | None = None
) -> tuple[Supervisor, ShardSpec]:
    """A supervisor whose llama-server is ``script`` (sh), and a spec for it."""
    engine = tmp_path / "llama-server"
    engine.write_text(f"#!/bin/sh\n{script}\n")
    engine.chmod(0o755)
    sup = Supervisor(
        SupervisorSettings(state_dir=tmp_path / "agent", kill_unidentified=False),
        lambda: {"llama-server": str(engine)},
        on_event=on_event,
    )
    return sup, _spec(tmp_path)


def _spec(tmp_path: Path) -> ShardSpec:
    """A llama.cpp shard of ``tmp_path/m.gguf``."""
    return ShardSpec(
        shard_id="s1",
        replica_id="r1",
        model="m",
        profile="p",
        engine="llama.cpp",
        port=own_port(),
        model_path=str(tmp_path / "m.gguf"),
    )


async def test_an_adopted_engine_that_serves_is_reported_ready(tmp_path: Path) -> None:
    """The move to ready of an adopted shard is reported like any other move, with its pid."""
    port = own_port()
    async with http_server(port) as proc:
        who = identity(proc.pid)
        assert who is not None
        spec = ShardSpec(
            shard_id="s1", replica_id="r1", model="m", profile="p", engine="llama.cpp", port=port
        )
        RecordStore(tmp_path).write(
            ShardRecord(
                spec=spec,
                pid=who.pid,
                pgid=who.pgid,
                start_time=who.start_time,
                cmdline=list(who.cmdline),
                log_path=str(tmp_path / "shards" / "s1.log"),
                launched_at=0.0,
                health_url=f"http://127.0.0.1:{port}/",
            )
        )
        sup = Supervisor(SupervisorSettings(state_dir=tmp_path, kill_unidentified=False), dict)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.run)
                assert [(r.spec.shard_id, r.state) for r in sup.reports()] == [("s1", "ready")]
                assert sup.outbox.take() == [
                    ShardStatus(
                        shard_id="s1", state="ready", detail=f"adopted pid {who.pid}", pid=who.pid
                    )
                ]
                nursery.cancel_scope.cancel()


async def test_an_adopted_worker_without_http_that_has_run_is_ready_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Ray worker rank has no endpoint to check: adopted after it has run past the
    settle time, it is ready from the start, as it was; reported starting, it would take
    its Ready replica out of routing until the settle time passed again."""
    caplog.set_level(logging.INFO, "llmgw.agent")
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        who = identity(proc.pid)
        assert who is not None
        spec = ShardSpec(
            shard_id="w1", replica_id="r1", model="m", profile="p", engine="vllm-ray", rank=1,
            world_size=2,
        )  # fmt: skip
        RecordStore(tmp_path).write(
            ShardRecord(
                spec=spec,
                pid=who.pid,
                pgid=who.pgid,
                start_time=who.start_time,
                cmdline=list(who.cmdline),
                log_path=str(tmp_path / "shards" / "w1.log"),
                launched_at=time.time() - 60,
                health_url=None,
            )
        )
        sup = Supervisor(SupervisorSettings(state_dir=tmp_path, kill_unidentified=False), dict)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.run)
                # (it failed once under the whole suite's load with no shard at all, and
                # never alone: what the agent said, and what /proc says, tell why next time)
                why = [r.getMessage() for r in caplog.records], who, identity(proc.pid)
                assert [(r.spec.shard_id, r.state) for r in sup.reports()] == [("w1", "ready")], why
                nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        proc.wait()


async def test_a_hung_model_file_does_not_stall_heartbeats(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Validation reads the model file; on a filer that hangs, that read hangs. The agent
    keeps heartbeating through the real stream while it does, and the shard is refused
    once the read returns."""
    caplog.set_level(logging.INFO)
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    real = llamacpp.gguf_complete

    def hanging(path: Path) -> str | None:
        entered.set()
        release.wait(timeout=10)  # the NFS server answers again, eventually
        left.set()
        return real(path)

    monkeypatch.setattr(llamacpp, "gguf_complete", hanging)
    (tmp_path / "m.gguf").write_bytes(b"not a model")
    spec = _spec(tmp_path)
    try:
        async with (
            control_plane(pki, heartbeat=0.1) as plane,
            supervised(plane.agent("n1", state_dir=tmp_path / "agent")),
        ):
            nodes = plane.control.nodes.nodes
            await wait_for(lambda: "n1" in nodes and nodes["n1"].last_heartbeat_seq >= 1)
            with trio.fail_after(5):
                await plane.control.dispatcher.send("n1", StartShard(spec=spec))
            await wait_for(entered.is_set)
            seq = nodes["n1"].last_heartbeat_seq
            # five heartbeat intervals and more while the read hangs
            await wait_for(lambda: nodes["n1"].last_heartbeat_seq >= seq + 5)
            assert not left.is_set()
            release.set()
            await wait_for(lambda: "shard s1 failed: refused before launch" in caplog.text)
            assert "is not a whole GGUF model: not a GGUF file" in caplog.text
    finally:
        release.set()


async def test_a_stop_during_validation_launches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation runs in a thread, so a stop can come while it runs: the shard is
    stopped at once, and once validation returns nothing is started."""
    entered, release = threading.Event(), threading.Event()

    def slow(self: llamacpp.LlamaCppAdapter, spec: ShardSpec) -> list[str]:
        entered.set()
        release.wait(timeout=10)
        return []

    monkeypatch.setattr(llamacpp.LlamaCppAdapter, "validate", slow)
    events: list[str] = []
    sup, spec = _engine(tmp_path, "exec sleep 60", events.append)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.run)
                sup.start(spec)
                await wait_for(entered.is_set)
                sup.stop("s1", grace=1.0)
                await wait_for(lambda: "s1" not in sup.shards)
                release.set()
                await trio.sleep(0.5)  # what the launcher does once validation returns
                assert [(s.state, s.detail) for s in sup.outbox.take()] == [
                    ("stopping", ""),
                    ("stopped", ""),
                ]
                assert "launched" not in events
                assert not sup.records.log_path("s1").exists()  # nothing ever ran
                assert not sup.records.path("s1").exists()
                nursery.cancel_scope.cancel()
    finally:
        release.set()


async def test_an_engine_that_exits_unasked_is_reported_failed_with_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The numbers go up beside the words: ``exit_code`` for an exit, with the engine's
    last lines; a control plane older than the numbers reads ``detail``."""
    monkeypatch.setattr(llamacpp.LlamaCppAdapter, "validate", lambda self, spec: [])
    sup, spec = _engine(tmp_path, "echo 'error: no such model'\nsleep 0.3\nexit 3")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            sup.start(spec)
            await wait_for(lambda: "s1" not in sup.shards)
            *_, failed = sup.outbox.take()
            assert (failed.state, failed.detail) == ("failed", "engine exited with code 3")
            assert (failed.exit_code, failed.signal) == (3, None)
            assert failed.output_tail == ["error: no such model"]
            nursery.cancel_scope.cancel()

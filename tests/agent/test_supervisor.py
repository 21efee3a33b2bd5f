"""The supervisor with real processes (no engines needed).

Every test here has a ``fail_after``: a supervisor that hangs must fail the
test, not the suite.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from llmgw.agent.procs import identity, terminate_group
from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.agent.supervisor import Supervisor, SupervisorSettings
from llmgw.protocol.messages import ShardSpec, ShardStatus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def http_server() -> AsyncIterator[tuple[subprocess.Popen[bytes], int]]:
    """A process that answers 200 on / as an engine's health endpoint would."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        with trio.fail_after(10):
            while True:
                who = identity(proc.pid)
                if who is not None and who.cmdline and _listening(port):
                    break
                await trio.sleep(0.05)
        yield proc, port
    finally:
        await terminate_group(proc.pid, grace=1.0)
        proc.wait(5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_an_adopted_engine_that_serves_is_reported_ready(tmp_path: Path) -> None:
    """The move to ready of an adopted shard is reported like any other move, with its pid."""
    async with http_server() as (proc, port):
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

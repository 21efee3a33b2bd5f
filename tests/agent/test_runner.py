"""A shard's tasks (launch, the watcher, the terminator) on their own, with real processes.

They reach the agent only through ``ShardContext``: here a stand-in that moves
the shard through the lifecycle table and writes down every event, no
supervisor anywhere. Every test has a ``fail_after``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from llmgw.agent import runner
from llmgw.agent.context import ShardContext, SupervisorSettings
from llmgw.agent.lifecycle import Event, Move, Phase, move
from llmgw.agent.output import OutputTail
from llmgw.agent.records import RecordStore
from llmgw.agent.shard import Outbox, Shard
from llmgw.agent.weights import Fetcher
from llmgw.engines import llamacpp
from llmgw.protocol.messages import ShardSpec
from tests.ports import own_port
from tests.stream.harness import wait_for


@attrs.define
class StandIn:
    """A ``ShardContext`` that keeps what it is told, and nothing of a supervisor."""

    settings: SupervisorSettings
    records: RecordStore
    http: httpx.AsyncClient
    nursery: trio.Nursery
    engines: dict[str, str]
    outbox: Outbox = attrs.Factory(Outbox)
    fired: list[tuple[Event, str | None]] = attrs.Factory(list)
    events: list[str] = attrs.Factory(list)
    written: list[str] = attrs.Factory(list)
    fetcher: Fetcher = attrs.Factory(lambda: Fetcher(Path("/nonexistent/llmgw-weights")))

    def binaries(self) -> Mapping[str, str]:
        return self.engines

    def on_event(self, what: str, /) -> None:
        self.events.append(what)

    def fire(
        self, shard: Shard, event: Event, detail: str | None = None, *, grace: float = 0.0
    ) -> Move:
        m = move(shard.phase, event, shard.shard_id)
        shard.phase = m.to
        self.fired.append((event, detail))
        if m.end_process:
            self.spawn(runner.end, self, shard, grace)
        return m

    def holds(self, shard: Shard) -> bool:
        return True

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        self.nursery.start_soon(fn, *args)

    def bind_address(self, spec: ShardSpec) -> str:
        return spec.host

    def write_record(self, shard: Shard) -> None:
        self.written.append(shard.shard_id)

    async def kill_unidentified(self, ports: set[int]) -> None:
        raise AssertionError("this agent kills no strays")

    async def kill_gpu_holders(self) -> None:
        raise AssertionError("this agent kills no strays")

    def sigkill_hook(
        self, shard: Shard, grace: float, how: str = ""
    ) -> Callable[[Sequence[int]], None]:
        return lambda members: None


def _context(tmp_path: Path, nursery: trio.Nursery, http: httpx.AsyncClient) -> StandIn:
    engine = tmp_path / "llama-server"
    engine.write_text("#!/bin/sh\nexec sleep 60\n")
    engine.chmod(0o755)
    settings = SupervisorSettings(state_dir=tmp_path / "agent", kill_unidentified=False)
    return StandIn(
        settings, RecordStore(settings.state_dir), http, nursery, {"llama-server": str(engine)}
    )


def _shard(ctx: StandIn, engine: str = "llama.cpp") -> Shard:
    spec = ShardSpec(
        shard_id="s1",
        replica_id="r1",
        model="m",
        profile="p",
        engine=engine,
        port=own_port(),
        model_path="/models/m.gguf",
    )
    return Shard(spec=spec, tail=OutputTail(ctx.records.log_path("s1")))


@pytest.fixture(autouse=True)
def _valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp.LlamaCppAdapter, "validate", lambda self, spec: [])


async def test_an_engine_killed_unasked_fails_its_shard_with_how_it_ended(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
            ctx = _context(tmp_path, nursery, http)
            context: ShardContext = ctx  # what the tasks ask of an agent, and no more
            shard = _shard(ctx)
            nursery.start_soon(runner.run_new, context, shard)
            await wait_for(lambda: shard.process is not None)
            assert shard.process is not None
            os.kill(shard.process.pid, signal.SIGKILL)
            await wait_for(lambda: shard.phase is Phase.FAILED)
            assert ctx.fired == [
                (Event.LAUNCHED, f"pid {shard.process.pid}"),
                (Event.EXITED, "engine killed by signal 9 (SIGKILL)"),
            ]
            assert shard.returncode == -signal.SIGKILL
            assert ctx.events == ["launched"] and ctx.written == ["s1"]
            nursery.cancel_scope.cancel()


async def test_a_stop_ends_the_engine_and_its_exit_is_no_failure(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
            ctx = _context(tmp_path, nursery, http)
            shard = _shard(ctx)
            nursery.start_soon(runner.run_new, ctx, shard)
            await wait_for(lambda: shard.process is not None)
            ctx.fire(shard, Event.STOP, "", grace=1.0)
            await wait_for(lambda: shard.phase is Phase.STOPPED)
            assert [e for e, _ in ctx.fired] == [Event.LAUNCHED, Event.STOP, Event.GONE]
            assert shard.returncode is None  # it ended as asked: nothing to report
            nursery.cancel_scope.cancel()


async def test_an_unknown_engine_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
            ctx = _context(tmp_path, nursery, http)
            shard = _shard(ctx, engine="sglang")
            await runner.run_new(ctx, shard)
            assert shard.phase is Phase.FAILED and shard.process is None
            ((event, detail),) = ctx.fired
            assert event is Event.REFUSED and detail is not None
            assert detail.startswith("unknown engine 'sglang' (known: ")
            nursery.cancel_scope.cancel()

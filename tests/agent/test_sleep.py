"""Sleep and wake of a shard, with the vLLM stand-in as its engine, real processes and
the real stream.

A shard launched able to sleep (``ShardSpec.sleep``) finishes its in-flight work, then
its engine sleeps: its process stays, it generates nothing (503), and the agent
reports it ``sleeping``, not unhealthy. Woken, it is ``starting``, then ``ready``, and
generates again. An engine that will not sleep is stopped, saying why; one that does
not wake is ended and fails, saying why; one that dies asleep has failed; and a
restarted agent reports an engine it finds asleep as ``sleeping``.

Every test has a ``fail_after``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import msgspec
import pytest
import trio

from llmgw.agent.health import HealthSettings
from llmgw.agent.procs import identity
from llmgw.agent.records import RecordStore, ShardRecord
from llmgw.agent.supervisor import Supervisor, SupervisorSettings
from llmgw.engines.vllm import VLLM
from llmgw.protocol.messages import (
    ShardSpec,
    ShardStatus,
    SleepShard,
    StartShard,
    StopShard,
    WakeShard,
)
from tests.conftest import Pki
from tests.engines.test_vllm import wrapper
from tests.ports import own_port
from tests.stream.harness import control_plane, supervised, wait_for

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
REPLY = "Hello from the vLLM stand-in."


# what a shard says from its start to its stop, with a sleep and a wake between
A_NAP = ["starting", "ready", "draining", "sleeping", "starting", "ready", "stopping", "stopped"]


@attrs.define
class Heard:
    """What the control plane would hear of the shard, in order, as it is taken."""

    take: Callable[[], list[ShardStatus]]
    items: list[ShardStatus] = attrs.Factory(list)
    read: int = 0  # how far ``next`` has read

    async def next(self, state: str, timeout: float = 15) -> ShardStatus:
        """The next report of ``state`` after the last one ``next`` returned."""
        with trio.fail_after(timeout):
            while True:
                self.items.extend(self.take())
                for i in range(self.read, len(self.items)):
                    if self.items[i].state == state:
                        self.read = i + 1
                        return self.items[i]
                await trio.sleep(0.02)

    def states(self) -> list[str]:
        self.items.extend(self.take())
        return [s.state for s in self.items]


def _spec(*, sleep: bool = True, **env: str) -> ShardSpec:
    return ShardSpec(
        shard_id="s1",
        replica_id="r1",
        model="m",
        profile="p",
        engine="vllm",
        gpus=[0],
        host="127.0.0.1",
        port=own_port(),
        sleep=sleep,
        env={"STANDIN_LOAD_S": "0", **env},
        startup_timeout_s=20,
        stop_grace_s=2,
    )


def _supervisor(tmp_path: Path, health: HealthSettings | None = None) -> Supervisor:
    """A supervisor whose ``vllm`` is the stand-in, checking health every 0.1 s."""
    vllm = wrapper(tmp_path / "bin", "vllm")
    return Supervisor(
        SupervisorSettings(
            state_dir=tmp_path / "agent",
            kill_unidentified=False,
            health=health or HealthSettings.every(0.1, 2),
        ),
        lambda: {"vllm": vllm},
    )


@asynccontextmanager
async def _running(sup: Supervisor) -> AsyncIterator[trio.Nursery]:
    """``sup`` running until the block ends; then every engine it still holds (a test
    that failed half-way) is killed, so that none outlives the test."""
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            yield nursery
            nursery.cancel_scope.cancel()
    finally:
        for shard in list(sup.shards.values()):
            if shard.ident is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(shard.ident.pgid, signal.SIGKILL)


def _auth(sup: Supervisor) -> dict[str, str]:
    launch = sup.shards["s1"].launch
    assert launch is not None and launch.engine_key
    return {"authorization": f"Bearer {launch.engine_key}"}


async def _chat(client: httpx.AsyncClient, spec: ShardSpec, auth: dict[str, str]) -> httpx.Response:
    return await client.post(
        f"http://127.0.0.1:{spec.port}/v1/chat/completions", json=CHAT, headers=auth
    )


async def test_a_shard_sleeps_once_its_work_is_done_and_wakes_to_serve(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    spec = _spec(STANDIN_TOKEN_DELAY_S="0.2")  # a reply takes 1.2 s
    heard = Heard(sup.outbox.take)
    base = f"http://127.0.0.1:{spec.port}"
    with trio.fail_after(40):
        async with _running(sup) as nursery, httpx.AsyncClient(timeout=10) as client:
            sup.start(spec)
            await heard.next("ready")
            auth = _auth(sup)
            replies: list[httpx.Response] = []

            async def ask() -> None:
                replies.append(await _chat(client, spec, auth))

            nursery.start_soon(ask)
            await wait_for(lambda: sup.shards["s1"].launch is not None)
            running = 0.0
            while not running:  # the request is in flight
                metrics = (await client.get(f"{base}/metrics")).text
                running = VLLM.parse_metrics(metrics).running or 0.0
            sup.sleep("s1", grace=20)
            draining = await heard.next("draining")
            assert draining.detail == "draining: finishing in-flight requests, then it sleeps"
            # its in-flight request goes on; the engine does not sleep under it
            await trio.sleep(0.5)
            assert not replies
            assert (await client.get(f"{base}/is_sleeping")).json() == {"is_sleeping": False}
            asleep = await heard.next("sleeping")
            assert asleep.detail == "asleep: its GPU memory is free"
            await wait_for(lambda: bool(replies))
            assert replies[0].json()["choices"][0]["message"]["content"] == REPLY

            # asleep: its process runs, it generates nothing, and that is no failure
            process = sup.shards["s1"].process
            assert process is not None and process.returncode is None
            assert [(r.spec.shard_id, r.state) for r in sup.reports()] == [("s1", "sleeping")]
            refused = await _chat(client, spec, auth)
            assert refused.status_code == 503
            assert "sleeping" in refused.json()["message"]
            assert (await client.get(f"{base}/health")).status_code == 200
            await trio.sleep(0.6)  # six health intervals, three times its unhealthy_after
            assert heard.states()[heard.read :] == []
            assert sup.shards["s1"].healthy

            sup.wake("s1")
            waking = await heard.next("starting")
            assert waking.detail == "waking"
            awake = await heard.next("ready")
            assert awake.detail == "awake"
            served = await _chat(client, spec, auth)
            assert served.json()["choices"][0]["message"]["content"] == REPLY

            sup.stop("s1")
            await heard.next("stopped")
            assert heard.states() == A_NAP
            log = sup.records.log_path("s1").read_text()
            assert "vllm stand-in: asleep (level 1)" in log  # weights kept in host memory


async def test_a_shard_that_slept_and_woke_has_one_health_watcher(tmp_path: Path) -> None:
    """Asleep and awake again within one health interval: the watcher from before the
    sleep ends, and the waker's alone says the engine hangs, once."""
    sup = _supervisor(tmp_path, HealthSettings(interval_s=3.0, unhealthy_after=1, timeout_s=0.5))
    spec = _spec(STANDIN_SLEEP_S="0", STANDIN_WAKE_S="0")
    heard = Heard(sup.outbox.take)
    with trio.fail_after(30):
        async with _running(sup):
            sup.start(spec)
            await heard.next("ready")
            sup.sleep("s1", grace=5)
            await heard.next("sleeping")
            sup.wake("s1")
            await heard.next("ready")
            pid = sup.shards["s1"].pid
            assert pid is not None
            os.killpg(pid, signal.SIGSTOP)  # it hangs: no answer to its health checks
            try:
                await wait_for(lambda: not sup.shards["s1"].healthy, timeout=10)
                await trio.sleep(4)  # a second watcher would have checked by now
                unhealthy = [s for s in heard.items + sup.outbox.take() if not s.healthy]
                assert len(unhealthy) == 1, unhealthy
            finally:
                os.killpg(pid, signal.SIGCONT)
            sup.stop("s1")
            await heard.next("stopped")


async def test_an_engine_that_will_not_sleep_is_stopped_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sup = _supervisor(tmp_path)
    spec = _spec(STANDIN_SLEEP_FAILS="1")
    heard = Heard(sup.outbox.take)
    with trio.fail_after(30):
        async with _running(sup):
            sup.start(spec)
            await heard.next("ready")
            process = sup.shards["s1"].process
            sup.sleep("s1", grace=5)
            await heard.next("draining")
            stopping = await heard.next("stopping")
            stopped = await heard.next("stopped")
            assert stopping.detail == stopped.detail
            assert stopped.detail.startswith(
                "could not sleep: the engine answered POST /sleep?level=1 with 500: "
            )
            assert "CUDA error: sleep failed" in stopped.detail
            assert stopped.detail.endswith("; stopped instead")
            assert process is not None and process.returncode is not None
            assert "s1" not in sup.shards
            assert "shard s1 could not sleep: the engine answered" in caplog.text


async def test_a_shard_not_started_able_to_sleep_is_stopped_instead(tmp_path: Path) -> None:
    """A SleepShard for a shard whose spec has no sleep (the control plane sends none):
    its engine has no sleep endpoints, so it is drained and stopped, saying why."""
    sup = _supervisor(tmp_path)
    spec = _spec(sleep=False)
    heard = Heard(sup.outbox.take)
    with trio.fail_after(30):
        async with _running(sup), httpx.AsyncClient(timeout=5) as client:
            sup.start(spec)
            await heard.next("ready")
            sleeping = await client.get(f"http://127.0.0.1:{spec.port}/is_sleeping")
            assert sleeping.status_code == 404  # vLLM without --enable-sleep-mode
            sup.sleep("s1", grace=5)
            stopped = await heard.next("stopped")
            assert stopped.detail == (
                "could not sleep: it was not started able to sleep (its spec has no sleep); "
                "stopped instead"
            )


@pytest.mark.parametrize("how", ["dies asleep", "does not wake"])
async def test_an_engine_that_dies_asleep_or_does_not_wake_in_time_fails(
    tmp_path: Path, how: str
) -> None:
    """Asleep, its end is a failure as a ready engine's is; woken, the wake is bounded by
    the spec's startup timeout: an engine that does not answer (stopped here with
    SIGSTOP) is ended, and its shard fails saying why."""
    sup = _supervisor(tmp_path)
    spec = msgspec.structs.replace(_spec(), startup_timeout_s=4, stop_grace_s=0.5)
    heard = Heard(sup.outbox.take)
    with trio.fail_after(30):
        async with _running(sup):
            sup.start(spec)
            await heard.next("ready")
            sup.sleep("s1", grace=5)
            await heard.next("sleeping")
            pid = sup.shards["s1"].pid
            assert pid is not None
            if how == "dies asleep":
                os.killpg(pid, signal.SIGKILL)
                failed = await heard.next("failed")
                assert failed.detail == "engine killed by signal 9 (SIGKILL)"
                assert failed.signal == signal.SIGKILL
            else:
                os.killpg(pid, signal.SIGSTOP)
                sup.wake("s1")
                await heard.next("starting")
                failed = await heard.next("failed")
                assert failed.detail == (
                    "could not wake: the engine did not answer POST /wake_up within 4 s"
                )
            assert sup.reports() == []
            assert identity(pid) is None  # ended, and reaped


@pytest.mark.parametrize("asleep", [True, False])
async def test_a_restarted_agent_reports_an_engine_it_finds_asleep_as_sleeping(
    tmp_path: Path, asleep: bool
) -> None:
    """A sleeping vLLM answers its health check; the agent asks whether it sleeps first.
    Adopted asleep, it is sleeping, and wakes when told to; awake, it is ready."""
    spec = _spec()
    how = VLLM.launch(spec, {"vllm": wrapper(tmp_path / "bin", "vllm")})
    assert how.health_url and how.sleep_url
    proc = subprocess.Popen(
        how.argv,
        env={**os.environ, **how.env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        with trio.fail_after(30):
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    try:
                        if (await client.get(how.health_url)).status_code == 200:
                            break
                    except httpx.TransportError:
                        await trio.sleep(0.05)
                if asleep:  # a previous agent put it to sleep
                    assert (await client.post(how.sleep_url)).status_code == 200
            who = identity(proc.pid)
            assert who is not None
            RecordStore(tmp_path / "agent").write(
                ShardRecord(
                    spec=spec,
                    pid=who.pid,
                    pgid=who.pgid,
                    start_time=who.start_time,
                    cmdline=list(who.cmdline),
                    log_path=str(tmp_path / "agent" / "shards" / "s1.log"),
                    launched_at=0.0,
                    health_url=how.health_url,
                    metrics_url=how.metrics_url,
                    sleep_url=how.sleep_url,
                    wake_url=how.wake_url,
                    sleeping_url=how.sleeping_url,
                )
            )
            sup = _supervisor(tmp_path)
            heard = Heard(sup.outbox.take)
            async with _running(sup):
                state = "sleeping" if asleep else "ready"
                assert [(r.spec.shard_id, r.state) for r in sup.reports()] == [("s1", state)]
                adopted = await heard.next(state)
                assert adopted.detail == f"adopted pid {proc.pid}" + (", asleep" if asleep else "")
                if asleep:
                    sup.wake("s1")
                    await heard.next("starting")
                    await heard.next("ready")
                sup.stop("s1")
                await heard.next("stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


async def test_sleep_and_wake_through_the_stream(tmp_path: Path, pki: Pki) -> None:
    """The agent says it can sleep when it registers, and obeys SleepShard and WakeShard
    sent down the real stream; the control plane hears each move."""
    heard: list[ShardStatus] = []
    spec = _spec()
    with trio.fail_after(40):
        async with control_plane(pki) as plane:
            agent = plane.agent("n1", state_dir=tmp_path / "agent")
            vllm = wrapper(tmp_path / "bin", "vllm")
            agent.supervisor.binaries = lambda: {"vllm": vllm}
            plane.control.on_shard_status.append(lambda node, status: heard.append(status))
            async with supervised(agent):
                await wait_for(lambda: plane.control.dispatcher.connected("n1"))
                assert plane.control.nodes.nodes["n1"].can == frozenset({"sleep", "fetch"})
                dispatcher = plane.control.dispatcher

                def now(state: str) -> Callable[[], bool]:
                    return lambda: bool(heard) and heard[-1].state == state

                await dispatcher.send("n1", StartShard(spec=spec))
                await wait_for(now("ready"), timeout=20)
                await dispatcher.send("n1", SleepShard(shard_id="s1", grace_s=5))
                await wait_for(now("sleeping"), timeout=10)
                await dispatcher.send("n1", WakeShard(shard_id="s1"))
                await wait_for(now("ready"), timeout=10)
                await dispatcher.send("n1", StopShard(shard_id="s1", grace_s=5))
                await wait_for(now("stopped"), timeout=10)
                assert [s.state for s in heard] == A_NAP

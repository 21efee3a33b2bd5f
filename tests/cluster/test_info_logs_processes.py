"""What the logs say at INFO, with real processes: changes, not traffic; an engine's end
in the words of how it ended.

The router scrapes each engine's metrics every second and the agent checks each
engine's health every two: at INFO none of those requests is a line. An engine
that someone else kills says which signal, whether the agent started it or
adopted it from its previous run.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import trio

from llmgw.agent.procs import describe_exit, identity, reaped_exit, zombie_exit
from llmgw.cli.runtime import setup_logging
from llmgw.controlplane.failures import exit_of
from llmgw.protocol.messages import StartShard
from llmgw.router.keys import hash_key, new_key
from tests.cluster.test_control_plane_processes import cluster
from tests.cluster.test_engine_processes import fleet, llama_spec, tiny  # noqa: F401 (fixture)
from tests.conftest import Pki
from tests.realparts import needs_server
from tests.stream.harness import wait_for

HTTPX_LINE = "HTTP Request:"  # how httpx logs each request it makes, at INFO


def test_httpx_speaks_at_info_only_when_debug_is_asked_for() -> None:
    try:
        setup_logging("info")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
        assert logging.getLogger("llmgw").isEnabledFor(logging.INFO)
        setup_logging("debug")
        assert logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("httpcore").isEnabledFor(logging.DEBUG)
    finally:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.NOTSET)


@needs_server
async def test_scrapes_and_health_checks_write_no_line_at_info(tmp_path: Path, pki: Pki) -> None:
    key = new_key()
    router = (
        '[router]\nlisten = "127.0.0.1:0"\n'
        f'[[router.keys]]\nname = "tester"\nsha256 = "{hash_key(key)}"\n'
    )
    async with cluster(tmp_path, pki, server_extra=router, settle_s=1) as c:
        agent = c.agent("n1")
        await c.wait_ready(1)
        await c.server.wait_log(r"OpenAI-compatible endpoint on http://127\.0\.0\.1:\d+/v1")
        # the router scrapes the replica each second, the agent checks it every two
        await trio.sleep(4)
        assert (await c.wait_ready(1))[0]["state"] == "Ready"
        for daemon in (c.server, agent):
            lines = [x for x in daemon.log().splitlines() if HTTPX_LINE in x]
            assert not lines, f"{daemon.name}: {len(lines)} request lines, e.g. {lines[:3]}"


def test_an_exit_in_words() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(-15) == "killed by signal 15 (SIGTERM)"
    assert describe_exit(-200) == "killed by signal 200"
    # what the control plane reads back from those words
    assert exit_of("engine killed by signal 9 (SIGKILL)") == (None, "SIGKILL")
    assert exit_of("engine exited with code 3") == (3, None)


def _kernel() -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])


def test_the_exit_of_a_process_that_is_not_waited_for() -> None:
    """A zombie's status reads from /proc; a reaped process's from its pidfd."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while (who := identity(proc.pid)) is None or not who.cmdline:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fd = os.pidfd_open(proc.pid)
        try:
            assert zombie_exit(who) is None  # alive
            assert reaped_exit(fd) is None
            os.kill(proc.pid, signal.SIGKILL)
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
            assert zombie_exit(who) == -9
            proc.wait()
            assert zombie_exit(who) is None  # reaped: gone from /proc
            if _kernel() < (6, 15):
                pytest.skip("the kernel keeps a reaped process's status for its pidfd from 6.15")
            assert reaped_exit(fd) == -9
        finally:
            os.close(fd)
    finally:
        proc.kill()
        proc.wait()


@needs_server
@pytest.mark.parametrize("adopted", [False, True], ids=["started", "adopted"])
async def test_an_engine_killed_by_someone_else_says_which_signal(
    tmp_path: Path,
    pki: Pki,
    tiny: Path,  # noqa: F811 (the fixture)
    adopted: bool,
) -> None:
    async with fleet(tmp_path, pki) as f:
        agent = f.start_agent()
        await f.send("n1", StartShard(spec=llama_spec(tiny)))
        ready = await f.status("s1", "ready")
        assert ready.pid is not None
        if adopted:
            await agent.stop(signal.SIGKILL)
            f.registers.clear()
            agent.start()
            await wait_for(lambda: bool(f.registers), timeout=30)
            await agent.wait_log(r"adopted shard s1 \(pid \d+\)")
            assert [s.state for s in f.registers[-1].shards] == ["ready"]
        os.kill(ready.pid, signal.SIGKILL)
        failed = await f.status("s1", "failed")
        assert failed.detail == "engine killed by signal 9 (SIGKILL)"
        await agent.wait_log(r"shard s1 failed: engine killed by signal 9 \(SIGKILL\)")

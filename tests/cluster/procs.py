"""Real ``llmgw`` processes for tests (``tools.support.procs``'s harness: start, read
their logs, signal, time their exit), their configs, and a control plane's views."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from llmgw.agent.procs import identity, terminate_group
from tests.conftest import Pki
from tools.support.procs import TrioProc, llmgw


class Daemon(TrioProc):
    """``python -m llmgw ARGS`` for a test (or ``module``: a test's llmgw with more in
    it), its output in ``workdir/NAME.log``: the tools' process harness, waited on in trio."""

    def __init__(
        self,
        name: str,
        args: list[str],
        workdir: Path,
        env: dict[str, str] | None = None,
        *,
        module: str = "llmgw",
    ) -> None:
        super().__init__(name, llmgw(*args, module=module), workdir, env=env)
        self.args = args
        self.module = module


def write_server_config(
    workdir: Path,
    pki: Pki,
    *,
    stream_port: int = 0,
    heartbeat: float = 0.2,
    unreachable_after: float = 1.0,
    lost_after: float = 2.5,
) -> Path:
    path = workdir / "server.toml"
    path.write_text(
        f"""
state_dir = "state"
[agent_stream]
listen = "127.0.0.1:{stream_port}"
ca = "{pki.ca}"
cert = "{pki.server_cert}"
key = "{pki.server_key}"
handshake_timeout_s = 2
[liveness]
heartbeat_interval_s = {heartbeat}
unreachable_after_s = {unreachable_after}
lost_after_s = {lost_after}
[admin]
listen = "127.0.0.1:0"
"""
    )
    return path


def write_agent_config(
    workdir: Path,
    pki: Pki,
    node: str,
    port: int,
    *,
    cert_node: str | None = None,
    memory_gb: float | None = None,
    extra: str = "",
) -> Path:
    """An agent config; ``extra`` is appended TOML (sections of discovery settings)."""
    cert, key = pki.agent(cert_node or node)
    path = workdir / f"agent-{node}.toml"
    inventory = f"\n[inventory]\nmemory_gb = {memory_gb}\n" if memory_gb else ""
    path.write_text(
        f"""
control_plane = ["127.0.0.1:{port}"]
node_id = "{node}"
ca = "{pki.ca}"
cert = "{cert}"
key = "{key}"
state_dir = "agent-{node}"
handshake_timeout_s = 2
[backoff]
initial_s = 0.1
max_s = 0.5
{inventory}
{extra}"""
    )
    return path


class Server(Daemon):
    stream_port: int
    admin_url: str

    async def ready(self, *, count: int = 1) -> Server:
        m = await self.wait_log(r"agent stream listening on 127\.0\.0\.1:(\d+)", count=count)
        self.stream_port = int(m.group(1))
        m = await self.wait_log(r"admin API listening on (http://\S+)", count=count)
        self.admin_url = m.group(1)
        return self

    async def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        result = await trio.run_process(
            [
                sys.executable,
                "-m",
                "llmgw",
                "ctl",
                *args,
                "--admin-url",
                self.admin_url,
                "--token-file",
                str(self.workdir / "state" / "admin-token"),
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"ctl {args} failed: {result.stderr.decode()}")
        return result

    async def metrics(self) -> str:
        """The control plane's metrics page, as its admin API serves it (to the admin
        token)."""
        token = (self.workdir / "state" / "admin-token").read_text().strip()
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(
                f"{self.admin_url}/metrics", headers={"authorization": f"Bearer {token}"}
            )
        return response.text

    async def nodes(self) -> dict[str, Any]:
        result = await self.ctl("nodes", "--json")
        return {n["node_id"]: n for n in json.loads(result.stdout)["nodes"]}

    async def wait_node(self, node: str, state: str, timeout: float = 15) -> dict[str, Any]:
        with trio.move_on_after(timeout):
            while True:
                nodes = await self.nodes()
                if node in nodes and nodes[node]["state"] == state:
                    return nodes[node]
                await trio.sleep(0.1)
        raise AssertionError(f"{node} never became {state}: {await self.nodes()}\n{self.log()}")


def listening(port: int) -> bool:
    """Something accepts connections on this loopback port."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@asynccontextmanager
async def http_server(port: int) -> AsyncIterator[subprocess.Popen[bytes]]:
    """A process of its own group that answers 200 on ``/``, as an engine's health
    endpoint would, on ``port``; yielded once it listens and /proc describes it."""
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
                if who is not None and who.cmdline and listening(port):
                    break
                await trio.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            await terminate_group(proc.pid, grace=1.0)
        proc.wait(5)


def lasting(pid: int) -> tuple[int, tuple[str, ...]] | None:
    """What stays the same for as long as ``pid`` is the process it was (its start
    time and command line; not its state, 'R' or 'S' by when /proc is read); None
    when it is gone."""
    found = identity(pid)
    return None if found is None else (found.start_time, found.cmdline)


async def workers_route(router: Daemon, routes: int, workers: int = 2, start: int = 1) -> None:
    """Until every worker of a standalone router (started ``start`` times) serves and
    the routing holds ``routes``: each worker past the first says it serves (by then
    its SIGHUP handler is in place), and the routes line has come once per worker
    (two lines of one worker's, for two versions, are not enough alone)."""
    for i in range(1, workers):
        await router.wait_log(rf"router worker {i} serving on", count=start)
    await router.wait_log(rf"routing table now version \w+: {routes} routes", count=workers * start)

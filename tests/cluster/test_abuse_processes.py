"""One client's abuse, through a real ``llmgw server`` and a real engine, while a
well-behaved client keeps asking: that client fails nothing, and the server
holds no more than it should (its RSS and open files read from /proc)."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import trio

from tests.cluster.test_router_processes import routed
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server

MIB = 1024 * 1024
FORGED = "2099-01-01 00:00:00,000 INFO llmgw.router.access: 6.6.6.6:1 POST /v1/x status=200"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@attrs.define
class GoodClient:
    """Asks for a short completion, again and again, on a new connection each time
    (as many independent clients would), until stopped; bounded in count."""

    base: str
    key: str
    requests: int = 0
    failures: list[str] = attrs.Factory(list)

    async def run(self, stop: trio.Event, most: int = 2000) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        headers = {"authorization": f"Bearer {self.key}", "connection": "close"}
        async with httpx.AsyncClient(timeout=20) as client:
            while not stop.is_set() and self.requests < most:
                self.requests += 1
                try:
                    r = await client.post(
                        self.base + "/chat/completions", json=body, headers=headers
                    )
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                await trio.sleep(0.02)


@asynccontextmanager
async def good_client(base: str, key: str) -> AsyncIterator[GoodClient]:
    good = GoodClient(base, key)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(good.run, stop)
        await trio.sleep(0.5)  # it is being served before the attack starts
        yield good
        stop.set()


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1].split("/")[0])


async def send_body_and_stall(port: int, size: int, held: list[trio.SocketStream]) -> None:
    """A request with no key that declares ``size`` bytes of body and sends them all,
    as fast as the server takes them; the connection is then held open, silent."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    held.append(stream)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    chunk = b"x" * (256 * 1024)
    try:
        await stream.send_all(head)
        sent = 0
        while sent < size:
            piece = chunk[: size - sent]
            await stream.send_all(piece)
            sent += len(piece)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server answered and closed: nothing of the body was wanted


async def test_bodies_of_requests_without_a_key_are_never_held(tmp_path: Path, pki: Pki) -> None:
    """Sixty connections with no key, each sending a body as large as the router
    takes (1 MiB here) and then stalling: the server's RSS stays within a few MiB
    (before, it held every body: 60 MiB more), and the good client fails nothing."""
    async with routed(tmp_path, pki) as (c, base, key):
        assert c.server.proc is not None
        pid = c.server.proc.pid
        port = port_of(base)
        held: list[trio.SocketStream] = []
        async with good_client(base, key) as good:
            before = rss_mib(pid)
            peak = before
            with trio.fail_after(60):
                async with trio.open_nursery() as attack:
                    for _ in range(60):
                        attack.start_soon(send_body_and_stall, port, MIB - 1024, held)
                    for _ in range(30):  # 3 s: sampled while the bodies arrive and stall
                        peak = max(peak, rss_mib(pid))
                        await trio.sleep(0.1)
            for _ in range(20):  # and while the connections are held
                peak = max(peak, rss_mib(pid))
                await trio.sleep(0.1)
            served_during = good.requests
        for stream in held:
            await stream.aclose()
    assert good.failures == []
    assert served_during >= 10
    assert peak - before < 8, f"RSS {before:.0f} -> {peak:.0f} MiB"
    log = c.server.log()
    assert log.count("status=401 key=- model=-") >= 60  # each one answered, in the access log


async def test_one_address_holding_connections_shuts_no_one_else_out(
    tmp_path: Path, pki: Pki
) -> None:
    """127.0.0.2 opens more idle connections than the whole server takes: past its
    cap each is refused with a 503 in OpenAI's format, and the good client (from
    127.0.0.1, a new connection per request) and another address are served."""
    limits = "max_connections = 300\nmax_connections_per_address = 100\n"
    async with routed(tmp_path, pki, router_extra=limits) as (c, base, key):
        assert c.server.proc is not None
        pid = c.server.proc.pid
        port = port_of(base)
        fds_before = open_fds(pid)
        flood: list[socket.socket] = []
        refused: list[bytes] = []
        async with good_client(base, key) as good:
            with trio.fail_after(60):
                for _ in range(400):
                    s = socket.socket()
                    s.bind(("127.0.0.2", 0))
                    s.connect(("127.0.0.1", port))  # loopback: at once
                    s.setblocking(False)
                    flood.append(s)
                waiting = list(flood)
                for _ in range(50):  # the refused ones are answered and closed at once
                    for s in list(waiting):
                        try:
                            refused.append(s.recv(4096))
                        except BlockingIOError:
                            continue
                        waiting.remove(s)
                    if len(refused) >= 300:
                        break
                    await trio.sleep(0.1)
                fds_during = open_fds(pid)
                # another address is served too
                async with httpx.AsyncClient(
                    timeout=10, transport=httpx.AsyncHTTPTransport(local_address="127.0.0.3")
                ) as third:
                    r = await third.post(
                        base + "/chat/completions",
                        json={
                            "model": "tiny",
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2,
                        },
                        headers={"authorization": f"Bearer {key}"},
                    )
                    assert r.status_code == 200, r.text
                await trio.sleep(2)  # the good client keeps asking meanwhile
                served_during = good.requests
        for s in flood:
            s.close()
    assert good.failures == []
    assert served_during >= 20
    assert len(refused) == 300
    head, _, body = refused[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and "param" in error and "code" in error
    assert error["message"].startswith("too many connections from your address")
    assert fds_during - fds_before <= 100 + 20  # the capped ones, and the good clients'
    assert "holds 100 connections, the limit per address" in c.server.log()


async def test_a_path_or_a_model_with_a_newline_forges_no_log_line(
    tmp_path: Path, pki: Pki
) -> None:
    """With no key, a path whose %0a decodes to a newline; with a key, a model that
    holds one: each stays on its own access log line, escaped."""
    forged_path = "/v1/nothing%0a" + FORGED.replace(" ", "%20")
    async with routed(tmp_path, pki) as (c, base, key):
        root = base.removesuffix("/v1")
        async with good_client(base, key) as good, httpx.AsyncClient(timeout=10) as raw:
            r = await raw.get(root + forged_path)
            assert r.status_code == 404
            r = await raw.post(
                base + "/chat/completions",
                json={"model": "tiny\n" + FORGED, "messages": []},
                headers={"authorization": f"Bearer {key}"},
            )
            assert r.status_code == 404
            r = await raw.post(base + "/chat/completions%0d%0a" + FORGED.replace(" ", "%20"))
            assert r.status_code == 404
        await trio.sleep(0.2)
        log = c.server.log()
    assert good.failures == []
    lines = log.splitlines()
    assert not [line for line in lines if line.startswith("2099-")], log[-3000:]
    escaped = FORGED.replace(" ", "\\x20")
    assert any(f"GET /v1/nothing\\x0a{escaped} status=404 key=- model=-" in line for line in lines)
    assert any(f"status=404 key=tester model=tiny\\x0a{escaped} " in line for line in lines)
    assert any(f"/v1/chat/completions\\x0d\\x0a{escaped} status=404" in line for line in lines)

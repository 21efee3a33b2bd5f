"""A node's reports are checked against what was placed: real processes (a server with
its router, agents, llama-server), and a lying agent with a valid certificate of its
own, speaking the real protocol over the real TLS stream, with a fake engine of its own.

Before, the control plane believed whatever a node reported: another node's shard ids
moved that node's replicas to the liar, and a replica the liar made up was routed to
its fake engine at once."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import msgspec
import openai
import trio
from trio_websocket import WebSocketConnection, wrap_client_stream

from llmgw.http import Request, Response
from llmgw.protocol import SUBPROTOCOL, decode, encode
from llmgw.protocol.messages import (
    Heartbeat,
    Inventory,
    Register,
    RegisterAck,
    ShardReport,
    ShardSpec,
    ShardStatus,
    StopShard,
)
from llmgw.tls import client_context
from llmgw.wsio import single_error
from tests.cluster.procs import lasting
from tests.cluster.test_control_plane_processes import Cluster, engine_pid
from tests.cluster.test_router_processes import admin_metrics, routed
from tests.conftest import Pki
from tests.realparts import needs_server
from tests.router.test_app import serve

pytestmark = needs_server

MARK = "an answer from the liar's fake engine"


@attrs.define
class FakeEngine:
    """An engine that is not one: it answers chats with ``MARK``, and ``/v1/models``
    as llama-server would (401 without its key) unless ``keyless``."""

    key: str
    keyless: bool = False
    seen: list[str] = attrs.Factory(list)

    async def __call__(self, request: Request) -> Response:
        self.seen.append(f"{request.method} {request.path}")
        auth = dict(request.headers).get("authorization", "")
        if not self.keyless and auth != f"Bearer {self.key}":
            return Response(401, [("content-type", "application/json")], b'{"error":"no"}')
        if request.path == "/v1/models":
            body = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        else:
            body = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "tiny",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": MARK},
                        "finish_reason": "stop",
                    }
                ],
            }
        return Response(200, [("content-type", "application/json")], json.dumps(body).encode())

    def chats(self) -> int:
        return sum(1 for s in self.seen if s.endswith("/chat/completions"))


@attrs.define
class Liar:
    ws: WebSocketConnection
    down: list[object] = attrs.Factory(list)

    def stopped(self) -> set[str]:
        return {m.shard_id for m in self.down if isinstance(m, StopShard)}


@asynccontextmanager
async def lying_agent(
    pki: Pki, port: int, node: str, shards: list[ShardReport]
) -> AsyncIterator[Liar]:
    """An agent with a valid certificate for ``node`` that registers ``shards`` as its
    own, heartbeats as it is told, and keeps every command it is sent (obeying none)."""
    cert, key = pki.agent(node)
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, client_context(pki.ca, cert, key), server_hostname="127.0.0.1")
    with single_error():
        async with trio.open_nursery() as nursery:
            with trio.fail_after(5):
                ws = await wrap_client_stream(
                    nursery, tls, "127.0.0.1", "/agent", subprotocols=[SUBPROTOCOL]
                )
                inventory = Inventory(hostname=f"{node}-host", address="127.0.0.1")
                await ws.send_message(
                    encode(Register(node_id=node, inventory=inventory, shards=shards))
                )
                ack = decode(await ws.get_message())
                assert isinstance(ack, RegisterAck), ack
            liar = Liar(ws)

            async def heartbeats() -> None:
                for seq in range(1, 1_000_000):
                    await trio.sleep(ack.heartbeat_interval_s)
                    await ws.send_message(encode(Heartbeat(seq=seq, sent_at=time.time())))

            async def listen() -> None:
                while True:
                    liar.down.append(decode(await ws.get_message()))

            nursery.start_soon(heartbeats)
            nursery.start_soon(listen)
            yield liar
            nursery.cancel_scope.cancel()


def stolen(tmp: Path, node: str, shard_id: str) -> ShardSpec:
    """A shard's spec as its agent keeps it (a liar who got hold of it)."""
    path = tmp / f"agent-{node}" / "shards" / f"{shard_id}.json"
    return msgspec.convert(json.loads(path.read_text())["spec"], ShardSpec)


async def chats(base: str, key: str, n: int) -> list[str]:
    """``n`` chats through the router, one after the other; what each answered."""
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
    out = []
    for _ in range(n):
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        out.append(reply.choices[0].message.content or "")
    return out


async def test_a_node_reporting_another_nodes_shards_moves_nothing(
    tmp_path: Path, pki: Pki, nursery: trio.Nursery
) -> None:
    async with routed(tmp_path, pki, replicas=2) as (c, base, key):
        before = {s["shard_id"]: s for r in await c.wait_ready(2) for s in r["shards"]}
        assert {s["node_id"] for s in before.values()} == {"n1", "n2"}
        pids = {sid: engine_pid(tmp_path, s["node_id"], sid) for sid, s in before.items()}
        starts = {pid: lasting(pid) for pid in pids.values()}
        fake = FakeEngine("k-liar")
        fake_port = await serve(nursery, fake)
        # one spec stolen as it is (it names its node), one with its node and seal cut off
        reports = []
        for i, (sid, s) in enumerate(sorted(before.items())):
            spec = stolen(tmp_path, s["node_id"], sid)
            if i == 1:
                spec = msgspec.structs.replace(spec, node_id="", seal="")
            reports.append(
                ShardReport(
                    spec=msgspec.structs.replace(spec, host="127.0.0.1", port=fake_port),
                    state="ready",
                    pid=1234567,
                    engine_key="k-liar",
                )
            )
        async with lying_agent(pki, c.server.stream_port, "n3", reports) as liar:
            await c.server.wait_log(r"node n3 registered")
            # and what it says of them afterwards changes nothing either
            for sid in before:
                failed = ShardStatus(shard_id=sid, state="failed", detail="lies", pid=1234567)
                await liar.ws.send_message(encode(failed))
            await trio.sleep(1.5)  # passes run, routing is published
            answers = await chats(base, key, 20)
            assert MARK not in answers, f"{answers.count(MARK)} of 20 answered by the liar"
            assert fake.seen == []
            for sid, s in before.items():
                await c.server.wait_log(
                    rf"WARNING .*node n3 reported shard {sid}, which is node {s['node_id']}'s: "
                )
            # the liar is told to stop its copies (on its own node); nothing else moves
            with trio.fail_after(10):
                while liar.stopped() != set(before):
                    await trio.sleep(0.1)
            after = {s["shard_id"]: s for r in await c.wait_ready(2) for s in r["shards"]}
            assert {sid: (s["node_id"], s["port"]) for sid, s in after.items()} == {
                sid: (s["node_id"], s["port"]) for sid, s in before.items()
            }
            assert {pid: lasting(pid) for pid in pids.values()} == starts
            samples = await admin_metrics(c)
            assert samples("llmgw_report_conflicts_total", node="n3") >= 2
        log = c.server.log()
        for sid in before:  # said once, not at every heartbeat
            assert log.count(f"node n3 reported shard {sid},") == 1, log


async def restart_server(c: Cluster) -> str:
    """SIGKILL the server and start it again on the same stream port; its router's
    new base URL."""
    await c.server.stop(signal.SIGKILL)
    config = c.tmp / "server.toml"
    config.write_text(
        config.read_text().replace(
            'listen = "127.0.0.1:0"\nca =',
            f'listen = "127.0.0.1:{c.server.stream_port}"\nca =',
            1,
        )
    )
    c.server.start()
    await c.server.ready(count=2)
    m = await c.server.wait_log(
        r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)", count=2
    )
    return m.group(1)


async def test_an_adopted_engine_that_is_not_what_was_reported_is_not_routed(
    tmp_path: Path, pki: Pki, nursery: trio.Nursery
) -> None:
    async with routed(tmp_path, pki, replicas=1) as (c, base, key):
        [real] = await c.wait_ready(1)
        # the control plane restarts while n1's agent is away: what it learns first is
        # the liar's replica, whose engine answers without the key it reported
        await c.agents["n1"].stop(signal.SIGKILL)
        base = await restart_server(c)
        fake = FakeEngine("k-liar", keyless=True)
        fake_port = await serve(nursery, fake)
        spec = ShardSpec(
            shard_id="tiny-fake-1-0",
            replica_id="tiny-fake-1",
            model="tiny",
            profile="cpu",
            engine="llama.cpp",
            host="127.0.0.1",
            port=fake_port,
            node_id="n3",
        )
        report = ShardReport(spec=spec, state="ready", pid=1234567, engine_key="k-liar")
        async with lying_agent(pki, c.server.stream_port, "n3", [report]):
            await c.server.wait_log(r"node n3 registered")
            await trio.sleep(1.5)  # passes run, routing is published
            answered: list[str] = []
            with contextlib.suppress(openai.APIStatusError):  # 503: nothing to route to
                answered = await chats(base, key, 1)
            assert MARK not in answered, "the liar's made-up replica was routed to"
            assert answered == [], answered
            with trio.fail_after(20):
                while True:
                    table = (await c.server.ctl("replicas")).stdout.decode()
                    if "without the key its node reported" in table:
                        break
                    await trio.sleep(0.2)
            row = next(x for x in table.splitlines() if x.startswith("tiny-fake-1 "))
            assert "Ready,unverified" in row, table
            assert (
                "tiny-fake-1 shard tiny-fake-1-0 on n3 is not routed: its engine answers 200 "
                "without the key its node reported"
            ) in table, table
            await c.server.wait_log(
                r"WARNING .*replica tiny-fake-1: shard tiny-fake-1-0 on n3 is not routed: "
                rf"its engine at port {fake_port} answers 200 without the key"
            )

            # the real agent comes back: its engine is adopted, probed, and serves
            c.agents["n1"].start()
            with trio.fail_after(30):
                while True:
                    ready = await c.wait_ready(1, replica_id=real["replica_id"])
                    if ready[0]["verified"]:
                        break
                    await trio.sleep(0.2)
            with trio.fail_after(20):
                while True:
                    try:
                        answers = await chats(base, key, 10)
                        break
                    except openai.APIStatusError as exc:
                        if exc.status_code != 503:  # until the router holds it
                            raise
                        await trio.sleep(0.2)
            assert MARK not in answers
            assert fake.chats() == 0, fake.seen

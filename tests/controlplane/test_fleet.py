"""The fleet manager over the real agent stream (real control plane, TLS on loopback)."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from trio_websocket import WebSocketConnection, wrap_client_stream
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Message, Request

from llmgw.admin.api import AdminApi
from llmgw.controlplane.catalog import parse_catalog
from llmgw.controlplane.dispatcher import NodeNotConnected
from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.reconciler import Timing
from llmgw.http import HttpServer
from llmgw.protocol import SUBPROTOCOL, State, decode, encode
from llmgw.protocol.messages import (
    AnyMessage,
    Engine,
    Inventory,
    Register,
    RegisterAck,
    ShardStatus,
    StartShard,
    StopShard,
)
from llmgw.tls import client_context
from llmgw.wsio import single_error
from tests.conftest import Pki
from tests.stream.harness import Plane, control_plane, wait_for

HEARTBEAT_S = 0.5  # the harness's send timeout is 1 s: a serial send to a stalled node is late

CATALOG = """
[models.first]
replicas = 1
[[models.first.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/models/first.gguf"
selector = { node = "n1" }

[models.second]
replicas = 1
[[models.second.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/models/second.gguf"
selector = { node = "n2" }
"""


def _stall_bytes() -> int:
    """More than the kernel can buffer towards an agent that reads nothing: the most a
    socket's send buffer may grow to, and then some (the agent's own receive buffer is
    pinned small)."""
    try:
        most = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        most = 4 << 20
    return most + (2 << 20)


def _register(node: str) -> bytes:
    inventory = Inventory(engines=[Engine(name="llama.cpp", version="b1")], labels={"node": node})
    return encode(Register(node_id=node, inventory=inventory))


def _decode(data: str | bytes) -> AnyMessage:
    assert isinstance(data, bytes), "the control plane sends binary messages only"
    return decode(data)


@asynccontextmanager
async def agent_ws(plane: Plane, node: str) -> AsyncIterator[WebSocketConnection]:
    """A hand-driven agent that has registered (its ack read), on a real TLS stream."""
    cert, key = plane.pki.agent(node)
    tcp = await trio.open_tcp_stream("127.0.0.1", plane.port)
    tls = trio.SSLStream(tcp, client_context(plane.pki.ca, cert, key), server_hostname="127.0.0.1")
    with single_error(), trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(
                nursery, tls, "127.0.0.1", "/agent", subprotocols=[SUBPROTOCOL]
            )
            await ws.send_message(_register(node))
            assert isinstance(_decode(await ws.get_message()), RegisterAck)
            yield ws
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def stalled_agent(plane: Plane, node: str) -> AsyncIterator[None]:
    """An agent that registers, reads its ack, and then reads nothing more from its socket.

    Written on wsproto rather than trio-websocket, whose reader task would go on
    draining the socket whether or not anyone asks for messages; its receive buffer
    is pinned small, before connecting, so that the window it advertises stays small.
    """
    cert, key = plane.pki.agent(node)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with trio.fail_after(5):
        await sock.connect(("127.0.0.1", plane.port))
        tls = trio.SSLStream(
            trio.SocketStream(sock),
            client_context(plane.pki.ca, cert, key),
            server_hostname="127.0.0.1",
        )
        ws = WSConnection(ConnectionType.CLIENT)
        await tls.send_all(
            ws.send(Request(host="127.0.0.1", target="/agent", subprotocols=[SUBPROTOCOL]))
        )
        ack: bytes | None = None
        received = b""
        while ack is None:
            data = await tls.receive_some(65536)
            assert data, "the control plane closed the stream during registration"
            ws.receive_data(bytes(data))
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    await tls.send_all(ws.send(Message(data=_register(node))))
                elif isinstance(event, BytesMessage):
                    received += event.data
                    if event.message_finished:
                        ack = received
        assert isinstance(decode(ack), RegisterAck)
    try:
        yield
    finally:
        await trio.aclose_forcefully(tls)


async def test_an_agent_that_stops_reading_does_not_delay_commands_to_other_nodes(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """n1 stops reading its stream; the pass that starts a replica on n1 and one on n2
    still gets n2's StartShard there within one heartbeat (n1's start, which can never
    be delivered, is the first command of the pass). n1's own stream is closed once its
    send times out, and the log says why."""
    caplog.set_level(logging.INFO)
    catalog = parse_catalog(CATALOG, "catalog.toml")
    # n1's start carries more than the kernel buffers, so the send to n1 really blocks
    first = catalog.models["first"]
    big = msgspec.structs.replace(first.profiles[0], env={"PAD": "x" * _stall_bytes()})
    catalog = msgspec.structs.replace(
        catalog,
        models={**catalog.models, "first": msgspec.structs.replace(first, profiles=[big])},
    )
    async with control_plane(
        pki, heartbeat=HEARTBEAT_S, unreachable_after=30, lost_after=60
    ) as plane:
        fleet = FleetManager(plane.control, catalog, timing=Timing(settle_s=0))
        async with (
            stalled_agent(plane, "n1"),
            agent_ws(plane, "n2") as n2,
            trio.open_nursery() as nursery,
        ):
            # both registered before the fleet runs: its first pass, at once (the
            # registrations woke it), starts both replicas in one plan
            started = trio.current_time()
            await nursery.start(fleet.run)
            arrived: float | None = None
            with trio.move_on_after(5):
                while arrived is None:
                    message = _decode(await n2.get_message())
                    if isinstance(message, StartShard):
                        assert message.spec.model == "second"
                        arrived = trio.current_time() - started
            assert arrived is not None, "n2 never got its StartShard"
            assert arrived < HEARTBEAT_S, (
                f"n2's StartShard arrived {arrived:.2f} s after the pass began, more than one "
                f"heartbeat ({HEARTBEAT_S:g} s): it waited behind the send to n1, which reads nothing"
            )
            # the stall was real: n1's send timed out, and its stream is closed
            await wait_for(lambda: not plane.control.dispatcher.connected("n1"), timeout=5)
            assert "not sent: n1 did not take a message within 1 s" in caplog.text
            nursery.cancel_scope.cancel()


async def test_a_replica_that_fails_is_one_warning_in_the_fleet_log(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """The reconciler logs nothing; the fleet manager logs its notes, a failure as a
    warning, once."""
    caplog.set_level(logging.INFO)
    catalog = parse_catalog(CATALOG, "catalog.toml")
    async with control_plane(
        pki, heartbeat=HEARTBEAT_S, unreachable_after=30, lost_after=60
    ) as plane:
        fleet = FleetManager(plane.control, catalog, timing=Timing(settle_s=0))
        async with agent_ws(plane, "n2") as n2, trio.open_nursery() as nursery:
            await nursery.start(fleet.run)
            with trio.fail_after(5):
                message = _decode(await n2.get_message())
            assert isinstance(message, StartShard)
            shard = message.spec.shard_id
            await n2.send_message(encode(ShardStatus(shard_id=shard, state="starting")))
            await n2.send_message(
                encode(ShardStatus(shard_id=shard, state="failed", detail="engine exited 1"))
            )

            def failures() -> list[logging.LogRecord]:
                return [r for r in caplog.records if " failed: " in r.getMessage()]

            await wait_for(lambda: any(r.name.endswith("fleet") for r in failures()))
            await trio.sleep(0.2)  # a second line, if there were one, would be there by now
            nursery.cancel_scope.cancel()
    lines = [
        (r.name, r.levelname, r.getMessage())
        for r in failures()
        if r.getMessage().startswith("replica ")
    ]
    assert lines == [
        (
            "llmgw.controlplane.fleet",
            "WARNING",
            f"replica {message.spec.replica_id} failed: shard {shard} on n2 failed: "
            "engine exited 1",
        )
    ]


async def test_how_an_engine_ended_is_read_from_the_numbers_and_from_an_older_agents_words(
    pki: Pki,
) -> None:
    """A failed status with ``signal`` is shown by it, whatever its words say; one from an
    agent older than the numbers is read from its words, as before. Read where the
    operator reads it: the admin API's models view and ``ctl replicas --failures``."""
    from llmgw.admin.views import ModelList
    from llmgw.cli.render import render_failures

    catalog = parse_catalog(CATALOG, "catalog.toml")
    async with control_plane(
        pki, heartbeat=HEARTBEAT_S, unreachable_after=30, lost_after=60
    ) as plane:
        timing = Timing(settle_s=0, retry_base_s=0.1, retry_cap_s=0.1)
        fleet = FleetManager(plane.control, catalog, timing=timing)
        admin = HttpServer(AdminApi(plane.control, "t0ken", fleet))
        async with agent_ws(plane, "n2") as n2, trio.open_nursery() as nursery:
            listeners = await nursery.start(admin.serve_tcp, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1/models"
            await nursery.start(fleet.run)

            async def fail(**how: object) -> dict[str, object]:
                with trio.fail_after(5):
                    while not isinstance(message := _decode(await n2.get_message()), StartShard):
                        pass
                shard = message.spec.shard_id
                await n2.send_message(encode(ShardStatus(shard_id=shard, state="starting")))
                await n2.send_message(encode(ShardStatus(shard_id=shard, state="failed", **how)))
                with trio.fail_after(5):
                    async with httpx.AsyncClient(timeout=5) as client:
                        while True:
                            r = await client.get(url, headers={"authorization": "Bearer t0ken"})
                            data = r.json()
                            (second,) = [m for m in data["models"] if m["model"] == "second"]
                            said = [f for f in second["failures"] if f["shard_id"] == shard]
                            if said:
                                rendered = render_failures(msgspec.convert(data, ModelList).models)
                                return {"rendered": rendered, **said[0]}
                            await trio.sleep(0.05)

            got = await fail(detail="engine gave up", signal=9)
            assert (got["exit_code"], got["signal"]) == (None, "SIGKILL")
            assert "signal SIGKILL" in str(got["rendered"])
            got = await fail(detail="engine gave up", exit_code=3)
            assert (got["exit_code"], got["signal"]) == (3, None)
            got = await fail(detail="engine exited with code 4")  # an older agent
            assert (got["exit_code"], got["signal"]) == (4, None)
            nursery.cancel_scope.cancel()


async def test_a_replica_the_routers_hold_wedged_is_restarted_after_the_grace(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A router says, with every poll, that a Ready replica has work and makes no
    progress: after the wedged grace its agent is told to stop it (one warning says
    why) and a new one is started; nothing happens before the grace."""
    caplog.set_level(logging.INFO)
    catalog = parse_catalog(CATALOG, "catalog.toml")
    async with control_plane(
        pki, heartbeat=HEARTBEAT_S, unreachable_after=30, lost_after=60
    ) as plane:
        fleet = FleetManager(plane.control, catalog, timing=Timing(settle_s=0, wedged_grace_s=1.0))
        async with agent_ws(plane, "n2") as n2, trio.open_nursery() as nursery:
            await nursery.start(fleet.run)
            with trio.fail_after(5):
                start = _decode(await n2.get_message())
            assert isinstance(start, StartShard)
            shard, replica = start.spec.shard_id, start.spec.replica_id
            await n2.send_message(encode(ShardStatus(shard_id=shard, state="starting")))
            await n2.send_message(encode(ShardStatus(shard_id=shard, state="ready")))
            await wait_for(lambda: fleet.reconciler.replicas[replica].state.value == "Ready")
            said_at = trio.current_time()

            async def router_polls() -> None:
                while True:
                    fleet.routers.report_wedged("r1", frozenset({replica}), trio.current_time())
                    await trio.sleep(0.1)

            nursery.start_soon(router_polls)
            with trio.fail_after(10):
                stop = _decode(await n2.get_message())
            assert isinstance(stop, StopShard) and stop.shard_id == shard
            assert trio.current_time() - said_at >= 1.0  # not before the grace
            with trio.fail_after(10):
                again = _decode(await n2.get_message())
            assert isinstance(again, StartShard) and again.spec.model == "second"
            assert again.spec.replica_id != replica
            nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if "wedged" in r.getMessage()]
    assert said == [
        f"replica {replica} failed: wedged: its router saw requests in flight and no "
        "progress, for 1 s past its wedged limit; restarting it"
    ], said


async def test_a_command_to_a_stream_whose_session_just_failed_is_not_sent(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Between a session failing (a bad message from the agent) and its handler
    detaching it, a command for that node must read as "not connected": any other
    error would end the outbox's task, and with it the fleet manager and the
    server."""
    caplog.set_level(logging.INFO)
    catalog = parse_catalog(CATALOG, "catalog.toml")
    async with (
        control_plane(pki, heartbeat=HEARTBEAT_S, unreachable_after=30, lost_after=60) as plane,
        agent_ws(plane, "n2"),
    ):
        conn = plane.control.dispatcher.connections["n2"]
        conn.session.state = State.ERROR  # as the handler leaves it, before it detaches
        with pytest.raises(NodeNotConnected, match="n2 is closing"):
            await plane.control.dispatcher.send("n2", StopShard(shard_id="s1"))
        fleet = FleetManager(plane.control, catalog, timing=Timing(settle_s=0))
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(fleet.run)  # places "first" on n2: its start is not sent
                await wait_for(lambda: "not sent: stream to n2 is closing" in caplog.text)
                nursery.cancel_scope.cancel()


async def test_the_admin_node_view_counts_the_shards_placed_since_registration(pki: Pki) -> None:
    """A node registers running nothing; once a replica is placed on it, the admin
    API's node view counts that shard (it once showed the registration's count)."""
    catalog = parse_catalog(CATALOG, "catalog.toml")
    async with control_plane(
        pki, heartbeat=HEARTBEAT_S, unreachable_after=30, lost_after=60
    ) as plane:
        fleet = FleetManager(plane.control, catalog, timing=Timing(settle_s=0))
        admin = HttpServer(AdminApi(plane.control, "t0ken", fleet))
        async with agent_ws(plane, "n2") as n2, trio.open_nursery() as nursery:
            listeners = await nursery.start(admin.serve_tcp, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1/nodes"
            await nursery.start(fleet.run)
            with trio.fail_after(5):
                assert isinstance(_decode(await n2.get_message()), StartShard)
            async with httpx.AsyncClient(timeout=5) as client:
                r = await client.get(url, headers={"authorization": "Bearer t0ken"})
            assert [(n["node_id"], n["shards"]) for n in r.json()["nodes"]] == [("n2", 1)]
            nursery.cancel_scope.cancel()

"""The agent stream over real TLS on loopback: registration, liveness, refusals.

Each bad-input test keeps a healthy agent connected beside the bad client and
checks that it is still heartbeating afterwards: one bad peer must cost the
fleet nothing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import msgspec
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected

from llmgw.agent.stream import AgentStream
from llmgw.controlplane.nodes import NodeState
from llmgw.protocol import CloseCode, encode
from llmgw.protocol.messages import Heartbeat, Inventory, Register
from llmgw.tls import client_context, issue_server, load_ca
from tests.conftest import Pki
from tests.stream.harness import Plane, bare_client_context, control_plane, raw_ws, wait_for


@asynccontextmanager
async def running(plane: Plane, agent: AgentStream) -> AsyncIterator[AgentStream]:
    await agent.source.refresh()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent.run)
        yield agent
        nursery.cancel_scope.cancel()


async def heartbeating(plane: Plane, node: str) -> None:
    """Wait until the node has heartbeated twice more from now."""
    n = plane.control.nodes.nodes
    await wait_for(lambda: node in n and n[node].state is NodeState.READY, what=f"{node} Ready")
    seq = n[node].last_heartbeat_seq
    await wait_for(lambda: n[node].last_heartbeat_seq >= seq + 2, what=f"{node} heartbeats")


@asynccontextmanager
async def with_healthy_neighbour(pki: Pki, **kw: float) -> AsyncIterator[Plane]:
    async with control_plane(pki, **kw) as plane, running(plane, plane.agent("n2")):
        await heartbeating(plane, "n2")
        yield plane
        await heartbeating(plane, "n2")
        assert plane.control.dispatcher.connected("n2")


async def test_agent_registers_and_memory_reaches_the_node_table(pki: Pki) -> None:
    async with control_plane(pki) as plane:
        agent = plane.agent("n1", memory_gb=24)
        async with running(plane, agent):
            await heartbeating(plane, "n1")
            node = plane.control.nodes.nodes["n1"]
            assert node.inventory.memory.total_bytes == 24 * 2**30
            assert node.inventory.cpus is not None
            assert node.address == "127.0.0.1"  # the route to the control plane
            assert agent.registrations == 1


async def test_identity_mismatch_is_refused_with_both_names(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with with_healthy_neighbour(pki) as plane:
        liar = plane.agent("n3", cert=pki.agent("n1"))
        with trio.fail_after(5):
            accepted = await liar.session("127.0.0.1", plane.port)
        assert not accepted
        assert plane.refusals("IdentityMismatch") == 1
        assert "n3" not in plane.control.nodes.nodes
    agent_log = [r.getMessage() for r in caplog.records if r.name == "llmgw.agent"]
    server_log = [r.getMessage() for r in caplog.records if r.name.startswith("llmgw.controlplane")]
    claim = "certificate is for 'n1' but agent claims node id 'n3'"
    assert any("refused this agent" in m and claim in m for m in agent_log), agent_log
    assert any("refused agent stream" in m and claim in m for m in server_log), server_log


async def test_refused_agent_keeps_backing_off(pki: Pki) -> None:
    async with control_plane(pki) as plane:
        liar = plane.agent("n3", cert=pki.agent("n1"), backoff=0.01)
        async with running(plane, liar):
            await wait_for(lambda: liar.sessions_started >= 4)
        assert liar.registrations == 0
        assert liar.backoff.attempt >= 3  # a refusal never resets the backoff


@pytest.mark.parametrize(
    ("which", "reason"),
    [("foreign", "tls"), ("expired", "tls")],
)
async def test_bad_client_certificates_are_refused(
    pki: Pki, which: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cert = pki.foreign_agent("n1") if which == "foreign" else pki.expired_agent("n1")
    async with with_healthy_neighbour(pki) as plane:
        bad = plane.agent("n1", cert=cert)
        with trio.fail_after(5):
            assert not await bad.session("127.0.0.1", plane.port)
        await wait_for(lambda: plane.refusals(reason) == 1)
        assert "n1" not in plane.control.nodes.nodes
    server = " ".join(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert "certificate" in server.lower(), server


async def test_client_without_certificate_is_refused_not_hung(pki: Pki) -> None:
    async with with_healthy_neighbour(pki) as plane:
        agent = plane.agent("n1")
        object.__setattr__(agent.settings, "ssl_context", bare_client_context(pki))
        with trio.fail_after(5):
            assert not await agent.session("127.0.0.1", plane.port)
        await wait_for(lambda: plane.refusals("tls") == 1)


async def test_plaintext_clients_are_refused(pki: Pki) -> None:
    # The neighbour's own first handshake may run past this short deadline on
    # a busy machine and be refused once before it connects, so each check
    # counts refusals from just before its client, once the neighbour is in.
    async with with_healthy_neighbour(pki, handshake_timeout=0.3) as plane:
        # speaks HTTP without TLS
        tls = plane.refusals("tls")
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream("127.0.0.1", plane.port)
            await stream.send_all(b"GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n")
            with pytest.raises(trio.BrokenResourceError):  # noqa: PT012
                while await stream.receive_some(1024):
                    pass
                raise trio.BrokenResourceError
        await wait_for(lambda: plane.refusals("tls") == tls + 1)
        # says nothing at all: refused by the handshake deadline
        timeouts = plane.refusals("tls_timeout")
        with trio.fail_after(5):
            silent = await trio.open_tcp_stream("127.0.0.1", plane.port)
            assert await silent.receive_some(1024) == b""
        await wait_for(lambda: plane.refusals("tls_timeout") == timeouts + 1)


async def test_an_agent_that_does_not_trust_the_server_says_why_and_so_does_the_server(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with with_healthy_neighbour(pki) as plane:
        doubter = plane.agent("n1")
        foreign_ca = pki.other_ca_dir / "ca.pem"
        settings = attrs.evolve(
            doubter.settings,
            ssl_context=client_context(foreign_ca, *pki.agent("n1")),
            ca_file=str(foreign_ca),
        )
        object.__setattr__(doubter, "settings", settings)
        with trio.fail_after(5):
            assert not await doubter.session("127.0.0.1", plane.port)
        await wait_for(lambda: plane.refusals("tls") == 1)
    agent_log = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    server_log = [r.getMessage() for r in caplog.records if r.name.startswith("llmgw.controlplane")]
    assert agent_log == [
        f"control plane 127.0.0.1:{plane.port} presented a certificate that is not signed by"
        f" the CA in {foreign_ca} (this agent's ca): give the agent the ca.pem of the CA that"
        " issued the server's certificate, or issue the server one from this CA with"
        " llmgw ctl cert server 127.0.0.1 --dir pki"
    ]
    assert any(
        m.startswith("agent from 127.0.0.1:")
        and m.endswith(
            "dropped the TLS handshake: it probably does not trust this server's certificate"
            " (see the agent's log)"
        )
        for m in server_log
    ), server_log


async def test_a_name_mismatch_names_what_the_certificate_holds(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Dialed at an address its certificate lacks: the agent reads the certificate's
    names over a second handshake that checks the CA only, and the server lets that
    connection go at once."""
    caplog.set_level(logging.INFO)
    cert, key = issue_server(load_ca(pki.dir), ["cp.example.net", "10.9.9.9"], tmp_path)
    elsewhere = attrs.evolve(pki, server_cert=cert, server_key=key)
    async with control_plane(elsewhere, handshake_timeout=0.5) as plane:
        agent = plane.agent("n1")
        settings = attrs.evolve(
            agent.settings,
            name_probe_context=client_context(pki.ca, *pki.agent("n1"), check_name=False),
        )
        object.__setattr__(agent, "settings", settings)
        with trio.fail_after(5):
            assert not await agent.session("127.0.0.1", plane.port)
        await trio.sleep(1)  # past the upgrade deadline: the probe was let go at once
        assert plane.refusals("upgrade_timeout") == 0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert said == [
        f"control plane 127.0.0.1:{plane.port} presented a certificate that is not valid for"
        " 127.0.0.1 (it holds cp.example.net, 10.9.9.9): issue one that holds every name and"
        " address agents dial, with llmgw ctl cert server 127.0.0.1 cp.example.net 10.9.9.9"
        " --dir pki"
    ]


async def test_a_connection_that_says_nothing_is_not_an_agent_dropping_tls(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with control_plane(pki) as plane:
        with trio.fail_after(5):
            tcp = await trio.open_tcp_stream("127.0.0.1", plane.port)
            await tcp.aclose()
        await wait_for(lambda: plane.refusals("tls") == 1)
    assert "it closed the connection before any TLS handshake" in caplog.text
    assert "dropped the TLS handshake" not in caplog.text


async def test_wrong_protocol_version_is_rejected_during_upgrade(pki: Pki) -> None:
    async with with_healthy_neighbour(pki) as plane:
        with trio.fail_after(5), pytest.raises(ConnectionRejected) as info:
            async with raw_ws(plane, subprotocols=["llmgw.agent.v9"]):
                pass
        assert info.value.status_code == 400
        assert b"speaks llmgw.agent.v9; this control plane speaks llmgw.agent.v1" in (
            info.value.body or b""
        )
        assert plane.refusals("version") == 1


def _register(node: str = "n3") -> bytes:
    return encode(Register(node_id=node, inventory=Inventory()))


# a MessagePack map {"type": "Heartbeat", "x": <what follows>}
_HEARTBEAT_X = b"\x82\xa4type\xa9Heartbeat\xa1x"


@pytest.mark.parametrize(
    ("frames", "code", "reason"),
    [
        ([b"\xc1\x00garbage"], CloseCode.MALFORMED, "MalformedMessage"),
        (
            [msgspec.msgpack.encode({"type": "Reboot"})],
            CloseCode.UNKNOWN_TYPE,
            "UnknownMessageType",
        ),
        ([b"\x00" * 70_000], CloseCode.MESSAGE_TOO_BIG, "MessageTooLarge"),
        ([encode(Heartbeat(seq=1, sent_at=0))], CloseCode.OUT_OF_ORDER, "OutOfOrder"),
        ([_register(), _register()], CloseCode.OUT_OF_ORDER, "OutOfOrder"),
        (["text, not binary"], CloseCode.MALFORMED, "MalformedMessage"),
        # a field nesting arrays 5,000 deep (the decoder's recursion: never a crash)
        ([_HEARTBEAT_X + b"\x91" * 5000 + b"\xc0"], CloseCode.MALFORMED, "MalformedMessage"),
    ],
    ids=[
        "malformed",
        "unknown-tag",
        "too-large",
        "heartbeat-first",
        "register-twice",
        "text",
        "deep",
    ],
)
async def test_bad_messages_close_with_a_code_and_reason(
    pki: Pki, frames: list[bytes | str], code: CloseCode, reason: str
) -> None:
    async with with_healthy_neighbour(pki) as plane:
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as info:  # noqa: PT012
            async with raw_ws(plane) as ws:
                for frame in frames:
                    await ws.send_message(frame)
                while True:
                    await ws.get_message()
        assert info.value.reason.code == code
        assert info.value.reason.reason  # always says why
        await wait_for(lambda: plane.refusals(reason) >= 1)
        assert not plane.control.dispatcher.connected("n3")


async def test_silent_agent_goes_unreachable_then_lost_and_is_closed(pki: Pki) -> None:
    async with control_plane(pki, unreachable_after=0.3, lost_after=0.8) as plane:
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as info:  # noqa: PT012
            async with raw_ws(plane) as ws:
                await ws.send_message(_register())
                await ws.get_message()  # the ack
                nodes = plane.control.nodes.nodes
                await wait_for(lambda: nodes["n3"].state is NodeState.UNREACHABLE)
                await wait_for(lambda: nodes["n3"].state is NodeState.LOST)
                while True:
                    await ws.get_message()
        assert info.value.reason.code == CloseCode.SILENT


async def test_killed_stream_makes_node_unreachable_at_once(pki: Pki) -> None:
    async with control_plane(pki, unreachable_after=30, lost_after=60) as plane:
        async with running(plane, plane.agent("n1")):
            await heartbeating(plane, "n1")
        node = plane.control.nodes.nodes["n1"]
        await wait_for(lambda: node.state is NodeState.UNREACHABLE, timeout=2)


async def test_newer_stream_from_the_same_node_replaces_the_older(pki: Pki) -> None:
    async with control_plane(pki) as plane:
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as info:  # noqa: PT012
            async with raw_ws(plane) as first:
                await first.send_message(_register())
                await first.get_message()
                async with raw_ws(plane) as second:
                    await second.send_message(_register())
                    await second.get_message()
                    while True:
                        await first.get_message()
        assert info.value.reason.code == CloseCode.REPLACED


async def test_cancelled_agent_closes_its_stream_cleanly_and_promptly(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Shutdown while blocked reading: the stream is closed with 1001, within a second.

    The heartbeat interval is an hour, so the agent sits blocked on the read
    side, the case that hung the reference implementation for 90 s.
    """
    caplog.set_level(logging.INFO)
    async with control_plane(pki, heartbeat=3600, unreachable_after=7200, lost_after=9000) as plane:
        agent = plane.agent("n1")
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(agent.run)
                await wait_for(lambda: "n1" in plane.control.nodes.nodes)
                await trio.sleep(0.1)
                started = trio.current_time()
                scope.cancel()
        assert trio.current_time() - started < 1.0
        node = plane.control.nodes.nodes["n1"]
        await wait_for(lambda: node.state is NodeState.UNREACHABLE)
    closes = [r.getMessage() for r in caplog.records if "closed its stream" in r.getMessage()]
    assert any("1001" in m and "agent shutting down" in m for m in closes), closes


async def test_a_failure_racing_a_cancellation_is_logged_and_the_cancellation_wins(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancelled just as the peer closed: the session ends with a group of both.

    Seen in CI: the agent's reconnect loop died of the close that raced the
    cancel. The failure must be logged and the cancellation must go on.
    """

    async def session_ending_in_a_race(*_: object) -> None:
        async def peer_closes_while_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                raise ConnectionClosed(None)  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer_closes_while_cancelled)
            await trio.sleep_forever()

    async with control_plane(pki) as plane:
        agent = plane.agent("n1")
        object.__setattr__(agent, "_session", session_ending_in_a_race)
        with trio.fail_after(5), trio.move_on_after(0.2) as scope:
            await agent.session("127.0.0.1", plane.port)
        assert scope.cancelled_caught
    assert "closed the stream" in caplog.text or "refused this agent" in caplog.text

"""A second agent for a node whose stream is live is refused (4008), over the real
stream; the same agent reconnecting, or one whose old stream went silent, still wins."""

from __future__ import annotations

import logging

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from llmgw.controlplane.takeover import LiveStream, close_reason, refusal
from llmgw.protocol import CloseCode, decode, encode
from llmgw.protocol.messages import Heartbeat, Inventory, Register, RegisterAck
from tests.conftest import Pki
from tests.stream.harness import control_plane, raw_ws


def _register(instance: str, node: str = "n3") -> bytes:
    return encode(Register(node_id=node, inventory=Inventory(), agent_instance=instance))


async def _registered(ws: WebSocketConnection, instance: str) -> None:
    await ws.send_message(_register(instance))
    assert isinstance(decode(await ws.get_message()), RegisterAck)


async def _heartbeats(ws: WebSocketConnection) -> None:
    seq = 0
    while True:
        seq += 1
        await ws.send_message(encode(Heartbeat(seq=seq, sent_at=0)))
        await trio.sleep(0.05)


async def test_a_second_agent_for_a_live_node_is_refused_and_the_first_keeps_it(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.controlplane")
    async with (
        control_plane(pki, unreachable_after=1.0, lost_after=3.0) as plane,
        raw_ws(plane) as first,
        trio.open_nursery() as nursery,
    ):
        await _registered(first, "aaaa")
        nursery.start_soon(_heartbeats, first)
        peer = plane.control.dispatcher.connections["n3"].peer
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as info:  # noqa: PT012
            async with raw_ws(plane) as second:
                await second.send_message(_register("bbbb"))
                await second.get_message()
        reason = info.value.reason
        assert reason.code == CloseCode.NODE_TAKEN
        assert reason.reason == f"node n3 is live from {peer}; stop the second agent for it"
        # the first keeps its stream and the node
        assert plane.control.dispatcher.connections["n3"].peer == peer
        registry = plane.control.metrics.registry
        assert registry.get_sample_value("llmgw_agent_stream_connects_total") == 1.0
        refused = {"reason": "NodeTaken"}
        assert registry.get_sample_value("llmgw_agent_stream_refusals_total", refused) == 1.0
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].endswith(
        f"(certificate 'n3'): node n3 is already connected from {peer}, and heartbeating:"
        " a second agent for one node (a copied certificate, or a second agent on its host)"
        " is refused; stop it"
    )


async def test_the_same_agent_reconnecting_replaces_its_own_stream_at_once(pki: Pki) -> None:
    async with control_plane(pki, unreachable_after=10.0, lost_after=30.0) as plane:
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as info:  # noqa: PT012
            async with raw_ws(plane) as first:
                await _registered(first, "aaaa")
                async with raw_ws(plane) as second:
                    await _registered(second, "aaaa")
                    while True:
                        await first.get_message()
        assert info.value.reason.code == CloseCode.REPLACED


async def test_a_stream_silent_past_the_bound_is_replaced_by_another_agent(pki: Pki) -> None:
    async with control_plane(pki, unreachable_after=0.3, lost_after=30.0) as plane:
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as info:  # noqa: PT012
            async with raw_ws(plane) as first:
                await _registered(first, "aaaa")
                await trio.sleep(0.4)  # nothing sent: silent past the unreachable timeout
                async with raw_ws(plane) as second:
                    await _registered(second, "bbbb")
                    while True:
                        await first.get_message()
        assert info.value.reason.code == CloseCode.REPLACED


def test_the_rule_in_pure_code() -> None:
    live = LiveStream("10.0.0.5:40000", "aaaa", silent_s=0.5)
    assert refusal("n1", None, "bbbb", 15) is None  # nobody holds it
    assert refusal("n1", live, "aaaa", 15) is None  # itself, reconnecting
    assert refusal("n1", live, "", 15) is None  # an older agent: as before, it wins
    assert refusal("n1", LiveStream("x:1", "", 0.5), "bbbb", 15) is None
    assert refusal("n1", LiveStream("x:1", "aaaa", 15.0), "bbbb", 15) is None  # silent
    assert refusal("n1", live, "bbbb", 15) == (
        "node n1 is already connected from 10.0.0.5:40000, and heartbeating"
    )
    assert len(close_reason("n" * 200, live).encode()) <= 123

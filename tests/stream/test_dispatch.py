"""Commands go down through the dispatcher; the agent's answers come back up."""

from __future__ import annotations

import logging

import pytest
import trio

from llmgw.controlplane.dispatcher import NodeNotConnected
from llmgw.protocol.messages import ShardSpec, StartShard, StopShard
from tests.conftest import Pki
from tests.stream.harness import control_plane, wait_for


async def test_dispatcher_delivers_commands_and_the_agent_answers(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with control_plane(pki) as plane, trio.open_nursery() as nursery:
        nursery.start_soon(plane.agent("n1").run)
        await wait_for(lambda: plane.control.dispatcher.connected("n1"))
        spec = ShardSpec(shard_id="s1", replica_id="r1", model="m", profile="p", engine="llama.cpp")
        with trio.fail_after(5):
            await plane.control.dispatcher.send("n1", StartShard(spec=spec))
            await plane.control.dispatcher.send("n1", StopShard(shard_id="s1"))

        def answered() -> bool:
            text = caplog.text
            return "shard s1 failed: this agent version does not run engines" in text and (
                "shard s1 is stopped" in text
            )

        await wait_for(answered)
        sent = plane.control.metrics.registry.get_sample_value(
            "llmgw_commands_dispatched_total", {"type": "StartShard"}
        )
        assert sent == 1
        with pytest.raises(NodeNotConnected, match="node n9 has no open agent stream"):
            await plane.control.dispatcher.send("n9", StopShard(shard_id="s1"))
        nursery.cancel_scope.cancel()

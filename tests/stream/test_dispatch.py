"""Commands go down through the dispatcher; the agent's answers come back up."""

from __future__ import annotations

import logging

import pytest
import trio

from llmgw.controlplane.dispatcher import NodeNotConnected
from llmgw.protocol.messages import ShardSpec, StartShard, StopShard
from tests.conftest import Pki
from tests.stream.harness import control_plane, supervised, wait_for


async def test_dispatcher_delivers_commands_and_the_agent_answers(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with control_plane(pki) as plane, supervised(plane.agent("n1")):
        await wait_for(lambda: plane.control.dispatcher.connected("n1"))
        # no model_path: the agent's supervisor refuses it before launch, and says why
        spec = ShardSpec(
            shard_id="s1", replica_id="r1", model="m", profile="p", engine="llama.cpp", port=20001
        )
        with trio.fail_after(5):
            await plane.control.dispatcher.send("n1", StartShard(spec=spec))
        refused = (
            "shard s1 failed: refused before launch: "
            "llama.cpp needs model_path (a GGUF file on this node)"
        )
        await wait_for(lambda: refused in caplog.text)
        with trio.fail_after(5):
            await plane.control.dispatcher.send("n1", StopShard(shard_id="s1"))
        await wait_for(lambda: "shard s1 is stopped" in caplog.text)
        sent = plane.control.metrics.registry.get_sample_value(
            "llmgw_commands_dispatched_total", {"type": "StartShard"}
        )
        assert sent == 1
        with pytest.raises(NodeNotConnected, match="node n9 has no open agent stream"):
            await plane.control.dispatcher.send("n9", StopShard(shard_id="s1"))

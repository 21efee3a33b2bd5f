"""SIGHUP to a running agent (``systemctl reload llmgw-agent``), through real
processes: it keeps running and its engine keeps serving; what can be taken from
agent.toml is taken (a label shows in ``ctl nodes``), what cannot is named as
waiting for a restart, in one line; a bad file changes nothing and says why."""

from __future__ import annotations

import signal
from pathlib import Path

import trio

from tests.cluster.test_control_plane_processes import chat, cluster, engine_pid
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


async def test_sighup_reloads_the_agents_labels_and_keeps_its_engine_serving(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        agent = c.agent("n1")
        [replica] = await c.wait_ready(1)
        shard = replica["shards"][0]
        pid = engine_pid(tmp_path, "n1", shard["shard_id"])
        assert (await c.server.nodes())["n1"]["labels"] == {"rack": "r0"}
        config = tmp_path / "agent-n1.toml"
        text = config.read_text()
        port = c.server.stream_port
        config.write_text(
            text.replace(
                'labels = { rack = "r0" }', 'labels = { rack = "r0", role = "coding" }'
            ).replace(
                f'control_plane = ["127.0.0.1:{port}"]',
                f'control_plane = ["127.0.0.1:{port}", "127.0.0.1:1"]',
            )
        )
        before = len(agent.log().splitlines())
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGHUP)
        await agent.wait_log(r"reloaded agent-n1\.toml")
        with trio.fail_after(15):
            while (await c.server.nodes())["n1"]["labels"] != {"rack": "r0", "role": "coding"}:
                await trio.sleep(0.1)
        await c.server.wait_log(r"node n1 now has labels rack=r0, role=coding")
        await trio.sleep(0.5)
        new = agent.log().splitlines()[before:]
        assert len(new) == 1, new  # one line, and nothing else happened
        assert new[0].endswith(
            " INFO llmgw.agent: reloaded agent-n1.toml: labels changed (rack=r0, role=coding);"
            " control_plane changes need a restart"
        ), new
        assert agent.returncode() is None
        assert agent.log().count("registered with control plane") == 1  # no reconnect
        assert engine_pid(tmp_path, "n1", shard["shard_id"]) == pid
        await chat(tmp_path, shard)

        # a file that does not parse: nothing changes, one line says why
        config.write_text(text.replace("[backoff]", "[backoff"))
        agent.proc.send_signal(signal.SIGHUP)
        line = await agent.wait_log(r".* ERROR .*not reloaded.*")
        assert line.group(0).endswith(
            "agent-n1.toml not reloaded, nothing changed: agent-n1.toml: not valid TOML:"
            " Expected ']' at the end of a table declaration (at line 13, column 9)"
        ), line.group(0)
        await trio.sleep(0.5)
        assert agent.returncode() is None
        assert (await c.server.nodes())["n1"]["labels"] == {"rack": "r0", "role": "coding"}
        await chat(tmp_path, shard)

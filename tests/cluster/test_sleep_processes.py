"""Replicas that sleep instead of stopping, through real processes: the control plane,
a real agent, the vLLM stand-in (vLLM's sleep mode: ``--enable-sleep-mode``, ``POST
/sleep``, ``POST /wake_up``) and the real openai client through the router. A model
with a range and a profile with ``sleep_s`` goes to zero by sleeping; the next
request is held and answered by the same engine, woken, not started again."""

from __future__ import annotations

import os
from pathlib import Path

import openai

from tests.cluster.procs import listening
from tests.cluster.test_router_processes import admin_metrics, routed
from tests.cluster.test_scaling_processes import models, wait_for
from tests.conftest import Pki
from tests.engines.test_vllm import wrapper
from tests.realparts import needs_server

pytestmark = needs_server

SLEEPY = """
[models.sleepy]
replicas = { min = 0, max = 1, idle_s = 3 }
[[models.sleepy.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
min_memory_gb = 1
env = { STANDIN_LOAD_S = "2", STANDIN_TOKEN_DELAY_S = "0.01" }
startup_timeout_s = 60
sleep_s = 600
"""


async def test_a_model_at_zero_sleeps_and_the_next_request_wakes_the_same_engine(
    tmp_path: Path, pki: Pki
) -> None:
    bindir = tmp_path / "bin"
    wrapper(bindir, "vllm")
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    async with routed(tmp_path, pki, extra_catalog=SLEEPY, agent_env=env) as (c, base, key):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)

        async def ask() -> str:
            r = await client.chat.completions.create(
                model="sleepy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            return r.choices[0].message.content or ""

        async def sleepy() -> list[dict[str, object]]:
            return [r for r in await c.replicas() if r["model"] == "sleepy"]

        assert await ask()  # held at zero, a replica started, answered
        (first,) = await sleepy()

        async def asleep() -> list[dict[str, object]]:
            return [r for r in await sleepy() if r["state"] == "Sleeping"]

        # no request for idle_s: it drains and sleeps instead of stopping
        (slept,) = await wait_for(c, "asleep", asleep, timeout=40)
        assert slept["replica_id"] == first["replica_id"]
        log = c.server.log()
        assert f"replica {first['replica_id']} drains, then sleeps" in log, log[-3000:]
        port = int(str(slept["shards"][0]["port"]))  # type: ignore[index]
        assert listening(port)  # its engine's process is kept
        view = (await models(c))["sleepy"]
        assert view["sleeping"] == 1 and view["wanted"] == 0, view
        table = (await c.server.ctl("models")).stdout.decode()
        assert "1 asleep" in table, table

        # the next request is held, and the same engine is woken: nothing starts again
        assert await ask()
        (woken,) = await sleepy()
        assert woken["replica_id"] == first["replica_id"] and woken["state"] == "Ready", woken
        assert f"replica {first['replica_id']} woken: sleepy wants 1" in c.server.log()
        samples = await admin_metrics(c)
        assert samples("llmgw_replica_start_seconds_count", model="sleepy") == 1
        assert samples("llmgw_replica_wake_seconds_count", model="sleepy", profile="gpu") == 1
        view = (await models(c))["sleepy"]
        assert view["scaling"]["wake_s"] is not None, view
        assert view["scaling"]["wake_s"] < view["scaling"]["start_s"], view
        assert "a wake" in (await c.server.ctl("models")).stdout.decode()

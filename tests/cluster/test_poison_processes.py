"""One client's requests that the engine fails do not take the model offline for others.

Real processes: ``llmgw server`` with its router, an agent, a real llama-server
on the tiny text model, and the real openai client.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import trio
from openai.types.chat import ChatCompletionMessageParam

from tests.cluster.test_router_processes import admin_metrics, routed
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server

# llama.cpp cannot read an image with a text model (no multimodal projector)
# and answers 500: the request's fault, not the replica's.
IMAGE: list[ChatCompletionMessageParam] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    }
]
BURST = 12  # more than the breaker's threshold of consecutive faults
WAVES = 3
ATTACKS = BURST * WAVES


async def test_requests_an_engine_fails_do_not_open_the_breaker_of_its_only_replica(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki) as (c, base, key):
        attacker = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
        good = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
        attacked: list[int] = []
        failed: list[str] = []
        served = 0
        done = trio.Event()

        async def one_attack() -> None:
            try:
                await attacker.chat.completions.create(
                    model="tiny",
                    messages=IMAGE,
                    max_tokens=4,
                )
                attacked.append(200)
            except openai.APIStatusError as exc:
                attacked.append(exc.status_code)

        async def attack() -> None:
            # in bursts, so that the engine's 500s come one after another with no
            # good answer between them to end a streak of faults
            for _ in range(WAVES):
                async with trio.open_nursery() as wave:
                    for _ in range(BURST):
                        wave.start_soon(one_attack)
                await trio.sleep(0.2)
            done.set()

        async def chat() -> None:
            nonlocal served
            # until the attack is over, and a few more after it: an open breaker
            # would refuse them for its whole cool-down
            after = 0
            for _ in range(500):
                try:
                    reply = await good.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                    )
                    assert reply.choices[0].message.content is not None
                    served += 1
                except openai.APIError as exc:
                    failed.append(f"{type(exc).__name__}: {exc}")
                if done.is_set():
                    after += 1
                    if after >= 5:
                        return

        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attack)
                nursery.start_soon(chat)

        assert failed == []  # the good client was served throughout
        assert attacked == [500] * ATTACKS  # the engine's own answer, relayed
        assert served >= 5
        seen = await admin_metrics(c)
        assert seen("llmgw_router_breaker_open", model="tiny") == 0
        assert seen("llmgw_router_requests_total", model="tiny", status="500") == ATTACKS
        assert seen("llmgw_router_retries_total", model="tiny") == 0  # not multiplied
        out = await c.server.ctl("replicas", "--json")
        [traffic] = [r["traffic"] for r in json.loads(out.stdout)["replicas"]]
        assert traffic["breaker"] == "closed"

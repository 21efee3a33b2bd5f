"""A stream's usage, asked of its engine for its tenant (``llmgw.router.usage``): a
client that did not ask for it sees none, and its tenant is counted what the engine
says, the prompt included. Stand-in vLLM processes (the adapter's flags, prompt
token details off: only the usage event says the prompt's tokens) behind the router,
the real openai client in front; and a real llama-server, which says more on its
usage event when asked (its timings) than on its last choice's event: a client that
did not ask gets that where the engine would have put it."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionChunk

from llmgw.engines.base import Launch
from llmgw.engines.vllm import VLLM
from llmgw.router import usage
from llmgw.router.app import RouterApp
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.engines.test_tinymodel import llama_server
from tests.engines.test_vllm import STANDINS, running, spec, wait_healthy
from tests.ports import own_port
from tests.realparts import needs_server
from tests.router.test_affinity_llama import front
from tests.router.test_app import serve
from tools.support.tinymodel import write_model

KEY = "llmgw-test-key"
MESSAGES: Any = [{"role": "user", "content": "Say hello to the tide, twice a day."}]


@asynccontextmanager
async def standin(tmp_path: Path) -> AsyncIterator[str]:
    """A stand-in vLLM serving model ``m`` as the adapter launches it, but for prompt
    token details (off: a reply's usage gives the prompt's tokens and no more)."""
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=10))
        port = own_port()
        launch = VLLM.launch(spec(model="m", port=port), {"vllm": "vllm"})
        argv = [sys.executable, str(STANDINS / "vllm.py"), *launch.argv[1:]]
        argv.remove("--enable-prompt-tokens-details")
        proc = await stack.enter_async_context(
            running(
                Launch(argv=argv, env={}, health_url=None, metrics_url=None),
                tmp_path / "vllm.log",
                STANDIN_LOAD_S="0",
                STANDIN_TOKEN_DELAY_S="0.001",
                VLLM_API_KEY="",
                CUDA_VISIBLE_DEVICES="0,1",  # the spec asks for two
            )
        )
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(client, f"{url}/health", proc)
        yield url


async def unasked_and_asked(
    client: openai.AsyncOpenAI, messages: Any, max_tokens: int
) -> tuple[list[ChatCompletionChunk], list[ChatCompletionChunk]]:
    """The chunks of one chat streamed with no usage asked, then of one that asked."""
    plain = await client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, stream=True
    )
    seen = [chunk async for chunk in plain]
    asked = await client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    return seen, [chunk async for chunk in asked]


@pytest.mark.parametrize("resume", [True, False], ids=["resumable", "relayed as it comes"])
async def test_a_stream_is_counted_what_its_engine_says_and_its_client_sees_no_usage_unasked(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, resume: bool
) -> None:
    """Streams of a tenant's key, through both relays (one that can carry a broken
    stream on, one that passes it as it comes): asked nothing, the client gets no
    usage and no event without choices; asked, it gets the engine's usage event. The
    tenant is counted each stream's prompt as the engine counted it (the stand-in
    says it only in the usage event), not the router's estimate from the body."""
    caplog.set_level(logging.INFO, "llmgw.router.access")
    async with standin(tmp_path) as url:
        table = RoutingTable(scrape_s=0.5)
        routes = [Route(key="v", model="m", url=url, engine="vllm")]
        table.apply(Snapshot(version="1", models={"m": ModelRouting()}, routes=routes))
        await nursery.start(table.run)
        keys = KeyRing([ApiKey("t", hash_key(KEY), tenant="acme")])
        app = RouterApp(table, keys, access_log=True, resume_streams=resume)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{await serve(nursery, app)}/v1",
            api_key=KEY,
            max_retries=0,
            timeout=30,
        )
        with trio.fail_after(30):
            seen, told = await unasked_and_asked(client, MESSAGES, 5)
            assert seen and all(c.choices and c.usage is None for c in seen), seen
            text = "".join(c.choices[0].delta.content or "" for c in seen)
            assert text == "Hello from the vLLM stand-in"  # five words, whole
            last = told[-1]
            assert last.choices == [] and last.usage is not None, last
            assert last.usage.completion_tokens == 5
            prompt = last.usage.prompt_tokens
            completion = await client.completions.create(
                model="m", prompt="The tide", max_tokens=3, stream=True
            )
            seen_c = [chunk async for chunk in completion]
            assert seen_c and all(c.choices and c.usage is None for c in seen_c), seen_c
        lines = re.findall(r"tokens=(\d+)", caplog.text)
        assert lines == ["5", "5", "3"], caplog.text
        [row] = app.tally.rows()
        assert (row.tenant, row.requests, row.completion_tokens) == ("acme", 3, 13), row
        # the completion's prompt, "The tide": 8 bytes, the stand-in's ids one each
        assert row.prompt_tokens == 2 * prompt + 8, (row, prompt)


def test_asking_keeps_the_clients_other_stream_options_and_what_it_asked() -> None:
    body = b'{"model":"m","stream":true}'
    sent, unasked = usage.ask(body)
    assert unasked and sent.startswith(b'{"stream_options":{"include_usage":true},"model"')
    sent, unasked = usage.ask(b'{"model":"m","stream_options":{"continuous_usage_stats":true}}')
    assert unasked and b'"continuous_usage_stats":true' in sent and b'"include_usage":true' in sent
    already = b'{"model":"m","stream_options":{"include_usage":true}}'
    assert usage.ask(already) == (already, False)
    assert usage.ask(b"[1, 2]") == (b"[1, 2]", False)
    assert usage.ask(b"{ }") == (b"{ }", False)


def test_the_usage_is_taken_out_of_a_stream_cut_anywhere() -> None:
    """However the reads fall, whole events pass as they are and the usage event is
    dropped; a usage put on a choice's event is taken off it."""
    stream = (
        b'data: {"choices":[{"text":"a"}]}\n\n'
        b'data: {"choices":[{"text":"b","finish_reason":"length"}],"usage":{"prompt_tokens":2}}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n'
        b"data: [DONE]\n\n"
    )
    expected = (
        b'data: {"choices":[{"text":"a"}]}\n\n'
        b'data: {"choices":[{"text":"b","finish_reason":"length"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    for cut in range(1, len(stream)):
        taker = usage.Unasked()
        out = taker.feed(stream[:cut]) + taker.feed(stream[cut:]) + taker.rest()
        assert out == expected, cut


@needs_server
@pytest.mark.parametrize("resume", [True, False], ids=["resumable", "relayed as it comes"])
async def test_a_llama_cpp_chat_stream_keeps_its_timings_where_the_engine_puts_them(
    tmp_path: Path, nursery: trio.Nursery, resume: bool
) -> None:
    """llama-server puts a chat stream's ``timings`` on its usage event when asked for
    usage (as the router asks every stream), on the last choice's event when not: a
    client that did not ask gets them there, through both relays, and no event without
    a choice; one that asked gets the usage event as the engine sent it."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=2048)
    messages: Any = [{"role": "user", "content": "The harbor lantern burns all night."}]
    async with llama_server(model, tmp_path, context=2048) as url:
        client = await front(nursery, url, resume=resume)
        with trio.fail_after(30):
            seen, told = await unasked_and_asked(client, messages, 4)
    assert seen and all(c.choices and c.usage is None for c in seen), seen
    last = seen[-1]
    assert last.choices[0].finish_reason == "length", last
    timings = (last.model_extra or {}).get("timings")
    assert timings is not None and timings["predicted_n"] == 4, last
    assert timings["prompt_n"] + timings["cache_n"] > 0, timings
    assert not any((c.model_extra or {}).get("timings") for c in seen[:-1]), seen
    usage_event = told[-1]
    assert usage_event.choices == [] and usage_event.usage is not None, usage_event
    assert (usage_event.model_extra or {})["timings"]["predicted_n"] == 4, usage_event
    assert told[-2].choices[0].finish_reason == "length"
    assert "timings" not in (told[-2].model_extra or {}), told[-2]


# a real llama-server's chat stream, asked for usage (its build b11434)
_HEAD = b'"created":1796522325,"id":"chatcmpl-y","model":"t.gguf","object":"chat.completion.chunk"'
_TIMINGS = (
    b'"timings":{"cache_n":0,"prompt_n":16,"prompt_ms":1.269,"predicted_n":3,"predicted_ms":1.019}'
)
ASKED = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
    b'"content":null}}],' + _HEAD + b"}\n\n"
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"he"}}],'
    + _HEAD
    + b"}\n\n"
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],' + _HEAD + b"}\n\n"
    b'data: {"choices":[],' + _HEAD + b',"usage":{"completion_tokens":3,"prompt_tokens":16,'
    b'"total_tokens":19},' + _TIMINGS + b"}\n\n"
    b"data: [DONE]\n\n"
)
# ... and as it sends it unasked: the timings on the last choice's event
UNASKED = (
    ASKED[: ASKED.index(b'data: {"choices":[{"finish_reason":"length"')]
    + b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
    + _HEAD
    + b","
    + _TIMINGS
    + b"}\n\n"
    b"data: [DONE]\n\n"
)


def test_a_usage_events_timings_go_to_the_last_choices_event_however_the_reads_fall() -> None:
    for cut in range(1, len(ASKED)):
        for second in (cut, (cut + len(ASKED)) // 2):
            taker = usage.Unasked()
            parts = (ASKED[:cut], ASKED[cut:second], ASKED[second:])
            out = b"".join(taker.feed(part) for part in parts) + taker.rest()
            assert out == UNASKED, (cut, second, out)
    # a stream that breaks after its last choice's event: that event, then the error
    taker = usage.Unasked()
    cut = ASKED.index(b'data: {"choices":[],')
    out = taker.feed(ASKED[: cut + 20])
    taker.broke()
    out += taker.feed(b'data: {"error":{"message":"gone"}}\n\n')
    assert out == ASKED[:cut] + b'data: {"error":{"message":"gone"}}\n\n', out


@pytest.mark.parametrize("resume", [True, False], ids=["resumable", "relayed as it comes"])
async def test_a_stream_whose_first_event_is_its_last_has_its_first_token_timed(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, resume: bool
) -> None:
    """vLLM puts the finish on the last token's event: a completion of one token is one
    event, held for what a usage event might carry, and still its first token."""
    caplog.set_level(logging.INFO, "llmgw.router.access")
    async with standin(tmp_path) as url:
        client = await front(nursery, url, "vllm", resume=resume)
        with trio.fail_after(30):
            stream = await client.completions.create(
                model="m", prompt="The tide", max_tokens=1, stream=True
            )
            seen = [chunk async for chunk in stream]
    assert [c.choices[0].finish_reason for c in seen] == ["length"], seen
    assert re.search(r"ttft=\d+\.\d+s tokens=1 ", caplog.text), caplog.text

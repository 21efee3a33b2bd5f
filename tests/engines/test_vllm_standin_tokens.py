"""The vLLM stand-in's tokens: its tokenizer, its chat template, token ids in its replies,
and completions from a prompt of token ids, which a stream resumed on another replica
needs. Its reply follows from the context, so a stream resumed with the right ids can be
told from one resumed with wrong ones. Each test runs the stand-in as a real process."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.engines.base import Launch
from tests.engines.test_vllm import STANDINS, running, wait_healthy
from tests.ports import own_port

REPLY = "Hello from the vLLM stand-in."
REPLY_IDS = [1000, 1001, 1002, 1003, 1004, 1005]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
RENDERED = "<|system|>Be brief.\n<|user|>hi there\n<|assistant|>"


@pytest.fixture
async def base(tmp_path: Path) -> AsyncIterator[str]:
    """A stand-in serving model ``m``; killed when the test ends, passed or failed."""
    port = own_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(STANDINS / "vllm.py"), "serve", "m"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    launch = Launch(argv=argv, env={}, health_url=f"{url}/health", metrics_url=None)
    env = {"STANDIN_LOAD_S": "0", "STANDIN_TOKEN_DELAY_S": "0.001", "VLLM_API_KEY": "",
           "CUDA_VISIBLE_DEVICES": "0"}  # fmt: skip
    async with (
        running(launch, tmp_path / "vllm.log", **env) as proc,
        httpx.AsyncClient(trust_env=False, timeout=10) as client,
    ):
        await wait_healthy(client, f"{url}/health", proc)
        yield url


async def post(url: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        r = await client.post(url, json=body)
    assert r.status_code == status, r.text
    answer: dict[str, Any] = r.json()
    return answer


async def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's chunks, parsed; it must end with ``[DONE]``."""
    async with (
        httpx.AsyncClient(trust_env=False, timeout=10) as client,
        client.stream("POST", url, json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


async def tokenize(base: str, text: str) -> list[int]:
    answer = await post(f"{base}/tokenize", {"model": "m", "prompt": text})
    tokens: list[int] = answer["tokens"]
    return tokens


async def detokenize(base: str, tokens: list[int]) -> str:
    text: str = (await post(f"{base}/detokenize", {"model": "m", "tokens": tokens}))["prompt"]
    return text


# --- the tokenizer and the template -------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        # the longest word where one matches, else one byte
        ("Hi Hello.", [72, 105, 32, 1000, 1005]),
        (REPLY, REPLY_IDS),
        (" the theme", [1002, 1002, 109, 101]),
        ("plain ascii, no words", list(b"plain ascii, no words")),
        ("café ☕", [99, 97, 102, 0xC3, 0xA9, 32, 0xE2, 0x98, 0x95]),
        ("", []),
    ],
)
async def test_tokenize_and_detokenize_round_trip(base: str, text: str, ids: list[int]) -> None:
    answer = await post(
        f"{base}/tokenize", {"model": "m", "prompt": text, "add_special_tokens": True}
    )
    assert answer == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    assert await detokenize(base, ids) == text


async def test_detokenize_replaces_broken_utf8_and_refuses_unknown_ids(base: str) -> None:
    assert await detokenize(base, [0xC3, 1000]) == "\ufffdHello"
    for tokens in ([256], [999], [1006], [-1], ["a"], "Hello"):
        answer = await post(f"{base}/detokenize", {"model": "m", "tokens": tokens}, 400)
        assert (answer["object"], answer["code"], answer["type"]) == (
            "error",
            400,
            "BadRequestError",
        )


async def test_unknown_model_and_bad_bodies(base: str) -> None:
    answer = await post(f"{base}/tokenize", {"model": "x", "prompt": "hi"}, 404)
    assert answer["message"] == "The model `x` does not exist."
    await post(f"{base}/detokenize", {"model": "x", "tokens": [1]}, 404)
    await post(f"{base}/tokenize", {"model": "m"}, 400)
    await post(f"{base}/v1/completions", {"model": "m", "prompt": [1000, 5000]}, 400)
    await post(f"{base}/v1/completions", {"model": "m", "prompt": 7}, 400)


async def test_chat_tokenize_is_the_rendered_template_tokenized(base: str) -> None:
    answer = await post(f"{base}/tokenize", {"model": "m", "messages": MESSAGES})
    assert answer["tokens"] == await tokenize(base, RENDERED)
    # words of the reply inside it are single ids: "." in "brief.", " the" in "hi there"
    words = [*b"<|system|>Be brief", 1005, *b"\n<|user|>hi", 1002, *b"re\n<|assistant|>"]
    assert (answer["tokens"], answer["count"]) == (words, len(words))
    without = {"model": "m", "messages": MESSAGES, "add_generation_prompt": False}
    assert (await post(f"{base}/tokenize", without))["tokens"] == await tokenize(
        base, RENDERED.removesuffix("<|assistant|>")
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "image_url", "image_url": {"url": "x"}},
                                          {"type": "text", "text": "b"}]}]  # fmt: skip
    answer = await post(f"{base}/tokenize", {"model": "m", "messages": parts})
    assert await detokenize(base, answer["tokens"]) == "<|user|>a\nb\n<|assistant|>"


# --- token ids in replies -----------------------------------------------------


async def test_a_chat_stream_with_token_ids(base: str) -> None:
    prompt = await tokenize(base, RENDERED)
    body = {"model": "m", "messages": MESSAGES, "return_token_ids": True}
    chunks = await events(f"{base}/v1/chat/completions", body)
    role, rest = chunks[0], chunks[1:]
    assert role["prompt_token_ids"] == prompt
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "token_ids" not in role["choices"][0]
    assert all("prompt_token_ids" not in c for c in rest)
    assert [len(c["choices"][0]["token_ids"]) for c in rest] == [1] * len(rest)
    ids = [t for c in rest for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"]["content"] for c in rest)
    assert ids == REPLY_IDS
    assert await detokenize(base, ids) == text == REPLY
    assert [c["choices"][0]["finish_reason"] for c in rest] == [None] * 5 + ["stop"]


async def test_a_completions_stream_with_token_ids(base: str) -> None:
    body = {"model": "m", "prompt": "hi", "return_token_ids": True}
    chunks = await events(f"{base}/v1/completions", body)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == [104, 105]  # as vLLM: in the first choice
    assert all("prompt_token_ids" not in c for c in choices[1:])
    ids = [t for c in choices for t in c["token_ids"]]
    assert ids == REPLY_IDS
    assert await detokenize(base, ids) == "".join(c["text"] for c in choices) == REPLY


async def test_unstreamed_replies_with_token_ids(base: str) -> None:
    prompt = await tokenize(base, RENDERED)
    body = {"model": "m", "messages": MESSAGES, "return_token_ids": True}
    chat = await post(f"{base}/v1/chat/completions", body)
    assert chat["prompt_token_ids"] == prompt
    assert chat["choices"][0]["token_ids"] == REPLY_IDS
    assert chat["choices"][0]["message"]["content"] == REPLY
    assert chat["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6,
                             "total_tokens": len(prompt) + 6}  # fmt: skip
    body = {"model": "m", "prompt": "hi", "return_token_ids": True}
    plain = await post(f"{base}/v1/completions", body)
    assert plain["choices"][0]["prompt_token_ids"] == [104, 105]
    assert plain["choices"][0]["token_ids"] == REPLY_IDS
    assert "prompt_token_ids" not in plain


async def test_no_token_ids_unless_asked(base: str) -> None:
    requests: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ]
    for path, body in requests:
        for asked in ({}, {"return_token_ids": False}):
            chunks = await events(base + path, {**body, **asked})
            reply = await post(base + path, {**body, **asked})
            for obj in [*chunks, reply]:
                assert "token_ids" not in json.dumps(obj), obj
            assert len(chunks) == (7 if "messages" in body else 6)


# --- generation follows from the context: resuming -----------------------------


async def test_a_resumed_stream_continues_where_it_broke(base: str) -> None:
    """The chat prompt's ids and the ids of the first three tokens, sent as a completion's
    prompt (as to another replica), give the rest of the reply and no more."""
    body = {"model": "m", "messages": MESSAGES, "return_token_ids": True}
    chunks = await events(f"{base}/v1/chat/completions", body)
    prompt = chunks[0]["prompt_token_ids"]
    got = [t for c in chunks[1:4] for t in c["choices"][0]["token_ids"]]
    assert await detokenize(base, got) == "Hello from the"
    resume = {"model": "m", "prompt": prompt + got, "return_token_ids": True}
    rest = await events(f"{base}/v1/completions", resume)
    assert "".join(c["choices"][0]["text"] for c in rest) == " vLLM stand-in."
    assert [t for c in rest for t in c["choices"][0]["token_ids"]] == [1003, 1004, 1005]
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"
    reply = await post(f"{base}/v1/completions", resume)
    assert reply["choices"][0]["text"] == " vLLM stand-in."
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["prompt_tokens"] == len(prompt) + 3
    # the same as text: the tokenizer cuts it the same way
    as_text = {"model": "m", "prompt": RENDERED + "Hello from the"}
    assert (await post(f"{base}/v1/completions", as_text))["choices"][0][
        "text"
    ] == " vLLM stand-in."
    # a wrong resume (a token short, or none sent) tells itself by its text
    short = {"model": "m", "prompt": prompt + got[:2]}
    assert (await post(f"{base}/v1/completions", short))["choices"][0][
        "text"
    ] == " the vLLM stand-in."
    fresh = {"model": "m", "prompt": prompt}
    assert (await post(f"{base}/v1/completions", fresh))["choices"][0]["text"] == REPLY
    # a reply already whole: nothing more, finished
    done = await events(f"{base}/v1/completions", {"model": "m", "prompt": prompt + REPLY_IDS})
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in done] == [
        ("", "stop")
    ]


@pytest.mark.parametrize(
    ("limit", "text", "finish"),
    [(1, "Hello", "length"), (3, "Hello from the", "length"), (5, REPLY[:-1], "length"),
     (6, REPLY, "stop"), (100, REPLY, "stop"), (None, REPLY, "stop")],
)  # fmt: skip
async def test_max_tokens_cuts_the_reply(
    base: str, limit: int | None, text: str, finish: str
) -> None:
    extra = {} if limit is None else {"max_tokens": limit}
    chat = {"model": "m", "messages": MESSAGES, **extra}
    reply = await post(f"{base}/v1/chat/completions", chat)
    assert (reply["choices"][0]["message"]["content"], reply["choices"][0]["finish_reason"]) == (
        text,
        finish,
    )
    assert reply["usage"]["completion_tokens"] == len(await tokenize(base, text))
    chunks = await events(f"{base}/v1/completions", {"model": "m", "prompt": "hi", **extra})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == finish
    # a resumed reply is cut by its own count, not the whole reply's
    resume = {"model": "m", "prompt": [104, 105, 1000, 1001, 1002], **extra}
    rest = (await post(f"{base}/v1/completions", resume))["choices"][0]
    words = [" vLLM", " stand-in", "."]
    n = len(words) if limit is None else min(limit, len(words))
    assert (rest["text"], rest["finish_reason"]) == (
        "".join(words[:n]),
        "stop" if n == len(words) else "length",
    )


async def test_usage_ends_the_stream_when_asked(base: str) -> None:
    prompt = await tokenize(base, RENDERED)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = await events(f"{base}/v1/chat/completions", body)
    *tokens, last = chunks
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4,
                             "total_tokens": len(prompt) + 4}  # fmt: skip
    assert last["object"] == "chat.completion.chunk"
    assert all("usage" not in c for c in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    plain = await events(f"{base}/v1/completions", {"model": "m", "prompt": "hi"})
    assert all("usage" not in c and c["choices"] for c in plain)

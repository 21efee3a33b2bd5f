"""Embeddings through the router, from a real llama-server that a catalog profile
started for them (``settings = { embeddings = true, pooling = "mean" }``), asked by
the real ``openai`` client."""

from __future__ import annotations

import math
from pathlib import Path

import openai
import pytest
import trio

from tests.cluster.test_router_processes import admin_metrics, routed
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server

N_EMBD = 64  # the tiny model's width (tools/support/tinymodel.py)


def embedding_model(model: Path) -> str:
    return f"""
[models.emb]
replicas = 1
[[models.emb.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "{model}"
settings = {{ context = 512, parallel = 1, threads = 1, threads_batch = 1, embeddings = true, pooling = "mean" }}
startup_timeout_s = 60
"""


async def test_the_openai_client_gets_embeddings_through_the_router(
    tmp_path: Path, pki: Pki
) -> None:
    extra = embedding_model(tmp_path / "tiny.gguf")
    async with routed(tmp_path, pki, extra_catalog=extra, serves="emb") as (c, base, key):
        await c.wait_ready(1, model="emb")
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=20)
        with trio.fail_after(30):
            got = await client.embeddings.create(model="emb", input=["hello world", "goodbye"])
            # as floats too (the client asks for base64 unless told)
            floats = await client.embeddings.create(
                model="emb", input="hello world", encoding_format="float"
            )
        assert [d.index for d in got.data] == [0, 1]
        vectors = [d.embedding for d in got.data]
        assert [len(v) for v in vectors] == [N_EMBD, N_EMBD]
        assert vectors[0] != vectors[1]
        assert all(abs(math.hypot(*v) - 1) < 1e-3 for v in vectors)  # normalised, as OpenAI's
        assert all(
            abs(a - b) < 1e-5 for a, b in zip(floats.data[0].embedding, vectors[0], strict=True)
        )
        assert got.usage.prompt_tokens > 0 and got.usage.total_tokens == got.usage.prompt_tokens
        # counted by the router as any request is
        metrics = await admin_metrics(c)
        assert metrics("llmgw_router_requests_total", model="emb", status="200") == 2

        # a model whose profile does not serve them says so (the engine's 501, as sent),
        # and that counts against no replica: it still chats
        with pytest.raises(openai.APIStatusError) as refused:
            await client.embeddings.create(model="tiny", input="x")
        assert refused.value.status_code == 501, refused.value
        assert "does not support embeddings" in str(refused.value)
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content

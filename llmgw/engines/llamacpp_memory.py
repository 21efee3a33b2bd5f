"""What a llama.cpp shard holds in memory, reckoned before it is placed.

llama-server holds, for a profile that does not say its need (``min_memory_gb``):

- the weights: the GGUF file's size, as the nodes' weights discovery reports
  it (the copy at the profile's ``model_path``, else one under its weights
  name; the largest, when several);
- the KV cache: ``--ctx-size`` tokens (the profile's ``context``; llama-server
  shares them among its ``--parallel`` slots, so the cache is the context, not
  the context per slot) times the bytes a token takes in every layer, from the
  GGUF's attention shape and the cache types (``--cache-type-k``/``-v``, f16
  by default);
- the prompt cache: ``--cache-ram`` MiB, the profile's ``cache_ram_mib`` setting
  (which the adapter always passes; llama-server's default is 8192 per process;
  -1 is no limit, which cannot be counted; 0 turns it off).

Which memory: a shard on the CPU holds all three in host memory. One with GPUs
and its layers offloaded (the default with GPUs) holds the weights and the KV
cache in GPU memory (``--no-kv-offload`` keeps the KV cache on the host), and
only the prompt cache in host memory, which is what ``host`` counts; ``gpu``
is what its cards must hold together. Partial offload (``gpu_layers`` below
the layer count) splits them by layers.

What cannot be known (weights no node reports, the model's shape) is not
counted, and the words say what was left out; what is known is still counted.
The same reckoning says how many tokens of prompts a replica keeps (its
context and its prompt cache), which the router weighs its cache by.

Pure: no I/O.
"""

from __future__ import annotations

from llmgw.engines.sizing import MIB, Need, Shape, gib_up
from llmgw.protocol.messages import WeightCopy

DEFAULT_CONTEXT = 4096  # the adapter's --ctx-size when the profile sets none
CACHE_RAM_MIB = 8192  # llama-server's own --cache-ram default
ALL_LAYERS = 999  # the adapter's --n-gpu-layers with GPUs

# ggml cache types -> bytes per element (block bytes / block elements)
KV_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "iq4_nl": 18 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}

# llama-server flags read here, by every spelling, and the environment variable that
# sets each when the flag is not given
_FLAGS = {
    "--cache-ram": "cache_ram",
    "-cram": "cache_ram",
    "--cache-type-k": "type_k",
    "-ctk": "type_k",
    "--cache-type-v": "type_v",
    "-ctv": "type_v",
}
_ENV = {
    "LLAMA_ARG_CACHE_RAM": "cache_ram",
    "LLAMA_ARG_CACHE_TYPE_K": "type_k",
    "LLAMA_ARG_CACHE_TYPE_V": "type_v",
}
_NO_KV_OFFLOAD = frozenset({"--no-kv-offload", "-nkvo"})


class LlamaCppSizing:
    """llama-server's memory and prompt cache, as this module's docstring reckons them."""

    def need(self, shape: Shape, weights: WeightCopy | None) -> Need:
        return _need(shape, weights)

    def cache_tokens(self, shape: Shape, weights: WeightCopy | None) -> int | None:
        """Its context (its slots) and what its prompt cache holds; None when not known
        (the model's shape not reported, a prompt cache without a limit)."""
        said = _flags(shape)
        per_token = _kv_per_token(said, weights)
        cache_mib = _cache_mib(shape, said)
        if per_token is None or per_token <= 0 or cache_mib < 0:
            return None
        context = _int(shape.settings.get("context"), DEFAULT_CONTEXT)
        return context + int(cache_mib * MIB / per_token)


def _cache_mib(shape: Shape, said: dict[str, str]) -> int:
    """The prompt cache's MiB: the profile's setting, which the adapter always writes on
    the command line (so that llama-server's environment no longer sets it), else what
    the arguments of a shard placed before the setting existed say."""
    setting = shape.settings.get("cache_ram_mib")
    if setting is not None:
        return _int(setting, CACHE_RAM_MIB)
    return _int(said.get("cache_ram_argv"), CACHE_RAM_MIB)


def _kv_per_token(said: dict[str, str], weights: WeightCopy | None) -> float | None:
    """Bytes one token takes in the KV cache, every layer; None: not known."""
    type_k = said.get("type_k", "f16").lower()
    type_v = said.get("type_v", "f16").lower()
    if (
        weights is None
        or weights.kv_k_per_token is None
        or weights.kv_v_per_token is None
        or type_k not in KV_TYPE_BYTES
        or type_v not in KV_TYPE_BYTES
    ):
        return None
    return (
        weights.kv_k_per_token * KV_TYPE_BYTES[type_k]
        + weights.kv_v_per_token * KV_TYPE_BYTES[type_v]
    )


def _need(shape: Shape, weights: WeightCopy | None) -> Need:
    said = _flags(shape)
    cache_mib = _cache_mib(shape, said)
    type_k = said.get("type_k", "f16").lower()
    type_v = said.get("type_v", "f16").lower()
    s = shape.settings
    context = _int(s.get("context"), DEFAULT_CONTEXT)
    size = weights.size_bytes if weights is not None else None
    kv: float | None = None
    per_token = _kv_per_token(said, weights)
    if per_token is not None:
        kv = context * per_token
    # how much of the model is on the cards: all, none, or a share of the layers
    layers = weights.layers if weights is not None else None
    gpu_layers = _int(s.get("gpu_layers"), ALL_LAYERS if shape.gpus else 0)
    if not shape.gpus or gpu_layers == 0:
        offloaded = 0.0
    elif gpu_layers < 0 or layers is None or gpu_layers >= layers:
        offloaded = 1.0
    else:
        offloaded = gpu_layers / layers
    kv_offloaded = 0.0 if any(a in _NO_KV_OFFLOAD for a in shape.engine_args) else offloaded

    host = 0.0
    gpu = 0.0
    parts: list[str] = []
    missing: list[str] = []
    if size is not None:
        host += size * (1 - offloaded)
        gpu += size * offloaded
        parts.append(f"weights {gib_up(size)}")
    else:
        missing.append("the weights' size (no node reports them)")
    if kv is not None:
        host += kv * (1 - kv_offloaded)
        gpu += kv * kv_offloaded
        parts.append(f"KV cache {gib_up(kv)} ({context} tokens, {type_k}/{type_v})")
    else:
        missing.append("the KV cache (no node reports the model's shape)")
    if cache_mib > 0:
        host += cache_mib * MIB
        parts.append(f"prompt cache {gib_up(cache_mib * MIB)}")
    elif cache_mib < 0:
        missing.append("the prompt cache (--cache-ram -1: no limit)")
    where = ""
    if offloaded and gpu:
        where = f", of which {gib_up(gpu)} GiB on its GPUs"
    words = f"{gib_up(host + gpu)} GiB: " + ", ".join(parts) + where if parts else "0 GiB"
    if missing:
        words = f"at least {words}; not counted: {', '.join(missing)}"
    gpu_need = int(gpu) if offloaded and size is not None else None
    return Need(int(host), gpu_need, words)


def _flags(shape: Shape) -> dict[str, str]:
    """The llama-server flags read here, from the profile's environment and then its
    engine_args (the command line wins, as in llama-server)."""
    out = {_ENV[k]: v for k, v in shape.env.items() if k in _ENV}
    args = shape.engine_args
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        name = _FLAGS.get(flag)
        if name is None:
            continue
        if eq:
            out[name] = value
        elif i + 1 < len(args):
            out[name] = args[i + 1]
        if name == "cache_ram" and name in out:
            out["cache_ram_argv"] = out[name]
    return out


def _int(value: object, default: int) -> int:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str | float):
        try:
            return int(value)
        except ValueError:
            return default
    return default

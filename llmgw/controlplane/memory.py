"""What one shard of a replica needs of its node's memory, reckoned before it is placed.

Placement subtracts what the shards already on a node need from the memory
the node has, so that two 24 GiB replicas do not land on a 32 GiB node; this
module says what a shard needs, and in what words.

A profile's ``min_memory_gb`` is its need, when set: what is written wins.
Otherwise, for llama.cpp, it is estimated from what llama-server will hold:

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

An unknown is not a zero: what cannot be known (weights no node reports, a
vLLM profile without ``min_memory_gb``) is not counted, and the words say
what was left out; what is known is still counted.
"""

from __future__ import annotations

import functools
import math
import posixpath
from collections.abc import Callable, Iterable

import attrs

from llmgw.controlplane.catalog import Catalog, Model, Profile
from llmgw.protocol.messages import Inventory, ShardSpec, WeightCopy

GIB = 2**30
MIB = 2**20
DEFAULT_CONTEXT = 4096  # the llama.cpp adapter's --ctx-size when the profile sets none
PROMPT_CACHE_MIB = 8192  # llama-server's --cache-ram default
ALL_LAYERS = 999  # the adapter's --n-gpu-layers with GPUs (llamacpp.ALL_LAYERS)

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


@attrs.frozen
class Need:
    """What one shard needs: ``host`` bytes of its node's memory (None: not known, and
    not counted), ``gpu`` bytes of memory on its cards together (None: none, or not
    known), and how that was reckoned, in words."""

    host: int | None
    gpu: int | None
    words: str


@functools.lru_cache(maxsize=4096)  # placement says the same few sizes of every node
def gib(n: float) -> str:
    """Bytes as GiB, one decimal, rounded down (what a node has): "8", "7.7"."""
    shown = math.floor(n / GIB * 10) / 10
    return f"{shown:.1f}".removesuffix(".0")


@functools.lru_cache(maxsize=4096)
def gib_up(n: float) -> str:
    """Bytes as GiB, one decimal, rounded up (what is needed), so that a shortfall
    never reads as enough: "has 24 GiB, needs 24.1 GiB"."""
    shown = math.ceil(round(n / GIB * 10, 6)) / 10
    return f"{shown:.1f}".removesuffix(".0")


def need(profile: Profile, weights: WeightCopy | None) -> Need:
    """What one shard of ``profile`` needs; ``weights``: the copy of its weights a node
    reports, if any."""
    estimate = _llama(profile, weights) if profile.engine == "llama.cpp" else None
    if profile.min_memory_gb is not None:
        host = int(profile.min_memory_gb * GIB)
        return Need(host, estimate.gpu if estimate else None, f"{gib_up(host)} GiB (min_memory_gb)")
    if estimate is None:
        return Need(None, None, f"not known: {profile.engine} without min_memory_gb")
    return estimate


def _cache_mib(profile: Profile, said: dict[str, str]) -> int:
    """The prompt cache's MiB: the profile's setting, which the adapter always writes on
    the command line (so that llama-server's environment no longer sets it), else what
    the arguments of a shard placed before the setting existed say."""
    setting = profile.settings.get("cache_ram_mib")
    if setting is not None:
        return _int(setting, PROMPT_CACHE_MIB)
    return _int(said.get("cache_ram_argv"), PROMPT_CACHE_MIB)


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


def cache_tokens(profile: Profile, weights: WeightCopy | None) -> int | None:
    """Tokens of prompts a llama.cpp replica of ``profile`` can keep: its context (its
    slots) and what its prompt cache holds; None when not known (another engine, the
    model's shape not reported, a prompt cache without a limit)."""
    if profile.engine != "llama.cpp":
        return None
    said = _llama_flags(profile)
    per_token = _kv_per_token(said, weights)
    cache_mib = _cache_mib(profile, said)
    if per_token is None or per_token <= 0 or cache_mib < 0:
        return None
    context = _int(profile.settings.get("context"), DEFAULT_CONTEXT)
    return context + int(cache_mib * MIB / per_token)


def _llama(profile: Profile, weights: WeightCopy | None) -> Need:
    said = _llama_flags(profile)
    cache_mib = _cache_mib(profile, said)
    type_k = said.get("type_k", "f16").lower()
    type_v = said.get("type_v", "f16").lower()
    s = profile.settings
    context = _int(s.get("context"), DEFAULT_CONTEXT)
    size = weights.size_bytes if weights is not None else None
    kv: float | None = None
    per_token = _kv_per_token(said, weights)
    if per_token is not None:
        kv = context * per_token
    # how much of the model is on the cards: all, none, or a share of the layers
    layers = weights.layers if weights is not None else None
    gpu_layers = _int(s.get("gpu_layers"), ALL_LAYERS if profile.gpus else 0)
    if not profile.gpus or gpu_layers == 0:
        offloaded = 0.0
    elif gpu_layers < 0 or layers is None or gpu_layers >= layers:
        offloaded = 1.0
    else:
        offloaded = gpu_layers / layers
    kv_offloaded = 0.0 if any(a in _NO_KV_OFFLOAD for a in profile.engine_args) else offloaded

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


def _llama_flags(profile: Profile) -> dict[str, str]:
    """The llama-server flags read here, from the profile's environment and then its
    engine_args (the command line wins, as in llama-server)."""
    out = {_ENV[k]: v for k, v in profile.env.items() if k in _ENV}
    args = profile.engine_args
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


class Needs:
    """Each profile's need in one pass, with the weights the nodes report found once.

    ``inventories`` gives every node's inventory when first needed (a Lost node's
    copies still describe the file). The same file is reported by every node that
    holds it; the copy at a profile's ``model_path`` is preferred over one under its
    weights name, a copy that says its KV shape over one that does not, and then
    the largest."""

    def __init__(self, inventories: Callable[[], Iterable[Inventory]] = tuple) -> None:
        self._inventories = inventories
        self._by_path: dict[str, WeightCopy] | None = None
        self._by_name: dict[str, WeightCopy] = {}
        self._needs: dict[tuple[str, str], Need] = {}
        self._shards: dict[tuple[str, str], int | None] = {}  # (model, profile) -> host

    def _index(self) -> tuple[dict[str, WeightCopy], dict[str, WeightCopy]]:
        if self._by_path is None:
            self._by_path = {}
            for inv in self._inventories():
                for copy in inv.weights:
                    path = posixpath.normpath(copy.path)
                    if _better(copy, self._by_path.get(path)):
                        self._by_path[path] = copy
                    if _better(copy, self._by_name.get(copy.model)):
                        self._by_name[copy.model] = copy
        return self._by_path, self._by_name

    def weights(self, model: Model, profile: Profile) -> WeightCopy | None:
        by_path, by_name = self._index()
        path = model.weights_path(profile)
        return (by_path.get(path) if path else None) or by_name.get(model.weights_name(profile))

    def of(self, model: Model, profile: Profile) -> Need:
        key = (model.name, profile.name)
        found = self._needs.get(key)
        if found is None:
            copy = self.weights(model, profile) if profile.engine == "llama.cpp" else None
            found = self._needs[key] = need(profile, copy)
        return found

    def of_shard(self, catalog: Catalog, spec: ShardSpec) -> int | None:
        """Host bytes a running shard holds: its profile's need, or, for a profile that
        left the catalog, what its own spec says (its model_path, settings, args)."""
        key = (spec.model, spec.profile)
        if key in self._shards:  # asked of every shard of every replica on each pass
            return self._shards[key]
        host = self._shards[key] = self._of_shard(catalog, spec)
        return host

    def _of_shard(self, catalog: Catalog, spec: ShardSpec) -> int | None:
        model = catalog.models.get(spec.model)
        profile = model.profile(spec.profile) if model is not None else None
        if model is not None and profile is not None:
            return self.of(model, profile).host
        gone = Profile(
            name=spec.profile,
            engine=spec.engine,
            gpus=len(spec.gpus),
            model_path=spec.model_path,
            engine_args=list(spec.engine_args),
            settings=dict(spec.settings),
            env=dict(spec.env),
        )
        return need(gone, self.weights(Model(name=spec.model), gone)).host


def _better(copy: WeightCopy, than: WeightCopy | None) -> bool:
    if than is None:
        return True
    return (copy.kv_k_per_token is not None, copy.size_bytes or 0) > (
        than.kv_k_per_token is not None,
        than.size_bytes or 0,
    )

"""What a shard needs of its node's memory: min_memory_gb when written, else llama.cpp's
weights, KV cache and prompt cache, each in the memory it lives in."""

from __future__ import annotations

import msgspec

from llmgw.controlplane.catalog import Model, Profile
from llmgw.controlplane.memory import GIB, MIB, Needs, cache_tokens, need
from llmgw.protocol.messages import Inventory, ShardSpec, WeightCopy

# an 8B model at Q4: 4.6 GiB, 32 layers x 8 KV heads x 128 per token for K and for V
LLAMA_8B = WeightCopy(
    model="llama-8b",
    path="/w/llama-8b.gguf",
    size_bytes=int(4.6 * GIB),
    layers=32,
    kv_k_per_token=32 * 8 * 128,
    kv_v_per_token=32 * 8 * 128,
)
KV_PER_TOKEN_F16 = 2 * 32 * 8 * 128 * 2  # K and V, 2 bytes each: 128 KiB


def llama(**kw: object) -> Profile:
    return msgspec.convert(
        {"name": "p", "engine": "llama.cpp", "model_path": "/w/llama-8b.gguf", **kw}, Profile
    )


def test_min_memory_gb_is_the_need_when_written() -> None:
    n = need(llama(min_memory_gb=24), LLAMA_8B)
    assert n.host == 24 * GIB
    assert n.words == "24 GiB (min_memory_gb)"
    vllm = msgspec.convert({"name": "g", "engine": "vllm", "gpus": 1, "min_memory_gb": 8}, Profile)
    assert need(vllm, None).host == 8 * GIB


def test_a_cpu_llama_holds_weights_kv_and_the_default_prompt_cache_on_the_host() -> None:
    n = need(llama(settings={"context": 8192, "parallel": 4}), LLAMA_8B)
    kv = 8192 * KV_PER_TOKEN_F16  # the context is shared by the slots: not x 4
    assert n.host == int(4.6 * GIB) + kv + 8192 * MIB
    assert n.gpu is None
    assert n.words == (
        "13.6 GiB: weights 4.6, KV cache 1 (8192 tokens, f16/f16), prompt cache 8"
    ), n.words


def test_cache_flags_and_environment_are_read_as_llama_server_reads_them() -> None:
    """The prompt cache is the profile's cache_ram_mib, which the adapter writes on the
    command line (so the environment no longer sets it); a shard placed with
    --cache-ram in its arguments, before the setting, is counted by those."""
    p = llama(
        settings={"context": 4096},
        engine_args=["-ctk", "q8_0", "--cache-type-v=q4_0", "--cache-ram", "1024"],
        env={"LLAMA_ARG_CACHE_RAM": "99999"},  # the command line wins
    )
    n = need(p, LLAMA_8B)
    kv = 4096 * 32 * 8 * 128 * (34 / 32 + 18 / 32)
    assert n.host == int(int(4.6 * GIB) + kv + 1024 * MIB)
    off = need(llama(settings={"cache_ram_mib": 0}), LLAMA_8B)
    assert "prompt cache" not in off.words
    said = need(llama(settings={"cache_ram_mib": 512}, env={"LLAMA_ARG_CACHE_RAM": "0"}), LLAMA_8B)
    assert said.host == int(4.6 * GIB) + 4096 * KV_PER_TOKEN_F16 + 512 * MIB
    unbounded = need(llama(settings={"cache_ram_mib": -1}), LLAMA_8B)
    assert "not counted: the prompt cache (--cache-ram -1: no limit)" in unbounded.words


def test_what_a_replica_can_keep_of_prompts_sizes_the_routers_index() -> None:
    """Its context (the slots) and what its prompt cache holds, in tokens."""
    p = llama(settings={"context": 4096, "cache_ram_mib": 1024})
    assert cache_tokens(p, LLAMA_8B) == 4096 + 1024 * MIB // KV_PER_TOKEN_F16
    assert cache_tokens(p, None) is None  # its shape not reported
    assert cache_tokens(llama(settings={"cache_ram_mib": -1}), LLAMA_8B) is None


def test_offloaded_to_gpus_only_the_prompt_cache_is_host_memory() -> None:
    n = need(llama(gpus=1, settings={"context": 4096}), LLAMA_8B)
    assert n.host == 8192 * MIB
    assert n.gpu == int(4.6 * GIB) + 4096 * KV_PER_TOKEN_F16
    # half the layers on the card: half of the weights and KV stay on the host
    half = need(llama(gpus=1, settings={"context": 4096, "gpu_layers": 16}), LLAMA_8B)
    assert half.host == int(8192 * MIB + (int(4.6 * GIB) + 4096 * KV_PER_TOKEN_F16) / 2)
    # --no-kv-offload keeps the KV cache on the host
    nkvo = need(llama(gpus=1, settings={"context": 4096}, engine_args=["-nkvo"]), LLAMA_8B)
    assert nkvo.host == 8192 * MIB + 4096 * KV_PER_TOKEN_F16


def test_what_no_node_reports_is_not_counted_and_the_words_say_so() -> None:
    n = need(llama(), None)
    assert n.host == 8192 * MIB  # what is known still counts
    assert n.words.startswith("at least 8 GiB: prompt cache 8; not counted: the weights' size")
    vllm = msgspec.convert({"name": "g", "engine": "vllm", "gpus": 1}, Profile)
    assert need(vllm, None).host is None


def test_needs_find_the_copy_at_the_model_path_before_one_by_name() -> None:
    named = WeightCopy(model="m", path="/other/m.gguf", size_bytes=1 * GIB)
    inventories = [Inventory(weights=[named]), Inventory(weights=[LLAMA_8B])]
    needs = Needs(lambda: inventories)
    m = Model(name="m", profiles=[llama()])
    assert needs.weights(m, m.profiles[0]) == LLAMA_8B  # at /w/llama-8b.gguf
    by_name = Model(name="m", profiles=[llama(model_path="/elsewhere.gguf")])
    assert needs.weights(by_name, by_name.profiles[0]) == named
    # a shard whose profile left the catalog: its own spec says what it runs
    spec = ShardSpec(
        shard_id="s", replica_id="r", model="gone", profile="p", engine="llama.cpp",
        model_path="/w/llama-8b.gguf", settings={"context": 1024},
    )  # fmt: skip
    from llmgw.controlplane.catalog import Catalog

    assert needs.of_shard(Catalog(), spec) == int(4.6 * GIB) + 1024 * KV_PER_TOKEN_F16 + 8192 * MIB

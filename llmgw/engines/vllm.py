"""vLLM adapters: one node (``vllm``) and several nodes over Ray (``vllm-ray``).

Why validate here: vLLM refuses a bad profile only after it has imported
torch and started loading weights, which can take minutes, and the message
it dies with is buried in a long traceback. Every check that can be made
from the spec alone (GPU count against tensor x pipeline parallelism,
settings' ranges and spelling, flags that would fight the ones we set) is
made before launch and reported in words, all problems at once.

Settings (``spec.settings``):

- ``tensor_parallel_size``: default the shard's GPU count (GPUs per node).
- ``pipeline_parallel_size``: default 1; for ``vllm-ray`` the number of
  nodes (``world_size``), the usual layout: TP inside a node, PP across.
- ``gpu_memory_utilization``: in (0, 1], default 0.9.
- ``max_model_len``: optional, at least 16; vLLM's default is the model's.
- ``served_model_name``: a further name the engine answers to, for clients
  that reach it directly. It always answers to ``spec.model`` too, first (the
  name in its replies): that is the name the gateway's clients ask for and
  the router forwards as sent, so an engine without it would refuse them.
- ``embeddings``: true for an embedding model: ``--runner pooling --convert
  embed`` (vLLM 0.10.1 and later; ``--task embed`` before), so that it answers
  ``/v1/embeddings`` (a model that pools natively is left as it is).
- ``prefix_caching``: true (the default) turns on vLLM's automatic prefix caching
  (``--enable-prefix-caching``; false: ``--no-enable-prefix-caching``), which the
  router's affinity routing feeds (``llmgw.router.affinity``). Replies then say
  what they reused (``--enable-prompt-tokens-details``: ``usage.
  prompt_tokens_details.cached_tokens``), and the metrics the totals
  (``vllm:prefix_cache_hits``, ``vllm:prefix_cache_queries``, in tokens).
- ``ray_port`` (``vllm-ray``): the Ray head's port, default 6379.
- ``node_ip`` (``vllm-ray``): this node's address as Ray should advertise
  it. The agent fills it with the address it discovered; when it is
  missing, ``spec.host`` is used unless that is a wildcard (0.0.0.0, ::).

Sleep (``spec.sleep``, from the profile's ``sleep_s``): ``vllm`` starts with
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``, without which vLLM
serves none of its sleep endpoints; the agent then puts an idle engine to sleep
with ``POST /sleep?level=1`` (its weights offloaded to host memory, its KV cache
discarded: its GPU memory is free), wakes it with ``POST /wake_up`` and asks
``GET /is_sleeping``. While it sleeps ``/health`` answers 200 and generation
503. These paths are outside ``/v1``, so its key does not guard them. ``vllm-ray``
cannot sleep yet: every rank of a replica would have to, on every node.

TP x PP must equal the GPUs the shard was given (times ``world_size`` for
Ray): placement decides the GPUs, and a profile that used fewer would leave
placed GPUs idle while claiming them.

Its token ids, for carrying a broken stream on (``VllmTokens``, one family for
both adapters), come in each streamed choice's ``token_ids`` when asked for
(``return_token_ids``, vLLM 0.10.2 and later); a request is rendered to its
prompt with ``/tokenize`` and ids checked with ``/detokenize``.

Both are found on a node by their commands on PATH (``vllm``, and ``ray`` for
``vllm-ray``), their versions read from the metadata of the Python package the
command's script runs under.

The model served is ``spec.model_path`` when set (a local directory the
agent found) and ``spec.model`` otherwise (a Hugging Face repo id).

Multi-node (``vllm-ray``): every node of a replica is one shard with the
same replica_id, rank 0..world_size-1. Rank 0 starts the Ray head and then
``exec``\\s ``vllm serve --distributed-executor-backend ray`` in the same
shell, so the shard is one process; it alone serves HTTP. Other ranks run
``ray start --address=HEAD --block`` in the foreground and have no HTTP
endpoint. All ranks are assumed to have the same GPU count: a spec describes
one node, and total GPUs are ``len(gpus) x world_size``.

Caution for whoever stops shards: ``ray start --head`` daemonizes, so the
Ray head's processes may outlive rank 0's process group; ``ray stop`` (on
that node) is what ends them.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from collections.abc import Mapping
from typing import Any

import attrs

from llmgw.addr import join_hostport, url_host
from llmgw.engines.base import (
    Launch,
    LoadSignals,
    ProfileError,
    Program,
    Requirements,
    check_extra_args,
    check_port,
    check_sleep,
    float_setting,
    gpu_env,
    int_setting,
    sample_values,
)
from llmgw.engines.sizing import Sizing
from llmgw.engines.tokens import Ask, Tokens, token_ids
from llmgw.protocol.messages import ShardSpec

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})

_COMMON_SETTINGS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "served_model_name",
        "embeddings",
        "prefix_caching",
    }
)
VLLM_SETTINGS = _COMMON_SETTINGS
VLLM_RAY_SETTINGS = _COMMON_SETTINGS | {"ray_port", "node_ip"}

# Flags the adapter sets itself -> where their value comes from.
_MANAGED_FLAGS = {
    "--host": "host",
    "--port": "port",
    "--model": "model",
    "--tensor-parallel-size": "tensor_parallel_size setting",
    "-tp": "tensor_parallel_size setting",
    "--pipeline-parallel-size": "pipeline_parallel_size setting",
    "-pp": "pipeline_parallel_size setting",
    "--data-parallel-size": "replicas",
    "-dp": "replicas",
    "--gpu-memory-utilization": "gpu_memory_utilization setting",
    "--max-model-len": "max_model_len setting",
    "--served-model-name": "served_model_name setting",
    "--distributed-executor-backend": "engine (vllm-ray runs Ray)",
    "--runner": "embeddings setting",
    "--convert": "embeddings setting",
    "--task": "embeddings setting",
    "--enable-prefix-caching": "prefix_caching setting",
    "--no-enable-prefix-caching": "prefix_caching setting",
    "--enable-sleep-mode": "sleep_s",
    "--no-enable-sleep-mode": "sleep_s",
}

# vLLM serves /sleep, /wake_up and /is_sleeping only in its dev mode
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# level 1: weights offloaded to host memory, KV cache discarded (level 2 discards the
# weights too, and a wake would have to load them again: no faster than a start)
SLEEP_PATH = "/sleep?level=1"
WAKE_PATH = "/wake_up"
SLEEPING_PATH = "/is_sleeping"

METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_RUNNING = "vllm:num_requests_running"
METRIC_KV = "vllm:kv_cache_usage_perc"
METRIC_KV_OLD = "vllm:gpu_cache_usage_perc"  # before vLLM renamed it
METRIC_PROGRESS = "vllm:generation_tokens_total"  # counted every engine step
METRIC_CACHE_HITS = "vllm:prefix_cache_hits_total"  # prompt tokens found cached
METRIC_CACHE_QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up


VLLM_PROGRAM = Program(name="vllm", command="vllm", package="vllm")
RAY_PROGRAM = Program(name="ray", command="ray", package="ray")

# what of a chat request shapes its prompt on vLLM's /tokenize
_CHAT_SHAPING = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
)


class VllmTokens:
    """vLLM's token ids: ``token_ids`` in each streamed choice (``return_token_ids``)."""

    family: str = "vllm"
    asking: Mapping[str, object] = {"return_token_ids": True}
    carried: tuple[str, ...] = (
        "top_k",
        "min_p",
        "ignore_eos",
        "stop_token_ids",
        "repetition_penalty",
        "min_tokens",
        "skip_special_tokens",
    )
    constraints: tuple[str, ...] = (
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    )

    def took(self, choice: dict[str, Any], keep: bool, chat: bool) -> list[int]:
        ids = choice.get("token_ids") if keep else choice.pop("token_ids", None)
        return list(ids or ())

    async def render(
        self, ask: Ask, body: Mapping[str, Any], chat: bool, ids: list[int], relayed: str
    ) -> tuple[list[int], list[int]]:
        model = body.get("model")
        prompt_in = body.get("prompt")
        if chat:
            shaping = {k: body[k] for k in _CHAT_SHAPING if k in body}
            prompt_in = (await ask("/tokenize", {"model": model, **shaping}))["tokens"]
        elif not isinstance(prompt_in, list):
            found = await ask("/tokenize", {"model": model, "prompt": prompt_in})
            prompt_in = found["tokens"]
        text = (await ask("/detokenize", {"model": model, "tokens": ids}))["prompt"] if ids else ""
        if text != relayed:
            found = await ask(
                "/tokenize", {"model": model, "prompt": relayed, "add_special_tokens": False}
            )
            ids = token_ids(found["tokens"])
        return token_ids(prompt_in), ids


_TOKENS = VllmTokens()


def _normal_flag(arg: str) -> str:
    """vLLM accepts ``--tensor_parallel_size`` for ``--tensor-parallel-size``."""
    if not arg.startswith("--"):
        return arg
    flag, sep, value = arg.partition("=")
    return flag.replace("_", "-") + sep + value


def _ray_address(host: str, port: int) -> str:
    """``host:port`` for Ray; a bare host gets ``port``, IPv6 gets brackets."""
    if host.startswith("["):
        if "]:" in host:
            return host
        return f"{host}:{port}"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host.count(":") == 1:  # name:port or v4:port
            return host
        return f"{host}:{port}"
    return join_hostport(host, port)


@attrs.frozen
class _Plan:
    """The settings of one spec, resolved with their defaults."""

    model: str
    tp: int
    pp: int
    gpu_memory_utilization: float
    max_model_len: int | None
    served_model_name: str
    ray_port: int
    node_ip: str
    embeddings: bool = False
    prefix_caching: bool = True


def _string_setting(spec: ShardSpec, key: str, default: str, problems: list[str]) -> str:
    if key not in spec.settings:
        return default
    value = spec.settings[key]
    if not isinstance(value, str) or not value:
        problems.append(f"{key} must be a non-empty string, got {value!r}")
        return default
    return value


class _VllmBase:
    name: str = "vllm"
    known_settings: frozenset[str] = VLLM_SETTINGS
    multi_node: bool = False
    key_env: str = "VLLM_API_KEY"  # with it, every /v1 path wants the key
    requires: Requirements = Requirements(programs=(VLLM_PROGRAM,), gpu=True)
    sizing: Sizing | None = None  # not known: a profile says its min_memory_gb
    tokens: Tokens | None = _TOKENS
    sleeps: bool = True
    slot_cache: bool = False  # its prefix cache's blocks serve running requests too
    slot_field: str | None = None  # it schedules requests itself
    _why_no_sleep: str = ""  # where it cannot: why, for an operator

    # ------------------------------------------------------------- validation
    def _plan(self, spec: ShardSpec, problems: list[str]) -> _Plan:
        for key in sorted(spec.settings):
            if key not in self.known_settings:
                problems.append(f"unknown setting {key!r} for {self.name}")
        model = spec.model_path or spec.model
        if not model:
            problems.append("no model to serve: the spec has neither model_path nor model")
        gpus = len(spec.gpus)
        nodes = max(spec.world_size, 1) if self.multi_node else 1
        tp = int_setting(spec, "tensor_parallel_size", max(gpus, 1), problems, minimum=1)
        pp = int_setting(spec, "pipeline_parallel_size", nodes, problems, minimum=1)
        util = float_setting(spec, "gpu_memory_utilization", 0.9, problems, low=0.0, high=1.0)
        max_len: int | None = None
        if "max_model_len" in spec.settings:
            max_len = int_setting(spec, "max_model_len", 16, problems, minimum=16)
        served = _string_setting(spec, "served_model_name", spec.model or model, problems)
        embeddings = spec.settings.get("embeddings", False)
        if not isinstance(embeddings, bool):
            problems.append(f"embeddings must be true or false, got {embeddings!r}")
            embeddings = False
        prefix_caching = spec.settings.get("prefix_caching", True)
        if not isinstance(prefix_caching, bool):
            problems.append(f"prefix_caching must be true or false, got {prefix_caching!r}")
            prefix_caching = True
        ray_port = 6379
        node_ip = ""
        if self.multi_node:
            ray_port = int_setting(spec, "ray_port", 6379, problems, minimum=1)
            if ray_port > 65535:
                problems.append(f"ray_port {ray_port} is not a TCP port")
            default_ip = "" if spec.host in _WILDCARDS else spec.host
            node_ip = _string_setting(spec, "node_ip", default_ip, problems)
        return _Plan(
            model=model,
            tp=tp,
            pp=pp,
            gpu_memory_utilization=util,
            max_model_len=max_len,
            served_model_name=served,
            ray_port=ray_port,
            node_ip=node_ip,
            embeddings=embeddings,
            prefix_caching=prefix_caching,
        )

    def validate(self, spec: ShardSpec) -> list[str]:
        problems: list[str] = []
        plan = self._plan(spec, problems)
        gpus = len(spec.gpus)
        if gpus == 0:
            problems.append("vLLM needs at least one GPU; this shard has none")
        elif plan.tp >= 1 and plan.pp >= 1:
            self._check_gpus(spec, plan, problems)
        if not self.multi_node or spec.rank == 0:
            check_port(spec, problems)
        check_extra_args([_normal_flag(a) for a in spec.engine_args], _MANAGED_FLAGS, problems)
        if "CUDA_VISIBLE_DEVICES" in spec.env:
            problems.append("env sets CUDA_VISIBLE_DEVICES, which comes from the shard's GPUs")
        if not self.sleeps:
            check_sleep(spec, self.name, problems, self._why_no_sleep)
        elif spec.sleep and spec.env.get(DEV_MODE_ENV, "1") != "1":
            problems.append(
                f"env sets {DEV_MODE_ENV}={spec.env[DEV_MODE_ENV]}, but the profile's sleep_s "
                "needs it 1 (vLLM serves its sleep endpoints only then): remove it from env"
            )
        self._check_topology(spec, plan, problems)
        return problems

    def _check_gpus(self, spec: ShardSpec, plan: _Plan, problems: list[str]) -> None:
        gpus = len(spec.gpus)
        if plan.tp * plan.pp != gpus:
            problems.append(
                f"tensor_parallel_size {plan.tp} x pipeline_parallel_size {plan.pp} "
                f"needs {plan.tp * plan.pp} GPUs, this shard has {gpus}"
            )

    def _check_topology(self, spec: ShardSpec, plan: _Plan, problems: list[str]) -> None:
        if spec.world_size != 1 or spec.rank != 0:
            problems.append(
                f"{self.name} runs on one node, but this shard is rank {spec.rank} "
                f"of {spec.world_size} (use engine vllm-ray for several nodes)"
            )

    def _checked_plan(self, spec: ShardSpec) -> _Plan:
        problems = self.validate(spec)
        if problems:
            raise ProfileError(problems)
        return self._plan(spec, [])

    # ----------------------------------------------------------------- launch
    def _serve_argv(self, vllm: str, spec: ShardSpec, plan: _Plan) -> list[str]:
        argv = [
            vllm,
            "serve",
            plan.model,
            "--host",
            spec.host,
            "--port",
            str(spec.port),
            "--tensor-parallel-size",
            str(plan.tp),
            "--pipeline-parallel-size",
            str(plan.pp),
            "--gpu-memory-utilization",
            str(plan.gpu_memory_utilization),
        ]
        if plan.max_model_len is not None:
            argv += ["--max-model-len", str(plan.max_model_len)]
        names = [plan.served_model_name]
        if spec.model and spec.model != plan.served_model_name:
            names.insert(0, spec.model)  # the catalog's name, which the router forwards
        argv += ["--served-model-name", *names]
        if plan.embeddings:
            argv += ["--runner", "pooling", "--convert", "embed"]
        elif plan.prefix_caching:
            argv += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
        else:
            argv.append("--no-enable-prefix-caching")
        if self.multi_node:
            argv += ["--distributed-executor-backend", "ray"]
        if spec.sleep:
            argv.append("--enable-sleep-mode")
        return argv + list(spec.engine_args)

    def _env(self, spec: ShardSpec) -> dict[str, str]:
        env = {**gpu_env(spec), **spec.env}
        if spec.sleep:
            env[DEV_MODE_ENV] = "1"
        return env

    def _base(self, spec: ShardSpec) -> str:
        return f"http://{url_host(spec.host)}:{spec.port}"

    def _urls(self, spec: ShardSpec) -> tuple[str, str]:
        base = self._base(spec)
        return f"{base}/health", f"{base}/metrics"

    def parse_sleeping(self, body: bytes) -> bool | None:
        """``{"is_sleeping": true}`` or false, as ``/is_sleeping`` answers."""
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        found = answer.get("is_sleeping") if isinstance(answer, dict) else None
        return found if isinstance(found, bool) else None

    # ---------------------------------------------------------------- metrics
    usage_path: str | None = None  # its metrics carry KV usage

    def parse_usage(self, body: bytes) -> LoadSignals | None:
        return None

    def parse_metrics(self, text: str) -> LoadSignals:
        values = sample_values(text)
        kv = values.get(METRIC_KV)
        if kv is None:
            kv = values.get(METRIC_KV_OLD)
        return LoadSignals(
            waiting=values.get(METRIC_WAITING),
            running=values.get(METRIC_RUNNING),
            kv_usage=kv,
            progress=values.get(METRIC_PROGRESS),
            cache_hits=values.get(METRIC_CACHE_HITS),
            cache_queries=values.get(METRIC_CACHE_QUERIES),
        )


class VllmAdapter(_VllmBase):
    """``vllm serve`` on one node, tensor (and pipeline) parallel over its GPUs."""

    name = "vllm"
    known_settings = VLLM_SETTINGS
    multi_node = False

    def launch(self, spec: ShardSpec, binaries: Mapping[str, str]) -> Launch:
        """Raises ProfileError for a spec that does not validate, KeyError naming
        the command (``vllm``, ``ray``) when ``binaries`` lacks it."""
        plan = self._checked_plan(spec)
        argv = self._serve_argv(binaries["vllm"], spec, plan)
        health, metrics = self._urls(spec)
        base = self._base(spec)
        return Launch(
            argv=argv,
            env=self._env(spec),
            health_url=health,
            metrics_url=metrics,
            sleep_url=f"{base}{SLEEP_PATH}" if spec.sleep else None,
            wake_url=f"{base}{WAKE_PATH}" if spec.sleep else None,
            sleeping_url=f"{base}{SLEEPING_PATH}" if spec.sleep else None,
        )


class VllmRayAdapter(_VllmBase):
    """vLLM across ``world_size`` nodes: a Ray head plus ``vllm serve`` on rank 0,
    Ray workers on the other ranks."""

    name = "vllm-ray"
    known_settings = VLLM_RAY_SETTINGS
    multi_node = True
    requires = Requirements(
        programs=(VLLM_PROGRAM, RAY_PROGRAM), gpu=True, multi_node=True, one_node="vllm"
    )
    # not yet: rank 0's /sleep would have to reach the engine's workers on every node,
    # and a replica's ranks sleep, wake and fail together, which no shard of one node
    # can say for the others
    sleeps = False
    _why_no_sleep = "a replica over Ray spans several nodes; vllm on one node can"

    def _check_gpus(self, spec: ShardSpec, plan: _Plan, problems: list[str]) -> None:
        per_node = len(spec.gpus)
        nodes = max(spec.world_size, 1)
        total = per_node * nodes
        if plan.tp * plan.pp != total:
            problems.append(
                f"tensor_parallel_size {plan.tp} x pipeline_parallel_size {plan.pp} "
                f"needs {plan.tp * plan.pp} GPUs, this replica has {total} "
                f"({per_node} per node x {nodes} nodes)"
            )

    def _check_topology(self, spec: ShardSpec, plan: _Plan, problems: list[str]) -> None:
        if spec.world_size < 2:
            problems.append("vllm-ray needs world_size ≥ 2 (use engine vllm for one node)")
        if not 0 <= spec.rank < max(spec.world_size, 1):
            problems.append(f"rank {spec.rank} is outside world_size {spec.world_size}")
        if spec.rank > 0 and not spec.head_address:
            problems.append(
                f"vllm-ray rank {spec.rank} of {spec.world_size} needs head_address "
                "(the rank-0 node's address)"
            )
        if not plan.node_ip:
            problems.append(
                f"vllm-ray needs this node's address for Ray: host is {spec.host!r} "
                "and settings has no node_ip"
            )
        if spec.rank == 0 and plan.ray_port == spec.port:
            problems.append(f"ray_port {plan.ray_port} is also the HTTP port")

    def launch(self, spec: ShardSpec, binaries: Mapping[str, str]) -> Launch:
        """Rank 0: ``sh -c "ray start --head ... && exec vllm serve ..."``; other
        ranks: ``ray start --address=... --block``. Errors as for ``vllm``."""
        plan = self._checked_plan(spec)
        ray = binaries["ray"]
        gpus = len(spec.gpus)
        node_ip = f"--node-ip-address={plan.node_ip}"
        if spec.rank > 0:
            argv = [
                ray,
                "start",
                f"--address={_ray_address(spec.head_address, plan.ray_port)}",
                node_ip,
                f"--num-gpus={gpus}",
                "--block",
            ]
            return Launch(
                argv=argv,
                env=self._env(spec),
                health_url=None,
                metrics_url=None,
                cleanup=[ray, "stop"],
            )
        head = [
            ray,
            "start",
            "--head",
            f"--port={plan.ray_port}",
            node_ip,
            f"--num-gpus={gpus}",
            "--disable-usage-stats",
        ]
        serve = self._serve_argv(binaries["vllm"], spec, plan)
        script = f"{shlex.join(head)} && exec {shlex.join(serve)}"
        health, metrics = self._urls(spec)
        return Launch(
            argv=["/bin/sh", "-c", script],
            env=self._env(spec),
            health_url=health,
            metrics_url=metrics,
            # the head daemonizes out of the shard's process group; note that
            # `ray stop` ends every Ray process on the node
            cleanup=[ray, "stop"],
        )


VLLM = VllmAdapter()
VLLM_RAY = VllmRayAdapter()

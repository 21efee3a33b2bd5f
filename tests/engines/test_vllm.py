"""The vLLM adapters: exact command lines, every refusal in words, and real processes.

vLLM cannot run here, so the adapters are checked twice: by the exact argv
they build (what vLLM and Ray would be given), and end to end by running
that argv against stand-ins (``standins/vllm.py``, ``standins/ray.py``) that
accept vLLM's and Ray's command lines and serve vLLM's endpoints.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.engines.base import Launch, LoadSignals, ProfileError
from llmgw.engines.vllm import VLLM, VLLM_RAY
from llmgw.protocol.messages import ShardSpec
from tests.ports import own_port

STANDINS = Path(__file__).resolve().parent / "standins"
BIN = {"vllm": "/opt/vllm/bin/vllm", "ray": "/opt/vllm/bin/ray"}


def spec(**kw: Any) -> ShardSpec:
    base: dict[str, Any] = dict(
        shard_id="s1",
        replica_id="r1",
        model="Qwen/Qwen3-8B",
        profile="p",
        engine="vllm",
        gpus=[0, 1],
        host="127.0.0.1",
        port=8001,
    )
    base.update(kw)
    return ShardSpec(**base)


def ray_spec(**kw: Any) -> ShardSpec:
    base: dict[str, Any] = dict(
        engine="vllm-ray",
        world_size=2,
        gpus=[0, 1, 2, 3],
        host="10.0.0.1",
        head_address="10.0.0.1",
    )
    base.update(kw)
    return spec(**base)


# --- single node: argv, env, URLs ---------------------------------------------


def test_single_node_argv_defaults() -> None:
    launch = VLLM.launch(spec(), BIN)
    assert launch.argv == [
        "/opt/vllm/bin/vllm",
        "serve",
        "Qwen/Qwen3-8B",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "1",
        "--gpu-memory-utilization",
        "0.9",
        "--served-model-name",
        "Qwen/Qwen3-8B",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    assert launch.health_url == "http://127.0.0.1:8001/health"
    assert launch.metrics_url == "http://127.0.0.1:8001/metrics"


def test_an_embedding_profile_runs_the_pooling_runner() -> None:
    """embeddings = true: vLLM's pooling runner, converting the model for embeddings
    (vLLM 0.10.1 and later; a model that pools natively is left as it is)."""
    launch = VLLM.launch(spec(settings={"embeddings": True}), BIN)
    assert launch.argv[-4:] == ["--runner", "pooling", "--convert", "embed"]
    assert "--runner" not in VLLM.launch(spec(settings={"embeddings": False}), BIN).argv
    assert VLLM.validate(spec(settings={"embeddings": 1})) == [
        "embeddings must be true or false, got 1"
    ]
    assert VLLM.validate(spec(engine_args=["--task", "embed"])) == [
        "engine_args sets --task, which comes from the profile's embeddings setting"
    ]


def test_single_node_argv_with_everything() -> None:
    s = spec(
        gpus=[4, 5, 6, 7],
        model_path="/models/qwen3-8b",
        settings={
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "gpu_memory_utilization": 0.85,
            "max_model_len": 32768,
            "served_model_name": "qwen",
        },
        engine_args=["--enforce-eager", "--max-num-seqs", "128"],
    )
    assert VLLM.validate(s) == []
    assert VLLM.launch(s, BIN).argv == [
        "/opt/vllm/bin/vllm",
        "serve",
        "/models/qwen3-8b",  # the local copy beats the repo id
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.85",
        "--max-model-len",
        "32768",
        "--served-model-name",
        "Qwen/Qwen3-8B",  # the catalog's name, which the router forwards, first
        "qwen",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--max-num-seqs",
        "128",
    ]


def test_prefix_caching_is_on_and_says_what_each_reply_reused() -> None:
    """The router routes by what replicas hold: vLLM's prefix caching is on, and its
    replies say what they reused; a profile can turn it off, not fight it in engine_args."""
    on = VLLM.launch(spec(), BIN).argv
    assert "--enable-prefix-caching" in on and "--enable-prompt-tokens-details" in on
    off = VLLM.launch(spec(settings={"prefix_caching": False}), BIN).argv
    assert off[-1] == "--no-enable-prefix-caching" and "--enable-prefix-caching" not in off
    assert VLLM.validate(spec(engine_args=["--no-enable-prefix-caching"])) == [
        "engine_args sets --no-enable-prefix-caching, which comes from the profile's "
        "prefix_caching setting"
    ]
    assert VLLM.validate(spec(settings={"prefix_caching": "yes"})) == [
        "prefix_caching must be true or false, got 'yes'"
    ]
    signals = VLLM.parse_metrics(
        'vllm:prefix_cache_queries_total{model_name="m"} 1200.0\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 900.0\n'
    )
    assert (signals.cache_hits, signals.cache_queries) == (900.0, 1200.0)


def test_env_pins_the_gpus_and_adds_the_profiles_env() -> None:
    launch = VLLM.launch(
        spec(gpus=[3, 5], env={"HF_HOME": "/cache", "VLLM_LOGGING_LEVEL": "INFO"}), BIN
    )
    assert launch.env == {
        "CUDA_VISIBLE_DEVICES": "3,5",
        "HF_HOME": "/cache",
        "VLLM_LOGGING_LEVEL": "INFO",
    }


@pytest.mark.parametrize(
    ("host", "base"),
    [
        ("127.0.0.1", "http://127.0.0.1:9000"),
        ("0.0.0.0", "http://127.0.0.1:9000"),
        ("10.1.2.3", "http://10.1.2.3:9000"),
        ("::1", "http://[::1]:9000"),
        ("::", "http://[::1]:9000"),
        ("fd00::7", "http://[fd00::7]:9000"),
        ("gpu-node-3", "http://gpu-node-3:9000"),
    ],
)
def test_health_and_metrics_urls(host: str, base: str) -> None:
    launch = VLLM.launch(spec(host=host, port=9000), BIN)
    assert launch.argv[3:5] == ["--host", host]  # vLLM binds what the profile says
    assert (launch.health_url, launch.metrics_url) == (f"{base}/health", f"{base}/metrics")


def test_sleep_mode_only_for_a_spec_that_sleeps() -> None:
    """``spec.sleep``: vLLM's sleep mode, its endpoints (served only in its dev mode),
    and where the agent calls them; without it, none of these."""
    s = spec(sleep=True, engine_args=["--enforce-eager"])
    assert VLLM.validate(s) == []
    launch = VLLM.launch(s, BIN)
    assert launch.argv[-2:] == ["--enable-sleep-mode", "--enforce-eager"]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_SERVER_DEV_MODE": "1"}
    assert (launch.sleep_url, launch.wake_url, launch.sleeping_url) == (
        "http://127.0.0.1:8001/sleep?level=1",
        "http://127.0.0.1:8001/wake_up",
        "http://127.0.0.1:8001/is_sleeping",
    )
    plain = VLLM.launch(spec(), BIN)
    assert "--enable-sleep-mode" not in plain.argv
    assert "VLLM_SERVER_DEV_MODE" not in plain.env
    assert (plain.sleep_url, plain.wake_url, plain.sleeping_url) == (None, None, None)
    assert VLLM.sleeps and not VLLM_RAY.sleeps


def test_parse_sleeping() -> None:
    assert VLLM.parse_sleeping(b'{"is_sleeping": true}') is True
    assert VLLM.parse_sleeping(b'{"is_sleeping": false}') is False
    for body in (b"", b"<html>502</html>", b'{"is_sleeping": 1}', b"[true]"):
        assert VLLM.parse_sleeping(body) is None


# --- validation: every problem in words ---------------------------------------


def test_a_good_spec_has_no_problems() -> None:
    assert VLLM.validate(spec()) == []
    assert VLLM_RAY.validate(ray_spec()) == []
    assert VLLM_RAY.validate(ray_spec(world_size=3)) == []  # TP 4 x PP 3 by default
    assert VLLM_RAY.validate(ray_spec(rank=1, port=0, host="10.0.0.2")) == []


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        (
            {"gpus": [0, 1], "settings": {"tensor_parallel_size": 4}},
            "tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4 GPUs, this shard has 2",
        ),
        (
            {"gpus": [0, 1, 2, 3], "settings": {"tensor_parallel_size": 1}},
            "tensor_parallel_size 1 x pipeline_parallel_size 1 needs 1 GPUs, this shard has 4",
        ),
        (
            {"gpus": [0, 1], "settings": {"pipeline_parallel_size": 2}},
            "tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 GPUs, this shard has 2",
        ),
        ({"gpus": []}, "vLLM needs at least one GPU; this shard has none"),
        (
            {"settings": {"gpu_memory_utilization": 1.5}},
            "gpu_memory_utilization must be in (0, 1], got 1.5",
        ),
        (
            {"settings": {"gpu_memory_utilization": 0}},
            "gpu_memory_utilization must be in (0, 1], got 0",
        ),
        (
            {"settings": {"gpu_memory_utilization": "high"}},
            "gpu_memory_utilization must be a number, got 'high'",
        ),
        ({"settings": {"max_model_len": 8}}, "max_model_len must be at least 16, got 8"),
        (
            {"settings": {"max_model_len": "32k"}},
            "max_model_len must be a whole number, got '32k'",
        ),
        (
            {"settings": {"tensor_parallel_size": 0}},
            "tensor_parallel_size must be at least 1, got 0",
        ),
        (
            {"settings": {"tensor_parallel_size": True}},
            "tensor_parallel_size must be a whole number, got True",
        ),
        (
            {"settings": {"served_model_name": ""}},
            "served_model_name must be a non-empty string, got ''",
        ),
        (
            {"settings": {"tensor_paralel_size": 2}},
            "unknown setting 'tensor_paralel_size' for vllm",
        ),
        ({"settings": {"ray_port": 6380}}, "unknown setting 'ray_port' for vllm"),
        (
            {"engine_args": ["--port", "9000"]},
            "engine_args sets --port, which comes from the profile's port",
        ),
        (
            {"engine_args": ["--host=0.0.0.0"]},
            "engine_args sets --host, which comes from the profile's host",
        ),
        (
            {"engine_args": ["--tensor_parallel_size=2"]},
            "engine_args sets --tensor-parallel-size, which comes from the profile's "
            "tensor_parallel_size setting",
        ),
        (
            {"engine_args": ["-tp", "2"]},
            "engine_args sets -tp, which comes from the profile's tensor_parallel_size setting",
        ),
        (
            {"engine_args": ["--max-model-len", "4096"]},
            "engine_args sets --max-model-len, which comes from the profile's "
            "max_model_len setting",
        ),
        (
            {"engine_args": ["--served-model-name", "x"]},
            "engine_args sets --served-model-name, which comes from the profile's "
            "served_model_name setting",
        ),
        (
            {"engine_args": ["--data-parallel-size", "2"]},
            "engine_args sets --data-parallel-size, which comes from the profile's replicas",
        ),
        (
            {"engine_args": ["--distributed-executor-backend", "ray"]},
            "engine_args sets --distributed-executor-backend, which comes from the "
            "profile's engine (vllm-ray runs Ray)",
        ),
        (
            {"env": {"CUDA_VISIBLE_DEVICES": "0"}},
            "env sets CUDA_VISIBLE_DEVICES, which comes from the shard's GPUs",
        ),
        ({"port": 0}, "port 0 is not a TCP port"),
        ({"port": 70000}, "port 70000 is not a TCP port"),
        (
            {"model": ""},
            "no model to serve: the spec has neither model_path nor model",
        ),
        (
            {"world_size": 2, "rank": 1},
            "vllm runs on one node, but this shard is rank 1 of 2 "
            "(use engine vllm-ray for several nodes)",
        ),
        (
            {"engine_args": ["--enable_sleep_mode"]},
            "engine_args sets --enable-sleep-mode, which comes from the profile's sleep_s",
        ),
        (
            {"sleep": True, "env": {"VLLM_SERVER_DEV_MODE": "0"}},
            "env sets VLLM_SERVER_DEV_MODE=0, but the profile's sleep_s needs it 1 (vLLM "
            "serves its sleep endpoints only then): remove it from env",
        ),
    ],
)
def test_single_node_problems(kw: dict[str, Any], problem: str) -> None:
    s = spec(**kw)
    assert VLLM.validate(s) == [problem]
    with pytest.raises(ProfileError) as caught:
        VLLM.launch(s, BIN)
    assert caught.value.problems == [problem]


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        (
            {"world_size": 1},
            "vllm-ray needs world_size ≥ 2 (use engine vllm for one node)",
        ),
        (
            {"rank": 1, "head_address": ""},
            "vllm-ray rank 1 of 2 needs head_address (the rank-0 node's address)",
        ),
        ({"rank": 2}, "rank 2 is outside world_size 2"),
        (
            {"settings": {"tensor_parallel_size": 4, "pipeline_parallel_size": 1}},
            "tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4 GPUs, "
            "this replica has 8 (4 per node x 2 nodes)",
        ),
        (
            {"world_size": 3, "settings": {"pipeline_parallel_size": 2}},
            "tensor_parallel_size 4 x pipeline_parallel_size 2 needs 8 GPUs, "
            "this replica has 12 (4 per node x 3 nodes)",
        ),
        ({"gpus": []}, "vLLM needs at least one GPU; this shard has none"),
        (
            {"host": "0.0.0.0"},
            "vllm-ray needs this node's address for Ray: host is '0.0.0.0' "
            "and settings has no node_ip",
        ),
        ({"settings": {"ray_port": 8001}}, "ray_port 8001 is also the HTTP port"),
        ({"settings": {"ray_port": 70000}}, "ray_port 70000 is not a TCP port"),
        ({"settings": {"ray_port": 0}}, "ray_port must be at least 1, got 0"),
        (
            {"settings": {"node_ip": 3}},
            "node_ip must be a non-empty string, got 3",
        ),
        (
            {"sleep": True},
            "the profile's sleep_s asks idle replicas to sleep, but vllm-ray cannot sleep "
            "(a replica over Ray spans several nodes; vllm on one node can): set sleep_s to 0",
        ),
        (
            {"settings": {"tensor_paralel_size": 2}},
            "unknown setting 'tensor_paralel_size' for vllm-ray",
        ),
        (
            {"engine_args": ["--pipeline-parallel-size=4"]},
            "engine_args sets --pipeline-parallel-size, which comes from the profile's "
            "pipeline_parallel_size setting",
        ),
    ],
)
def test_multi_node_problems(kw: dict[str, Any], problem: str) -> None:
    s = ray_spec(**kw)
    assert VLLM_RAY.validate(s) == [problem]
    with pytest.raises(ProfileError) as caught:
        VLLM_RAY.launch(s, BIN)
    assert caught.value.problems == [problem]


def test_a_worker_needs_no_http_port_but_rank_0_does() -> None:
    assert VLLM_RAY.validate(ray_spec(rank=1, port=0)) == []
    assert VLLM_RAY.validate(ray_spec(rank=0, port=0)) == ["port 0 is not a TCP port"]


def test_every_problem_is_reported_at_once() -> None:
    s = spec(
        gpus=[],
        port=0,
        settings={"gpu_memory_utilization": 2, "max_model_len": 1, "tensor_paralel_size": 2},
        engine_args=["--port=1"],
    )
    assert VLLM.validate(s) == [
        "unknown setting 'tensor_paralel_size' for vllm",
        "gpu_memory_utilization must be in (0, 1], got 2",
        "max_model_len must be at least 16, got 1",
        "vLLM needs at least one GPU; this shard has none",
        "port 0 is not a TCP port",
        "engine_args sets --port, which comes from the profile's port",
    ]


def test_a_missing_command_is_a_key_error_naming_it() -> None:
    with pytest.raises(KeyError, match="vllm"):
        VLLM.launch(spec(), {})
    with pytest.raises(KeyError, match="ray"):
        VLLM_RAY.launch(ray_spec(), {"vllm": "/x/vllm"})
    with pytest.raises(KeyError, match="vllm"):
        VLLM_RAY.launch(ray_spec(), {"ray": "/x/ray"})
    assert VLLM_RAY.launch(ray_spec(rank=1), {"ray": "/x/ray"}).argv[0] == "/x/ray"


# --- multi node: the rank-0 script and the worker argv ------------------------


def split_script(launch: Launch) -> list[list[str]]:
    assert launch.argv[:2] == ["/bin/sh", "-c"] and len(launch.argv) == 3
    words = shlex.split(launch.argv[2])
    cut = words.index("&&")
    assert words[cut + 1] == "exec"
    return [words[:cut], words[cut + 2 :]]


def test_rank_0_starts_the_ray_head_then_execs_vllm() -> None:
    binaries = {"vllm": "/opt/my venv/bin/vllm", "ray": "/opt/my venv/bin/ray"}
    s = ray_spec(
        model_path="/models/it's here",
        settings={"max_model_len": 8192, "ray_port": 6380},
        engine_args=["--enforce-eager"],
        env={"NCCL_IB_HCA": "mlx5"},
    )
    launch = VLLM_RAY.launch(s, binaries)
    head, serve = split_script(launch)
    assert head == [
        "/opt/my venv/bin/ray",
        "start",
        "--head",
        "--port=6380",
        "--node-ip-address=10.0.0.1",
        "--num-gpus=4",
        "--disable-usage-stats",
    ]
    assert serve == [
        "/opt/my venv/bin/vllm",
        "serve",
        "/models/it's here",
        "--host",
        "10.0.0.1",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "4",  # GPUs per node
        "--pipeline-parallel-size",
        "2",  # nodes
        "--gpu-memory-utilization",
        "0.9",
        "--max-model-len",
        "8192",
        "--served-model-name",
        "Qwen/Qwen3-8B",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--distributed-executor-backend",
        "ray",
        "--enforce-eager",
    ]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "NCCL_IB_HCA": "mlx5"}
    assert launch.health_url == "http://10.0.0.1:8001/health"
    assert launch.metrics_url == "http://10.0.0.1:8001/metrics"


def test_node_ip_setting_beats_a_wildcard_host() -> None:
    s = ray_spec(host="0.0.0.0", settings={"node_ip": "192.168.7.7"})
    head, serve = split_script(VLLM_RAY.launch(s, BIN))
    assert "--node-ip-address=192.168.7.7" in head
    assert serve[3:5] == ["--host", "0.0.0.0"]
    assert VLLM_RAY.launch(s, BIN).health_url == "http://127.0.0.1:8001/health"


def test_workers_join_the_head_and_have_no_endpoint() -> None:
    s = ray_spec(rank=1, host="10.0.0.2", head_address="10.0.0.1", gpus=[4, 5, 6, 7], port=0)
    launch = VLLM_RAY.launch(s, BIN)
    assert launch.argv == [
        "/opt/vllm/bin/ray",
        "start",
        "--address=10.0.0.1:6379",
        "--node-ip-address=10.0.0.2",
        "--num-gpus=4",
        "--block",
    ]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert launch.health_url is None and launch.metrics_url is None


@pytest.mark.parametrize(
    ("head", "address"),
    [
        ("10.0.0.1", "10.0.0.1:6390"),
        ("head-node", "head-node:6390"),
        ("head-node:7000", "head-node:7000"),
        ("fd00::1", "[fd00::1]:6390"),
        ("[fd00::1]", "[fd00::1]:6390"),
        ("[fd00::1]:7000", "[fd00::1]:7000"),
    ],
)
def test_worker_head_address_forms(head: str, address: str) -> None:
    s = ray_spec(rank=1, head_address=head, settings={"ray_port": 6390, "node_ip": "10.0.0.2"})
    assert VLLM_RAY.launch(s, BIN).argv[2] == f"--address={address}"


# --- metrics ------------------------------------------------------------------

# What vLLM's /metrics looks like (prometheus_client exposition), trimmed.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4375
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 6789.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 42.5
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 9.0
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
"""

OLD_VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""


def test_parse_metrics() -> None:
    assert VLLM.parse_metrics(VLLM_METRICS) == LoadSignals(
        waiting=7.0, running=3.0, kv_usage=0.4375, progress=6789.0
    )
    assert VLLM_RAY.parse_metrics(VLLM_METRICS) == VLLM.parse_metrics(VLLM_METRICS)


def test_parse_metrics_older_kv_name() -> None:
    assert VLLM.parse_metrics(OLD_VLLM_METRICS) == LoadSignals(
        waiting=0.0, running=1.0, kv_usage=0.25
    )


def test_parse_metrics_missing_is_none_not_zero() -> None:
    text = "\n".join(
        line
        for line in VLLM_METRICS.splitlines()
        if "waiting" not in line and "kv_" not in line and "generation" not in line
    )
    assert VLLM.parse_metrics(text + "\n") == LoadSignals(waiting=None, running=3.0, kv_usage=None)
    assert VLLM.parse_metrics("") == LoadSignals()
    assert VLLM.parse_metrics("<html>502 Bad Gateway</html>") == LoadSignals()


# --- end to end: the adapter's argv against the stand-ins ---------------------


def wrapper(bin_dir: Path, name: str) -> str:
    """``bin_dir/name`` running the stand-in of that name, as an installed command."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDINS / f"{name}.py"}" "$@"\n')
    path.chmod(0o755)
    return str(path)


class Proc:
    def __init__(self, process: trio.Process, log: Path) -> None:
        self.process = process
        self.log_path = log

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait(self, timeout: float = 10) -> int:
        with trio.fail_after(timeout):
            return await self.process.wait()

    async def terminate(self, timeout: float = 5) -> int:
        self.process.send_signal(signal.SIGTERM)
        return await self.wait(timeout)


@asynccontextmanager
async def running(launch: Launch, log: Path, **env: str) -> AsyncIterator[Proc]:
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            launch.argv,
            env={**os.environ, **launch.env, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Proc(process, log)
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(5):
                await process.wait()


async def wait_healthy(client: httpx.AsyncClient, url: str, proc: Proc) -> int:
    """Poll until 200; returns how many polls were refused first."""
    refused = 0
    with trio.fail_after(20):
        while True:
            try:
                if (await client.get(url)).status_code == 200:
                    return refused
            except httpx.TransportError:
                refused += 1
            assert proc.process.returncode is None, proc.log()
            await trio.sleep(0.05)


async def test_single_node_end_to_end(tmp_path: Path) -> None:
    binaries = {"vllm": wrapper(tmp_path / "bin", "vllm")}
    s = spec(gpus=[2, 3], port=own_port(), settings={"served_model_name": "qwen"})
    assert VLLM.validate(s) == []
    launch = VLLM.launch(s, binaries)
    assert launch.health_url is not None and launch.metrics_url is not None
    async with (
        running(launch, tmp_path / "vllm.log", STANDIN_LOAD_S="0.5") as proc,
        httpx.AsyncClient(trust_env=False, timeout=5) as client,
    ):
        refused = await wait_healthy(client, launch.health_url, proc)
        assert refused > 0  # the port stays closed while "loading"
        models = (await client.get(launch.health_url.replace("/health", "/v1/models"))).json()
        assert [m["id"] for m in models["data"]] == [s.model, "qwen"]
        signals = VLLM.parse_metrics((await client.get(launch.metrics_url)).text)
        assert signals == LoadSignals(
            waiting=0.0, running=0.0, kv_usage=0.0, progress=0.0, cache_hits=0.0, cache_queries=0.0
        )

        base = launch.health_url.removesuffix("/health")
        chat = {"model": "qwen", "messages": [{"role": "user", "content": "hi there"}]}
        reply = (await client.post(f"{base}/v1/chat/completions", json=chat)).json()
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"]["content"] == "Hello from the vLLM stand-in."
        wrong = await client.post(f"{base}/v1/chat/completions", json={**chat, "model": "x"})
        assert wrong.status_code == 404
        # the catalog's name, as the router forwards it, is answered too
        routed = await client.post(f"{base}/v1/chat/completions", json={**chat, "model": s.model})
        assert routed.status_code == 200
        # prefix caching is on and each reply says what it reused (the prompt's one
        # whole block of 16 ids, the second time), as do the metrics
        assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        usage = routed.json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
        after = VLLM.parse_metrics((await client.get(launch.metrics_url)).text)
        assert after.cache_hits == 16 and after.cache_queries == 2 * usage["prompt_tokens"]

        # a streaming request in flight shows in num_requests_running
        async with client.stream(
            "POST", f"{base}/v1/completions", json={"prompt": "hi", "stream": True}
        ) as stream:
            lines = stream.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: ")
            during = VLLM.parse_metrics((await client.get(launch.metrics_url)).text)
            assert during.running == 1.0
            rest = [line async for line in lines if line]
        events = [first] + rest
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert text == "Hello from the vLLM stand-in."

        assert await proc.terminate() == 0
    log = proc.log()
    assert f"vllm stand-in: argv {json.dumps(launch.argv[1:])}" in log
    assert "vllm stand-in: CUDA_VISIBLE_DEVICES=2,3" in log


async def test_the_standin_sleeps_as_vllm_does(tmp_path: Path) -> None:
    """Sleep mode only with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, as vLLM's:
    asleep, generation is a 503 and the rest answers; woken, it generates again."""
    binaries = {"vllm": wrapper(tmp_path / "bin", "vllm")}
    plain = VLLM.launch(spec(gpus=[0], port=own_port()), binaries)
    sleepy = VLLM.launch(spec(gpus=[0], port=own_port(), sleep=True), binaries)
    assert sleepy.health_url and sleepy.metrics_url and sleepy.sleep_url
    assert sleepy.wake_url and sleepy.sleeping_url and plain.health_url
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with (
        running(plain, tmp_path / "plain.log", STANDIN_LOAD_S="0") as p1,
        running(sleepy, tmp_path / "sleepy.log", STANDIN_LOAD_S="0") as p2,
        httpx.AsyncClient(trust_env=False, timeout=5) as client,
    ):
        await wait_healthy(client, plain.health_url, p1)
        await wait_healthy(client, sleepy.health_url, p2)
        base = plain.health_url.removesuffix("/health")
        assert (await client.post(f"{base}/sleep?level=1")).status_code == 404
        assert (await client.get(f"{base}/is_sleeping")).status_code == 404

        base = sleepy.health_url.removesuffix("/health")
        assert (await client.get(sleepy.sleeping_url)).json() == {"is_sleeping": False}
        assert (await client.post(f"{base}/sleep?level=3")).status_code == 400
        asleep = await client.post(sleepy.sleep_url)
        assert (asleep.status_code, asleep.content) == (200, b"")
        assert (await client.get(sleepy.sleeping_url)).json() == {"is_sleeping": True}
        refused = await client.post(f"{base}/v1/chat/completions", json=chat)
        assert refused.status_code == 503
        assert refused.json()["message"] == "The model is sleeping: wake it with POST /wake_up"
        assert (await client.get(sleepy.health_url)).status_code == 200
        assert (await client.get(f"{base}/v1/models")).status_code == 200
        assert (await client.post(f"{base}/tokenize", json={"prompt": "hi"})).status_code == 200
        load = VLLM.parse_metrics((await client.get(sleepy.metrics_url)).text)
        assert (load.running, load.waiting) == (0.0, 0.0)
        awake = await client.post(sleepy.wake_url)
        assert (awake.status_code, awake.content) == (200, b"")
        assert (await client.get(sleepy.sleeping_url)).json() == {"is_sleeping": False}
        served = await client.post(f"{base}/v1/chat/completions", json=chat)
        assert served.json()["choices"][0]["message"]["content"] == "Hello from the vLLM stand-in."


async def test_standin_sleep_fails_when_told_to(tmp_path: Path) -> None:
    launch = VLLM.launch(
        spec(gpus=[0], port=own_port(), sleep=True), {"vllm": wrapper(tmp_path / "bin", "vllm")}
    )
    assert launch.health_url and launch.sleep_url and launch.sleeping_url
    async with (
        running(launch, tmp_path / "vllm.log", STANDIN_LOAD_S="0", STANDIN_SLEEP_FAILS="1") as proc,
        httpx.AsyncClient(trust_env=False, timeout=5) as client,
    ):
        await wait_healthy(client, launch.health_url, proc)
        failed = await client.post(launch.sleep_url)
        assert failed.status_code == 500
        assert failed.json()["message"] == "CUDA error: sleep failed"
        assert (await client.get(launch.sleeping_url)).json() == {"is_sleeping": False}


async def test_standin_refuses_more_parallelism_than_gpus(tmp_path: Path) -> None:
    binaries = {"vllm": wrapper(tmp_path / "bin", "vllm")}
    launch = VLLM.launch(spec(gpus=[0, 1], port=own_port()), binaries)
    # the node lost a GPU between placement and launch
    async with running(launch, tmp_path / "vllm.log", CUDA_VISIBLE_DEVICES="0") as proc:
        assert await proc.wait() != 0
    assert (
        "vllm stand-in: error: tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2 GPUs, "
        "CUDA_VISIBLE_DEVICES='0' has 1"
    ) in proc.log()


async def test_standin_refuses_an_unknown_flag_like_vllm(tmp_path: Path) -> None:
    binaries = {"vllm": wrapper(tmp_path / "bin", "vllm")}
    launch = VLLM.launch(spec(port=own_port(), engine_args=["--no-such-flag"]), binaries)
    async with running(launch, tmp_path / "vllm.log") as proc:
        assert await proc.wait() == 2
    assert "vllm: error: unrecognized arguments: --no-such-flag" in proc.log()


async def test_standin_exits_0_on_sigterm_while_loading(tmp_path: Path) -> None:
    binaries = {"vllm": wrapper(tmp_path / "bin", "vllm")}
    launch = VLLM.launch(spec(port=own_port()), binaries)
    async with running(launch, tmp_path / "vllm.log", STANDIN_LOAD_S="30") as proc:
        with trio.fail_after(10):
            while "pretending to load" not in proc.log():
                await trio.sleep(0.05)
        assert await proc.terminate() == 0


async def test_two_nodes_over_ray_end_to_end(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    binaries = {"vllm": wrapper(bin_dir, "vllm"), "ray": wrapper(bin_dir, "ray")}
    ray_dir = tmp_path / "ray"
    env = {"RAY_STANDIN_DIR": str(ray_dir), "STANDIN_LOAD_S": "0.2", "STANDIN_RAY_WAIT_S": "20"}
    settings: dict[str, str | int | float | bool] = {"ray_port": own_port()}
    common: dict[str, Any] = dict(host="127.0.0.1", head_address="127.0.0.1", gpus=[0])
    rank0 = ray_spec(rank=0, port=own_port(), settings=settings, **common)
    rank1 = ray_spec(rank=1, port=0, settings=settings, **common)
    assert VLLM_RAY.validate(rank0) == [] and VLLM_RAY.validate(rank1) == []
    head_launch = VLLM_RAY.launch(rank0, binaries)
    worker_launch = VLLM_RAY.launch(rank1, binaries)
    assert head_launch.health_url is not None
    try:
        async with (
            running(head_launch, tmp_path / "rank0.log", **env) as head,
            httpx.AsyncClient(trust_env=False, timeout=5) as client,
        ):
            # rank 0's vLLM waits for the second node's GPU (TP 1 x PP 2)
            with trio.fail_after(10):
                while "ray stand-in: started a head" not in head.log():
                    await trio.sleep(0.05)
            async with running(worker_launch, tmp_path / "rank1.log", **env) as worker:
                await wait_healthy(client, head_launch.health_url, head)
                models = await client.get(head_launch.health_url.replace("/health", "/v1/models"))
                assert [m["id"] for m in models.json()["data"]] == ["Qwen/Qwen3-8B"]
                assert "vllm stand-in: the Ray cluster has 2 GPUs" in head.log()
                assert worker.process.returncode is None  # blocks while joined
                assert await head.terminate() == 0  # exec: the signal reaches vLLM itself
                assert await worker.terminate() == 0
            assert "--distributed-executor-backend" in head.log()
            assert "joined the head at 127.0.0.1:" in worker.log()
    finally:
        await trio.run_process([binaries["ray"], "stop"], env={**os.environ, **env}, check=False)
    assert not (ray_dir / "head.json").exists()


async def test_a_worker_with_no_head_fails_clearly(tmp_path: Path) -> None:
    binaries = {"ray": wrapper(tmp_path / "bin", "ray"), "vllm": "/unused"}
    port = own_port()
    s = ray_spec(
        rank=1, port=0, host="127.0.0.1", head_address="127.0.0.1", settings={"ray_port": port}
    )
    launch = VLLM_RAY.launch(s, binaries)
    async with running(launch, tmp_path / "worker.log", RAY_STANDIN_JOIN_WAIT_S="1") as proc:
        assert await proc.wait() == 1
    # as Ray's worker, it tries for a while, saying why, before it gives up
    assert f"Unable to connect to GCS at 127.0.0.1:{port}" in proc.log()
    assert f"ray stand-in: error: cannot reach the Ray head at 127.0.0.1:{port}" in proc.log()


async def test_rank_0_serves_only_once_every_rank_joined_and_dies_with_a_rank(
    tmp_path: Path,
) -> None:
    """As with real Ray and vLLM: a worker started before the head waits for it; vLLM
    waits for every rank's GPUs before it serves; a rank that leaves ends vLLM."""
    bin_dir = tmp_path / "bin"
    binaries = {"vllm": wrapper(bin_dir, "vllm"), "ray": wrapper(bin_dir, "ray")}
    env = {"RAY_STANDIN_DIR": str(tmp_path / "ray"), "STANDIN_LOAD_S": "0.1"}
    settings: dict[str, str | int | float | bool] = {"ray_port": own_port()}
    common: dict[str, Any] = dict(host="127.0.0.1", head_address="127.0.0.1", gpus=[0])
    ranks = [ray_spec(rank=r, world_size=3, port=own_port(), settings=settings, **common)
             for r in range(3)]  # fmt: skip
    head = VLLM_RAY.launch(ranks[0], binaries)
    assert head.health_url is not None
    try:
        async with (
            # rank 1 first: it waits for the head instead of failing
            running(VLLM_RAY.launch(ranks[1], binaries), tmp_path / "r1.log", **env) as r1,
            running(head, tmp_path / "r0.log", **env) as r0,
            httpx.AsyncClient(trust_env=False, timeout=5) as client,
        ):
            with trio.fail_after(10):
                while "joined the head" not in r1.log():
                    await trio.sleep(0.05)
            await trio.sleep(1)  # rank 0 has 2 of 3 GPUs: it must not serve
            assert r0.process.returncode is None
            with pytest.raises(httpx.HTTPError):
                await client.get(head.health_url)
            async with running(
                VLLM_RAY.launch(ranks[2], binaries), tmp_path / "r2.log", **env
            ) as r2:
                await wait_healthy(client, head.health_url, r0)
                assert "the Ray cluster has 3 GPUs" in r0.log()
                assert await r2.terminate() == 0  # a rank leaves
                assert await r0.wait(10) == 1
            assert "a Ray worker died: the cluster has 2 of 3 GPUs" in r0.log()
    finally:
        await trio.run_process([binaries["ray"], "stop"], env={**os.environ, **env}, check=False)


async def test_vllm_over_ray_with_no_cluster_fails(tmp_path: Path) -> None:
    vllm = wrapper(tmp_path / "bin", "vllm")
    argv = [vllm, "serve", "m", "--port", str(own_port()), "--distributed-executor-backend", "ray"]
    launch = Launch(
        argv=argv, env={"RAY_STANDIN_DIR": str(tmp_path / "ray")}, health_url=None, metrics_url=None
    )
    async with running(launch, tmp_path / "vllm.log", STANDIN_FAIL_S="0") as proc:
        assert await proc.wait() == 1
    assert "no Ray cluster runs here" in proc.log()

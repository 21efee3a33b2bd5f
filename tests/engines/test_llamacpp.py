"""The llama.cpp adapter: exact command lines, and refusals before launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.engines.llamacpp import LLAMA_CPP
from llmgw.protocol.messages import ShardSpec
from tests.agent.discovery.test_weights import write_gguf

BIN = {"llama-server": "/opt/llama/bin/llama-server"}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


def spec(model: Path | str, **kw: object) -> ShardSpec:
    base: dict[str, object] = {
        "shard_id": "s1",
        "replica_id": "r1",
        "model": "tiny",
        "profile": "cpu",
        "engine": "llama.cpp",
        "host": "127.0.0.1",
        "port": 20001,
        "model_path": str(model),
    }
    base.update(kw)
    return ShardSpec(**base)  # type: ignore[arg-type]


def test_command_line_from_a_cpu_profile(model: Path) -> None:
    s = spec(model, settings={"context": 512, "parallel": 1, "threads": 1, "threads_batch": 1})
    launch = LLAMA_CPP.launch(s, BIN)
    assert launch.argv == [
        "/opt/llama/bin/llama-server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", "20001",
        "--ctx-size", "512",
        "--parallel", "1",
        "--n-gpu-layers", "0",
        "--alias", "tiny",
        "--metrics",
        "--slots",
        "--threads", "1",
        "--threads-batch", "1",
    ]  # fmt: skip
    assert launch.env == {"CUDA_VISIBLE_DEVICES": ""}  # a CPU shard sees no GPU
    assert launch.health_url == "http://127.0.0.1:20001/health"
    assert launch.metrics_url == "http://127.0.0.1:20001/metrics"


def test_gpus_are_pinned_and_all_layers_offloaded(model: Path) -> None:
    s = spec(model, gpus=[2, 3], host="0.0.0.0", engine_args=["--flash-attn", "on"], env={"X": "1"})
    launch = LLAMA_CPP.launch(s, BIN)
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "2,3", "X": "1"}
    assert launch.argv[launch.argv.index("--n-gpu-layers") + 1] == "999"
    assert launch.argv[-2:] == ["--flash-attn", "on"]
    assert launch.health_url == "http://127.0.0.1:20001/health"  # 0.0.0.0 is not dialable
    v6 = LLAMA_CPP.launch(spec(model, host="::1"), BIN)
    assert v6.health_url == "http://[::1]:20001/health"


def test_a_good_spec_has_no_problems(model: Path) -> None:
    assert LLAMA_CPP.validate(spec(model, settings={"context": 512})) == []


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"settings": {"contxt": 512}}, "unknown setting 'contxt' for llama.cpp"),
        ({"settings": {"context": 8}}, "context must be at least 16, got 8"),
        ({"settings": {"context": 64, "parallel": 8}}, "context 64 shared by 8 slots leaves 8"),
        ({"settings": {"threads": "two"}}, "threads must be a whole number, got 'two'"),
        ({"settings": {"gpu_layers": -5}}, "gpu_layers must be at least -1, got -5"),
        ({"port": 0}, "port 0 is not a TCP port"),
        ({"world_size": 2}, "llama.cpp runs on one node; this profile asks for 2"),
        (
            {"engine_args": ["--port=9"]},
            "engine_args sets --port, which comes from the profile's port",
        ),
        (
            {"engine_args": ["-c", "9"]},
            "engine_args sets -c, which comes from the profile's context",
        ),
        ({"model_path": ""}, "llama.cpp needs model_path"),
    ],
)
def test_refusals_name_the_problem(model: Path, kw: dict[str, object], problem: str) -> None:
    problems = LLAMA_CPP.validate(spec(model, **kw))
    assert any(problem in p for p in problems), problems


def test_a_missing_or_partial_model_is_refused(tmp_path: Path, model: Path) -> None:
    assert LLAMA_CPP.validate(spec(tmp_path / "nope.gguf")) == [
        f"model file {tmp_path / 'nope.gguf'} does not exist on this node"
    ]
    partial = tmp_path / "partial.gguf"
    partial.write_bytes(model.read_bytes()[:-100])  # a half-finished download
    [problem] = LLAMA_CPP.validate(spec(partial))
    assert problem.startswith(f"model file {partial} is not a whole GGUF model: truncated")


def test_load_signals_from_llama_server_metrics() -> None:
    text = (
        "# HELP llamacpp:requests_processing Number of requests processing.\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 2\n"
        "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
        "# TYPE llamacpp:requests_deferred gauge\n"
        "llamacpp:requests_deferred 5\n"
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        "llamacpp:prompt_tokens_total 120\n"
    )
    load = LLAMA_CPP.parse_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (2.0, 5.0, None)
    assert LLAMA_CPP.parse_metrics("not prometheus {{{") == LLAMA_CPP.parse_metrics("")

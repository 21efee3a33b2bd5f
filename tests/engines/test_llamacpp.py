"""The llama.cpp adapter: exact command lines, and refusals before launch."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.engines.base import LoadSignals, prompt_reuse
from llmgw.engines.llamacpp import LLAMA_CPP
from llmgw.engines.load import read_load
from llmgw.protocol.messages import ShardSpec
from tests.agent.discovery.test_weights import write_gguf
from tests.cluster.test_engine_processes import free_port
from tests.realparts import LLAMA_SERVER, needs_server
from tools.support.tinymodel import write_model

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
        "--cache-prompt",
        "--cache-ram", "8192",
        "--slot-prompt-similarity", "0.5",
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


def test_an_embedding_profile_starts_the_server_for_embeddings(model: Path) -> None:
    """embeddings = true: /v1/embeddings is served (--embeddings), with the pooling asked
    for, or the model's own when none is."""
    pooled = spec(model, settings={"embeddings": True, "pooling": "mean"})
    assert LLAMA_CPP.validate(pooled) == []
    assert LLAMA_CPP.launch(pooled, BIN).argv[-3:] == ["--embeddings", "--pooling", "mean"]
    own = spec(model, settings={"embeddings": True})
    assert LLAMA_CPP.launch(own, BIN).argv[-2:] == ["0.5", "--embeddings"]
    plain = spec(model, settings={"embeddings": False})
    assert "--embeddings" not in LLAMA_CPP.launch(plain, BIN).argv


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
        ({"settings": {"embeddings": "yes"}}, "embeddings must be true or false, got 'yes'"),
        (
            {"settings": {"embeddings": True, "pooling": "none"}},
            "pooling must be one of mean, cls, last, rank, got 'none'",
        ),
        (
            {"settings": {"pooling": "mean"}},
            "pooling applies to an embedding model: set embeddings = true",
        ),
        (
            {"engine_args": ["--embeddings"]},
            "engine_args sets --embeddings, which comes from the profile's embeddings",
        ),
        (
            {"engine_args": ["--cache-ram", "0"]},
            "engine_args sets --cache-ram, which comes from the profile's cache_ram_mib",
        ),
        ({"settings": {"cache_ram_mib": -2}}, "cache_ram_mib must be at least -1, got -2"),
        (
            {"settings": {"slot_prompt_similarity": 1.5}},
            "slot_prompt_similarity must be in [0, 1], got 1.5",
        ),
        (
            {"sleep": True},
            "the profile's sleep_s asks idle replicas to sleep, but llama.cpp cannot sleep: "
            "set sleep_s to 0",
        ),
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
        "# HELP llamacpp:n_decode_total Total number of llama_decode() calls\n"
        "# TYPE llamacpp:n_decode_total counter\n"
        "llamacpp:n_decode_total 1301\n"
        "# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused.\n"
        "# TYPE llamacpp:prompt_tokens_cached_total counter\n"
        "llamacpp:prompt_tokens_cached_total 360\n"
    )
    load = LLAMA_CPP.parse_metrics(text)
    assert (load.running, load.waiting, load.kv_usage, load.progress) == (2.0, 5.0, None, 1301)
    # prompt_tokens_total counts what it computed: looked up is both
    assert (load.cache_hits, load.cache_queries) == (360.0, 480.0)
    assert LLAMA_CPP.parse_metrics("not prometheus {{{") == LLAMA_CPP.parse_metrics("")


# --- KV usage from /slots -----------------------------------------------------------

SLOTS = Path(__file__).parent.parent / "fixtures" / "llama-server"


def test_kv_usage_is_what_busy_slots_hold_of_every_slots_context() -> None:
    """Real /slots from llama-server b11434 (-np 2 -c 8192): slot 1 busy with 866 tokens
    (its prompt and what it had generated), slot 0 idle; after the request, slot 1
    still reports its 3,015 tokens, but idle: its cache is free for the next request."""
    busy = LLAMA_CPP.parse_usage((SLOTS / "slots-busy.json").read_bytes())
    assert busy == LoadSignals(kv_usage=866 / 8192, slots=2.0)
    after = LLAMA_CPP.parse_usage((SLOTS / "slots-idle-after.json").read_bytes())
    assert after == LoadSignals(kv_usage=0.0, slots=2.0)
    for bad in (b"", b"[]", b'{"error": "slots disabled"}', b"<html>", b'[{"n_ctx": "x"}]'):
        assert LLAMA_CPP.parse_usage(bad) is None, bad


@needs_server
async def test_a_running_llama_server_reads_as_filling_while_a_request_runs(
    tmp_path: Path,
) -> None:
    """The command line the adapter builds, run for real: its /metrics and /slots read
    together (as the router and ctl bench read them) say the slots it has, and KV
    usage that rises while a long request runs and falls back to 0 when it ends."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=4096)
    port = free_port()
    launch = LLAMA_CPP.launch(
        spec(model, port=port, settings={"context": 8192, "parallel": 2, "threads": 1}),
        {"llama-server": str(LLAMA_SERVER)},
    )
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "llama.log").open("wb")
    proc = await trio.lowlevel.open_process(launch.argv, stdout=log, stderr=subprocess.STDOUT)
    readings: list[LoadSignals] = []
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await client.get(base + "/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.05)
            async with trio.open_nursery() as nursery:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                        "ignore_eos": True}  # fmt: skip
                done = trio.Event()

                async def long_request() -> None:
                    r = await client.post(base + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    done.set()

                nursery.start_soon(long_request)
                with trio.fail_after(30):
                    while not done.is_set():
                        load = await read_load(client, base, LLAMA_CPP, {})
                        assert load is not None
                        readings.append(load)
                        await trio.sleep(0.05)
            after = await read_load(client, base, LLAMA_CPP, {})
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()
    filling = [r.kv_usage for r in readings if r.kv_usage]
    assert filling, f"no reading saw the request in its slot: {readings}"
    assert all(r.slots == 2 for r in readings)
    assert 0 < max(filling) <= 3016 / 8192 + 1e-9
    assert filling == sorted(filling)  # it only grows while the request generates
    assert after is not None and (after.kv_usage, after.running) == (0.0, 0.0)


@needs_server
async def test_the_real_server_caches_prompts_and_says_what_each_reply_reused(
    tmp_path: Path,
) -> None:
    """The adapter's command line, run for real: a prompt cache of the profile's size,
    a second request that shares the first's long prefix computes only the rest, and
    its reply (whole, and a stream's last chunk) and the metrics say so."""
    model = write_model(tmp_path / "never.gguf", ends_after=None, context_length=4096)
    port = free_port()
    launch = LLAMA_CPP.launch(
        spec(model, port=port, settings={"context": 4096, "threads": 1, "cache_ram_mib": 64}),
        {"llama-server": str(LLAMA_SERVER)},
    )
    assert launch.argv[launch.argv.index("--cache-ram") + 1] == "64"
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "llama.log").open("wb")
    proc = await trio.lowlevel.open_process(launch.argv, stdout=log, stderr=subprocess.STDOUT)
    system = {"role": "system", "content": "Rules of the house. " * 60}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await client.get(base + "/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.05)

            async def ask(question: str, stream: bool = False) -> bytes:
                body = {"messages": [system, {"role": "user", "content": question}],
                        "max_tokens": 4, "stream": stream}  # fmt: skip
                r = await client.post(base + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.content

            first = prompt_reuse(await ask("What is the first rule?"))
            assert first is not None and first[0] == 0 and first[1] > 200
            second = prompt_reuse(await ask("And the second?"))
            assert second is not None and second[0] > 0.8 * first[1], (first, second)
            streamed = (await ask("And the third?", stream=True)).split(b"\n\n")
            last = next(e for e in reversed(streamed) if b"timings" in e)
            reused = prompt_reuse(last)
            assert reused is not None and reused[0] > 0.8 * first[1]
            load = LLAMA_CPP.parse_metrics((await client.get(base + "/metrics")).text)
            assert load.cache_hits == second[0] + reused[0]
            assert load.cache_queries == first[1] + second[1] + reused[1]
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()

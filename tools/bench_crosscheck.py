"""Cross-check a throughput sweep against guidellm, a well-known benchmark tool.

Issue 15 asks that ``llmgw ctl bench``'s figures agree with an outside tool's
sweep on the same llama-server, at the same concurrency, within 15 %. This
script starts a real llama-server with a random-weight test model whose
replies never end before ``max_tokens`` (``--model slow``, the default:
``tools/support/slowmodel.py``, a couple of hundred tokens per second on one thread;
``--model tiny``: ``tools/support/tinymodel.py``, thousands) and, at each of a few
fixed concurrencies, runs guidellm's
concurrent profile against it and then our own ladder (``llmgw.bench.ladder``,
what ``ctl bench`` runs) at the same concurrency, one after the other, never at
once. It prints requests/s and output tokens/s per level for both, and the
ratio ours / guidellm, as a table or as JSON.

    python -m tools.bench_crosscheck                      # c = 1, 2, 4
    python -m tools.bench_crosscheck -c 1 -c 4 --json
    python -m tools.bench_crosscheck --venv /tmp/xcheck-venv --requests 64
    python -m tools.bench_crosscheck --prompt-tokens 32 --output-tokens 448
    python -m tools.bench_crosscheck -c 1 --requests 100000 --ours-first
    python -m tools.bench_crosscheck --model tiny --seconds 20

guidellm lives in its own virtualenv (it pulls in torch and transformers), made
once with::

    python -m venv /tmp/xcheck-venv && /tmp/xcheck-venv/bin/pip install guidellm==0.8.1

How both sides do the same work:

- **Prompts**: guidellm's ``synthetic_text`` data makes each prompt from a
  counter (``"<pass> <sample> m0 "``) and Faker lorem text, encodes it with
  the tokenizer, cuts it to ``prompt_tokens`` tokens and decodes it. No two are
  alike within a run, but a run with the same seed sends the same prompts
  again, and llama-server's prompt cache then answers their prefill; so each
  level gets its own seed. The tokenizer here is the test models' own
  vocabulary and merges (the slow model has the tiny one's tokenizer), written as a Hugging Face ``tokenizer.json`` (no
  download), so the count is the engine's count; the chat template adds its
  ChatML framing (14 tokens) on the server.
- **Output**: every request is a streaming ``/v1/chat/completions`` with
  ``max_completion_tokens = output_tokens``, ``ignore_eos: true`` and
  ``stream_options.include_usage``; guidellm takes token counts from the
  ``usage`` the server returns. Neither model emits its end token, so
  every reply is exactly ``output_tokens`` long whatever the client sends.
- **Concurrency**: guidellm's ``concurrent`` profile keeps N requests in
  flight. llama-server gets ``--parallel`` = the largest N (and
  ``512 * N`` tokens of context, 512 a slot), or requests would queue for a
  slot and the level would measure a smaller concurrency.
- **Bounds**: each guidellm level stops after ``--requests`` requests or
  ``--seconds`` seconds, whichever comes first; our ladder then runs the same
  concurrency for as long as guidellm's level measured (the ladder has a
  duration, not a request count), so both windows are about the same length
  and hold about as many requests. The windows end differently: guidellm
  cancels the requests still in flight when its window closes ("incomplete")
  and leaves their tokens out of its figure, while our requests started before
  the end finish inside our window. With replies of a few seconds that makes
  guidellm's figure lower by up to half a reply per stream over the window;
  ``all tok/s`` is guidellm's count with the incomplete requests' tokens (its
  report has them), what the server made for it over the window, which is
  what our figure counts. Every guidellm run and every ladder level
  has a wall-clock timeout, and every process started here is killed on the
  way out (errors, Ctrl-C, SIGTERM included).
- **Our side**: ``Ladder`` with one level, an SLO that nothing breaks, and a
  ``PromptMaker`` whose word count is calibrated against llama-server's own
  ``/tokenize`` so that its prompts are as many tokens as guidellm's (its
  words are not one token each in the test models' 384-token vocabulary).
  Both tools send a user message only, so the server adds the same framing.
- **Order and warm-up**: one request warms llama-server before anything is
  measured; at each level guidellm runs first (its window sets ours), then
  ours (``--ours-first``: the other way round, ours for ``--seconds``). Each
  figure is completed requests (or their ``usage`` output tokens) over the
  window from the first request sent to the last one finished; guidellm's
  warm-up and cool-down are off (0 s), so its window is the same kind.

The server referees. Before and after each tool's level the script reads
llama-server's ``/metrics`` counters: output tokens it generated over the
tool's window (``server tok/s``, which should equal the tool's own figure),
prompt tokens it evaluated and took from its cache per request, and the mean
number of slots busy over the window (``busy slots``: the concurrency the
server actually saw, below the tool's when its client leaves gaps between a
reply and the next request). ``client CPUs`` is the CPU the client used over
its window (guidellm's whole process group, sampled from ``/proc``; our
process's CPU time), in cores.

On a small machine the client shares the CPUs with llama-server. The tiny
model answers a 128-token reply in about 40 ms (3,000-4,000 tokens/s on one
thread), so each client's own CPU per token (guidellm's ~0.6-0.9 cores, ours
~0.3-0.5 on 2 cores) competes with the server and slows it differently: the
figures then say as much about each client as about the server (up to 40 %
apart, though the server's counters match each tool's own figure). The slow
model (n_embd 768, 8 layers, F16, ~110 MB) makes the server the bottleneck:
~180 tokens/s on one thread, so the clients' per-token CPU is small.
``--pin`` puts llama-server on its own CPU(s) and the clients on the rest; on
2 CPUs that starves llama-server's HTTP threads and makes things worse.

``external_sweep()`` is the piece another measurement plugs into: give it a
base URL that serves OpenAI chat completions and it returns one row per
concurrency; ``ladder_level()`` returns our row with the same keys.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

from llmgw.bench.ladder import Ladder, Slo
from llmgw.bench.prompts import Dist, PromptMaker
from tools.support import slowmodel
from tools.support import tinymodel as tm
from tools.support.llama import llama_server
from tools.support.procs import Proc

TOOL = "guidellm"
TOOL_VERSION = "0.8.1"
DEFAULT_VENV = Path("/tmp/xcheck-venv")
INSTALL_HINT = (
    f"install it with: python -m venv {DEFAULT_VENV} && "
    f"{DEFAULT_VENV}/bin/pip install {TOOL}=={TOOL_VERSION}"
)
SLOT_CONTEXT = 512  # both test models' trained context, a slot's limit
MODELS = ("slow", "tiny")  # tools/support/slowmodel.py, tools/support/tinymodel.py


class ToolMissing(RuntimeError):
    """The external benchmark tool is not installed where we were told to look."""


# --- processes ----------------------------------------------------------------------


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of group ``pgid`` have used."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # state ppid pgrp ... utime (12th) stime (13th)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def cpu_between(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """CPU seconds used between wall-clock times ``start`` and ``end``, interpolated
    from ``(time.time(), cpu seconds)`` samples; None when they do not cover it."""

    def at(t: float) -> float | None:
        for (t0, c0), (t1, c1) in itertools.pairwise(samples):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return None

    a, b = at(start), at(end)
    return None if a is None or b is None else b - a


def _run_bounded(
    argv: Sequence[str],
    log: Path,
    timeout: float,
    env: dict[str, str],
    cpu_samples: list[tuple[float, float]] | None = None,
) -> int:
    """Run ``argv`` in its own process group with its output in ``log`` (``DIR/NAME.log``);
    kill it after ``timeout`` seconds (and on any exception, KeyboardInterrupt included).
    Meanwhile, four times a second, append the group's CPU seconds to ``cpu_samples``."""
    proc = Proc(log.stem, argv, log.parent, env=env, session=True, fresh=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if cpu_samples is not None:
                cpu_samples.append((time.time(), group_cpu_s(proc.pid)))
            try:
                return proc.popen.wait(timeout=min(0.25, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"{Path(argv[0]).name} ran past {timeout:.0f} s; its log: {log}"
                    ) from None
    finally:
        proc.stop()  # and what is left of its group: guidellm's worker processes


@contextlib.contextmanager
def cpus(which: set[int] | None) -> Iterator[None]:
    """Run this thread, and every process it starts meanwhile, on ``which`` CPUs (a
    child inherits its parent's affinity); None leaves it alone."""
    if which is None:
        yield
        return
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, which)
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


def split_cpus(server_threads: int) -> tuple[set[int], set[int]] | None:
    """Some CPUs for llama-server and the others for the clients, or None when there are
    too few to split: on a small machine a client that takes a core away from the
    server measures its own cost as the server's throughput."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) <= server_threads:
        return None
    return set(mine[:server_threads]), set(mine[server_threads:])


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def served_model(base_url: str) -> str:
    """The model id llama-server answers to (its /v1/models)."""
    data = _get_json(f"{base_url}/v1/models")
    return str(data["data"][0]["id"])


# --- the tokenizer guidellm sizes prompts with -----------------------------------------


def write_tiny_tokenizer(out: Path) -> Path:
    """The tiny model's byte-level BPE as a Hugging Face tokenizer directory.

    Same vocabulary, merges and pre-tokenizer regex (GPT-2's) as the GGUF file,
    so guidellm's prompt token counts are llama-server's counts, offline."""
    vocab = tm.build_vocab()
    n_special = len(tm.SPECIAL_TOKENS)
    regular = vocab.tokens[: len(vocab.tokens) - n_special]
    specials = [
        {
            "id": vocab.id(tok),
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for tok in tm.SPECIAL_TOKENS
    ]
    ids: dict[str, int] = {t: i for i, t in enumerate(regular)}
    ids.update({tok: vocab.id(tok) for tok in tm.SPECIAL_TOKENS})
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": ids,
            "merges": [f"{a} {b}" for a, b in vocab.merges],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tm.ENDOFTEXT,
        "eos_token": tm.IM_END,
        "pad_token": tm.ENDOFTEXT,
        "model_max_length": SLOT_CONTEXT,
        "chat_template": tm.CHATML_TEMPLATE,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


# --- guidellm ---------------------------------------------------------------------------


def tool_executable(venv: Path) -> Path:
    """``venv``'s guidellm, or ToolMissing with the line that says how to install it."""
    exe = venv / "bin" / TOOL
    if not exe.is_file() or not os.access(exe, os.X_OK):
        raise ToolMissing(f"{TOOL} not found in {venv}; {INSTALL_HINT}")
    return exe


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _stat(metrics: dict[str, Any], name: str, key: str, which: str = "successful") -> float | None:
    """``metrics[name][which][key]`` from guidellm's report, or None; ``which`` is
    successful, incomplete, errored or total (the three together)."""
    entry = metrics.get(name)
    if not isinstance(entry, dict):
        return None
    successful = entry.get(which)
    if not isinstance(successful, dict):
        return None
    if key.startswith("p"):
        pcts = successful.get("percentiles")
        return _num(pcts.get(key)) if isinstance(pcts, dict) else None
    return _num(successful.get(key))


def parse_report(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark (concurrency level) of a guidellm JSON report."""
    rows = []
    for bench in report.get("benchmarks", []):
        if not isinstance(bench, dict):
            continue
        strategy = bench.get("config", {}).get("strategy", {})
        metrics = bench.get("metrics", {})
        totals = metrics.get("request_totals", {})
        ok = _num(totals.get("successful")) or 0.0
        errored = _num(totals.get("errored")) or 0.0
        incomplete = _num(totals.get("incomplete")) or 0.0
        duration = _num(bench.get("duration"))
        out_total = _stat(metrics, "output_token_count", "total_sum")
        # with the tokens of the requests cut off at the end of the window
        out_all = _stat(metrics, "output_token_count", "total_sum", "total")
        window = duration if duration else None
        rows.append(
            {
                "tool": TOOL,
                "concurrency": strategy.get("streams"),
                "requests": int(ok),
                "errors": int(errored),
                "incomplete": int(incomplete),
                "duration_s": duration,
                "start_time": bench.get("start_time"),  # wall clock, time.time()
                "end_time": bench.get("end_time"),
                # guidellm's own figures: means of its rate-over-time distributions
                "requests_per_s": _stat(metrics, "requests_per_second", "mean"),
                "output_tokens_per_s": _stat(metrics, "output_tokens_per_second", "mean"),
                # the plain count over the measured window, for a second opinion
                "window_requests_per_s": ok / window if window else None,
                "window_output_tokens_per_s": (
                    out_total / window if window and out_total is not None else None
                ),
                "all_output_tokens_per_s": (
                    out_all / window if window and out_all is not None else None
                ),
                "prompt_tokens_mean": _stat(metrics, "prompt_token_count", "mean"),
                "output_tokens_mean": _stat(metrics, "output_token_count", "mean"),
                "ttft_p50_ms": _stat(metrics, "time_to_first_token_ms", "p50"),
                "ttft_p95_ms": _stat(metrics, "time_to_first_token_ms", "p95"),
                "itl_p50_ms": _stat(metrics, "inter_token_latency_ms", "p50"),
                "itl_p95_ms": _stat(metrics, "inter_token_latency_ms", "p95"),
                "latency_p50_s": _stat(metrics, "request_latency", "p50"),
            }
        )
    return rows


def external_sweep(
    base_url: str,
    model: str,
    concurrencies: Sequence[int],
    prompt_tokens: int,
    output_tokens: int,
    *,
    tokenizer: str | Path,
    venv: Path = DEFAULT_VENV,
    requests_per_level: int = 200,
    seconds_per_level: float = 20.0,
    workdir: Path | None = None,
    seed: int = 42,
) -> list[dict[str, Any]]:
    """Run guidellm's concurrent profile at each of ``concurrencies`` against
    ``base_url`` (an OpenAI-compatible server, without ``/v1``) and return one row per
    level: concurrency, requests, errors, requests_per_s, output_tokens_per_s, mean
    prompt and output tokens, TTFT/ITL p50/p95 (ms).

    ``tokenizer`` is a local Hugging Face tokenizer directory (nothing is downloaded)
    that sizes the prompts; for the tiny model, ``write_tiny_tokenizer()``. Each level
    stops after ``requests_per_level`` requests or ``seconds_per_level`` seconds.
    Raises ToolMissing when guidellm is not in ``venv``, RuntimeError when it fails."""
    exe = tool_executable(venv)
    levels = sorted(set(concurrencies))
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="xcheck-")))
        report_path = workdir / f"{TOOL}.json"
        scenario_path = workdir / f"{TOOL}-scenario.json"
        scenario = {
            "spec": {
                "backend": {
                    "kind": "openai_http",
                    "target": base_url,
                    "model": model,
                    "request_format": "/v1/chat/completions",
                    "stream": True,
                    "timeout": seconds_per_level + 30.0,
                },
                "profile": {"kind": "concurrent", "streams": levels},
                "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
                "data": [
                    {
                        "kind": "synthetic_text",
                        "prompt_tokens": prompt_tokens,
                        "output_tokens": output_tokens,
                    }
                ],
                "constraints": [
                    {"kind": "max_requests", "count": requests_per_level},
                    {"kind": "max_duration", "seconds": seconds_per_level},
                ],
                "seed": {"kind": "static", "value": seed},
                "outputs": [{"kind": "json", "path": str(report_path)}],
            }
        }
        scenario_path.write_text(json.dumps(scenario, indent=2))
        argv = [str(exe), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]
        env = {
            **os.environ,
            # offline and quiet: no hub lookups, no telemetry
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        budget = 120.0 + len(levels) * (seconds_per_level + 30.0)
        log = workdir / f"{TOOL}.log"
        cpu_samples: list[tuple[float, float]] = []
        rc = _run_bounded(argv, log, budget, env, cpu_samples)
        if rc != 0 or not report_path.is_file():
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"{TOOL} exited {rc}; its log ({log}) ends:\n" + "\n".join(tail))
        report = json.loads(report_path.read_text())
    if not isinstance(report, dict):
        raise RuntimeError(f"{TOOL}'s report is not a JSON object")
    rows = parse_report(report)
    for row, level in zip(rows, levels, strict=False):
        if row["concurrency"] is None:
            row["concurrency"] = level
        start, end = row.pop("start_time"), row.pop("end_time")
        if isinstance(start, int | float) and isinstance(end, int | float) and end > start:
            used = cpu_between(cpu_samples, start, end)
            row["client_cpu_cores"] = None if used is None else used / (end - start)
    return rows


# --- our ladder, same server, same work --------------------------------------------------

OURS = "llmgw"


def _post_json(url: str, body: dict[str, Any], timeout: float = 30.0) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def warm_up(base_url: str, model: str, output_tokens: int) -> None:
    """One request, so that neither tool measures llama-server's first graph builds."""
    _post_json(
        f"{base_url}/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": output_tokens,
            "ignore_eos": True,
        },
    )


def _prompt_maker(words: int, output_tokens: int, seed: int | None = None) -> PromptMaker:
    return PromptMaker(
        input_words=Dist("fixed", float(words)),
        output_tokens=Dist("fixed", float(output_tokens)),
        seed=seed,
    )


def prompt_tokens_for(base_url: str, words: int, samples: int = 16) -> float:
    """Mean tokens (llama-server's ``/tokenize``) of ``samples`` of our prompts of
    ``words`` words, without the chat template's framing."""
    maker = _prompt_maker(words, 1, seed=words)  # fixed draws: the search is monotone
    counts = []
    for _ in range(samples):
        prompt, _ = maker.next()
        counts.append(len(_post_json(f"{base_url}/tokenize", {"content": prompt})["tokens"]))
    return sum(counts) / len(counts)


def calibrate_words(base_url: str, prompt_tokens: int) -> tuple[int, float]:
    """The word count whose prompts are closest to ``prompt_tokens`` tokens on this
    server, and their mean token count."""
    lo, hi = 1, max(2, prompt_tokens)
    while prompt_tokens_for(base_url, hi) < prompt_tokens and hi < 8 * prompt_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # bisect for the first count at or above the target
        mid = (lo + hi) // 2
        if prompt_tokens_for(base_url, mid) < prompt_tokens:
            lo = mid
        else:
            hi = mid
    return min(
        ((w, prompt_tokens_for(base_url, w)) for w in (lo, hi)),
        key=lambda wt: abs(wt[1] - prompt_tokens),
    )


def ladder_level(
    base_url: str,
    model: str,
    concurrency: int,
    words: int,
    output_tokens: int,
    duration_s: float,
    request_timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Our ladder (``llmgw.bench.ladder``, as ``ctl bench`` builds it) at one
    concurrency for ``duration_s`` against ``base_url`` (no ``/v1``); one row with the
    keys ``parse_report()`` gives guidellm's levels."""
    ladder = Ladder(
        base_url=f"{base_url}/v1",
        model=model,
        api_key="",
        prompts=_prompt_maker(words, output_tokens),  # random headers: no prompt-cache hits
        slo=Slo({"error_rate": 1.0}),  # never broken: errors are shown, not a reason to stop
        levels=[concurrency],
        duration_s=duration_s,
        request_timeout_s=request_timeout_s,
        scrapes=(),
    )
    bound = duration_s + request_timeout_s + 15.0
    levels: list[Any] = []
    terminated = False

    async def run() -> None:
        async def climb(scope: trio.CancelScope) -> None:
            levels.extend(await ladder.run())
            scope.cancel()

        async def watch(scope: trio.CancelScope) -> None:
            # SIGTERM the trio way (its handler is ours again once trio.run returns):
            # raising from a signal handler inside trio.run leaves its tasks half done
            nonlocal terminated
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    terminated = True
                    scope.cancel()

        with trio.fail_after(bound):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(climb, nursery.cancel_scope)
                nursery.start_soon(watch, nursery.cancel_scope)

    cpu, wall = time.process_time(), time.monotonic()
    try:
        trio.run(run)
    except trio.TooSlowError:
        raise RuntimeError(
            f"our ladder ran past {bound:.0f} s at concurrency {concurrency}"
        ) from None
    if terminated:
        raise SystemExit(128 + signal.SIGTERM)
    (level,) = levels

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    client_cpu_cores = (time.process_time() - cpu) / (time.monotonic() - wall)
    ok = level.requests - level.errors
    return {
        "tool": OURS,
        "concurrency": concurrency,
        "requests": ok,
        "errors": level.errors,
        "incomplete": 0,
        "duration_s": level.duration_s,
        "requests_per_s": level.rps,
        "output_tokens_per_s": level.output_tps,
        "window_requests_per_s": level.rps,
        "window_output_tokens_per_s": level.output_tps,
        "all_output_tokens_per_s": level.output_tps,  # every request finishes in the window
        "prompt_tokens_mean": level.input_tokens,
        "output_tokens_mean": level.output_tokens,
        "cached_tokens_mean": level.cached_tokens,
        "ttft_p50_ms": ms(level.ttft_p50),
        "ttft_p95_ms": ms(level.ttft_p95),
        "itl_p50_ms": ms(level.itl_p50),
        "itl_p95_ms": ms(level.itl_p95),
        "latency_p50_s": level.e2e_p50,
        "client_cpu_cores": client_cpu_cores,
        "error_examples": level.error_examples,
    }


SERVER_COUNTERS = {
    "prompt": "llamacpp:prompt_tokens_total",  # prompt tokens evaluated (not from cache)
    "cached": "llamacpp:prompt_tokens_cached_total",
    "predicted": "llamacpp:tokens_predicted_total",
    # seconds a slot spent on prompts and on output, summed over requests
    "prompt_s": "llamacpp:prompt_seconds_total",
    "predicted_s": "llamacpp:tokens_predicted_seconds_total",
}


def server_counters(base_url: str) -> dict[str, float] | None:
    """llama-server's own token counters (its ``/metrics``), or None where it has none."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    try:
        return {key: float(values[name]) for key, name in SERVER_COUNTERS.items()}
    except (KeyError, ValueError):
        return None


def _referee(
    row: dict[str, Any], before: dict[str, float] | None, after: dict[str, float] | None
) -> None:
    """What the server itself counted while ``row``'s level ran: output tokens over the
    tool's window, prompt tokens evaluated and taken from its cache per request."""
    if before is None or after is None:
        return
    delta = {key: after[key] - before[key] for key in SERVER_COUNTERS}
    window, n = row.get("duration_s"), row.get("requests") or 0
    row["server_output_tokens"] = delta["predicted"]
    row["server_output_tokens_per_s"] = delta["predicted"] / window if window else None
    row["server_prompt_evaluated_mean"] = delta["prompt"] / n if n else None
    row["server_prompt_cached_mean"] = delta["cached"] / n if n else None
    # slots busy on average over the window: the concurrency the server actually saw
    # (below the tool's when its client leaves gaps between one reply and the next request)
    busy = delta["prompt_s"] + delta["predicted_s"]
    row["server_busy_slots"] = busy / window if window else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def side_by_side(
    base_url: str,
    model: str,
    levels: Sequence[int],
    prompt_tokens: int,
    output_tokens: int,
    *,
    tokenizer: Path,
    venv: Path,
    requests_per_level: int,
    seconds_per_level: float,
    workdir: Path,
    ours_first: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """At each level, guidellm then our ladder for as long as guidellm's level took (or,
    ``ours_first``, our ladder for ``seconds_per_level`` then guidellm); one comparison
    row per level, and what was calibrated."""
    words, our_tokens = calibrate_words(base_url, prompt_tokens)
    warm_up(base_url, model, output_tokens)
    out = []
    for c in levels:
        level_dir = workdir / f"c{c}"
        level_dir.mkdir(parents=True, exist_ok=True)

        def theirs_now(c: int = c, level_dir: Path = level_dir) -> dict[str, Any]:
            before = server_counters(base_url)
            (row,) = external_sweep(
                base_url,
                model,
                [c],
                prompt_tokens,
                output_tokens,
                tokenizer=tokenizer,
                venv=venv,
                requests_per_level=requests_per_level,
                seconds_per_level=seconds_per_level,
                workdir=level_dir,
                # guidellm's prompts are a function of the seed: the same seed at every
                # level would send the same prompts again, and llama-server's prompt
                # cache would answer their prefill
                seed=42 + c,
            )
            _referee(row, before, server_counters(base_url))
            return row

        def mine_now(seconds: float, c: int = c) -> dict[str, Any]:
            before = server_counters(base_url)
            row = ladder_level(base_url, model, c, words, output_tokens, seconds)
            _referee(row, before, server_counters(base_url))
            return row

        if ours_first:
            mine = mine_now(seconds_per_level)
            theirs = theirs_now()
        else:
            theirs = theirs_now()
            mine = mine_now(min(theirs["duration_s"] or seconds_per_level, seconds_per_level))
        out.append(
            {
                "concurrency": c,
                OURS: mine,
                TOOL: theirs,
                "ratio_requests_per_s": _ratio(mine["requests_per_s"], theirs["requests_per_s"]),
                "ratio_output_tokens_per_s": _ratio(
                    mine["output_tokens_per_s"], theirs["output_tokens_per_s"]
                ),
                "ratio_all_output_tokens_per_s": _ratio(
                    mine["all_output_tokens_per_s"], theirs["all_output_tokens_per_s"]
                ),
            }
        )
    return out, {"words": words, "prompt_tokens_per_prompt": our_tokens}


# --- output -----------------------------------------------------------------------------

COLUMNS = [
    ("tool", "tool", "{}"),
    ("concurrency", "c", "{:.0f}"),
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("incomplete", "cut off", "{:.0f}"),
    ("duration_s", "window s", "{:.2f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("window_requests_per_s", "n/window req/s", "{:.2f}"),
    ("window_output_tokens_per_s", "n/window tok/s", "{:.1f}"),
    ("all_output_tokens_per_s", "all tok/s", "{:.1f}"),
    ("prompt_tokens_mean", "prompt tok", "{:.1f}"),
    ("output_tokens_mean", "out tok", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p95_ms", "TTFT p95 ms", "{:.1f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.2f}"),
    ("itl_p95_ms", "ITL p95 ms", "{:.2f}"),
    ("server_output_tokens_per_s", "server tok/s", "{:.1f}"),
    ("server_prompt_evaluated_mean", "srv prompt eval", "{:.1f}"),
    ("server_prompt_cached_mean", "srv cached", "{:.1f}"),
    ("server_busy_slots", "srv busy slots", "{:.2f}"),
    ("client_cpu_cores", "client CPUs", "{:.2f}"),
]


COMPARISON = [
    ("concurrency", "c", "{:.0f}"),
    (f"{OURS}.requests_per_s", "ours req/s", "{:.2f}"),
    (f"{TOOL}.requests_per_s", f"{TOOL} req/s", "{:.2f}"),
    (f"{OURS}.output_tokens_per_s", "ours out tok/s", "{:.1f}"),
    (f"{TOOL}.output_tokens_per_s", f"{TOOL} out tok/s", "{:.1f}"),
    ("ratio_output_tokens_per_s", "ratio tok/s", "{:.3f}"),
    (f"{TOOL}.all_output_tokens_per_s", f"{TOOL} all tok/s", "{:.1f}"),
    ("ratio_all_output_tokens_per_s", "ratio all", "{:.3f}"),
    (f"{OURS}.server_busy_slots", "ours busy slots", "{:.2f}"),
    (f"{TOOL}.server_busy_slots", f"{TOOL} busy slots", "{:.2f}"),
    (f"{OURS}.client_cpu_cores", "ours client CPUs", "{:.2f}"),
    (f"{TOOL}.client_cpu_cores", f"{TOOL} client CPUs", "{:.2f}"),
    (f"{OURS}.prompt_tokens_mean", "ours prompt tok", "{:.1f}"),
    (f"{TOOL}.prompt_tokens_mean", f"{TOOL} prompt tok", "{:.1f}"),
]


def _get(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    cells = [[title for _, title, _ in columns]]
    for row in rows:
        cells.append(
            [
                "-" if _get(row, key) is None else fmt.format(_get(row, key))
                for key, _, fmt in columns
            ]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally that stops a process


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_crosscheck",
        description=(
            f"Sweep a real llama-server (a test model) with {TOOL} and with our ladder "
            "at fixed concurrencies, one after the other."
        ),
    )
    parser.add_argument(
        "-c",
        "--concurrency",
        type=int,
        action="append",
        help="a level (repeatable; default 1, 2, 4)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="slow",
        help="the test model llama-server runs: slow (tools/support/slowmodel.py, ~180 tok/s on one "
        "thread, the default) or tiny (tools/support/tinymodel.py, thousands)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument(
        "--requests", type=int, default=200, help="requests per level at most (default 200)"
    )
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="seconds per level at most (default 20)"
    )
    parser.add_argument("--threads", type=int, default=1, help="llama-server's threads (default 1)")
    parser.add_argument(
        "--venv",
        type=Path,
        default=DEFAULT_VENV,
        help=f"the virtualenv {TOOL} is installed in (default {DEFAULT_VENV})",
    )
    parser.add_argument(
        "--url",
        help="sweep this server (base URL, no /v1) instead of starting llama-server",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help=f"keep the model, tokenizer, scenario, {TOOL}'s report and the logs in DIR",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="llama-server on its --threads CPUs, the clients on the others (default: all "
        "share every CPU; on 2 CPUs pinning starves llama-server's HTTP threads)",
    )
    parser.add_argument(
        "--ours-first",
        action="store_true",
        help="at each level run our ladder (for --seconds) before guidellm, to see whether "
        "the order matters (give a large --requests so that both windows are --seconds)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    levels = sorted(set(args.concurrency or [1, 2, 4]))
    if levels[0] < 1:
        parser.error("concurrency must be at least 1")
    if args.prompt_tokens + args.output_tokens + 16 > SLOT_CONTEXT and args.url is None:
        parser.error(f"prompt + output tokens must fit a {SLOT_CONTEXT}-token slot")

    signal.signal(signal.SIGTERM, _sigterm)
    try:
        tool_executable(args.venv)
    except ToolMissing as e:
        print(e, file=sys.stderr)
        return 2

    started = time.monotonic()
    with contextlib.ExitStack() as keep:
        if args.keep:
            work = args.keep
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(keep.enter_context(tempfile.TemporaryDirectory(prefix="xcheck-")))
        tokenizer = write_tiny_tokenizer(work / "tokenizer")
        pinned = "not pinned"
        with contextlib.ExitStack() as stack:
            if args.url:
                url = args.url.rstrip("/")
            else:
                # neither model ends a reply: max_tokens rules
                if args.model == "slow":
                    model = slowmodel.write_slow_model(work / "slow.gguf")
                else:
                    model = tm.write_model(work / "tiny.gguf")
                split = split_cpus(args.threads) if args.pin else None
                with cpus(split[0] if split else None):
                    url = stack.enter_context(
                        llama_server(
                            model,
                            parallel=levels[-1],
                            workdir=work,
                            threads=args.threads,
                            slot_context=SLOT_CONTEXT,
                        )
                    )
                if split:
                    pinned = (
                        f"llama-server on CPU {sorted(split[0])}, clients on {sorted(split[1])}"
                    )
                # both clients (guidellm and its workers, our ladder) run on the rest
                stack.enter_context(cpus(split[1] if split else None))
            try:
                rows, calibrated = side_by_side(
                    url,
                    served_model(url),
                    levels,
                    args.prompt_tokens,
                    args.output_tokens,
                    tokenizer=tokenizer,
                    venv=args.venv,
                    requests_per_level=args.requests,
                    seconds_per_level=args.seconds,
                    workdir=work,
                    ours_first=args.ours_first,
                )
            except (RuntimeError, OSError, ValueError) as e:  # OSError: urllib's errors too
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                return 1
    config = {
        "tool": TOOL,
        "tool_version": TOOL_VERSION,
        "model": args.model if args.url is None else args.url,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "requests_per_level": args.requests,
        "seconds_per_level": args.seconds,
        "llama_server_parallel": levels[-1] if args.url is None else None,
        "llama_server_threads": args.threads if args.url is None else None,
        "cpus": pinned,
        "first": OURS if args.ours_first else TOOL,
        "our_prompt_words": calibrated["words"],
        "our_prompt_tokens_before_template": calibrated["prompt_tokens_per_prompt"],
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps({"config": config, "levels": rows}, indent=2))
    else:
        print(
            f"# {TOOL} {TOOL_VERSION} concurrent profile vs our ladder, prompt "
            f"{args.prompt_tokens} tokens (ours: {calibrated['words']} words, "
            f"{calibrated['prompt_tokens_per_prompt']:.1f} tokens) / output "
            f"{args.output_tokens} tokens, {TOOL} <= {args.requests} requests or "
            f"{args.seconds:g} s a level, "
            + (f"ours {args.seconds:g} s first" if args.ours_first else "then ours as long")
            + f", llama-server -np {levels[-1]} "
            f"-t {args.threads}, model {config['model']}, {pinned} "
            f"({config['wall_s']:.0f} s in all)"
        )
        print(table(rows, COMPARISON))
        print()
        print(table([r[t] for r in rows for t in (OURS, TOOL)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

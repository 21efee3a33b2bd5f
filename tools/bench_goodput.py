"""Goodput by routing policy: what routing by cache buys, on real llama-servers.

Each run gets fresh processes (its engines' caches start empty): ``--replicas``
real llama-servers of one model, each on one thread with two slots and a small
host-memory prompt cache (``--cache-ram-mib``, so that a replica holds a part of
the working set, as a busy one does), set up as llmgw's llama.cpp adapter sets
them up (``--cache-prompt``, ``--cache-ram``, ``--slot-prompt-similarity``); a
router in front; and one workload of fixed seed, sent open-loop (arrivals on a
schedule, as users arrive, not as the router lets them) as streamed chats.

The regime is the one routing by cache is for: the fleet's caches together hold
the working set and one replica's does not (``--cache-ram-mib 16`` keeps about
five of these prompts per replica: two in its slots and four 3.6 MiB states in
host memory, one of which makes room for the next), and requests arrive faster
than the replicas could serve them if every prompt were computed whole. Arrival
rates and the SLO are set from a calibration that runs first: one idle replica's
time to first token and to the end of a reply for a prompt it has to compute
(``Miss``), so that a load of 1.0 (``--size shared_load=...``) is as much work as
the fleet can do with no cache, on whatever machine runs it, and the TTFT SLO is
``slo_factor`` (2) times that idle miss: a request that has to compute its prompt
meets it on an idle fleet, and misses it only by queueing.

Workloads:

1. ``multiturn``: conversations, each with its own long document, several turns
   each; the next turn (with the actual reply) comes a think time after the reply,
   the conversations start interleaved.
2. ``shared``: users behind a handful of long system prompts, each asking a short
   question of their own.
3. ``unique``: unique prompts only, as long as the others (the control).

Policies, on the same replicas and the same workload:

- ``rr``: round robin (llmgw's router, one model per replica, the client takes
  them in turn);
- ``load``: llmgw's router by load alone (``routing.affinity = "off"``);
- ``prefix``: llmgw's router by what replicas hold (``affinity = "prefix"``, its
  load bound ``--bound`` when given);
- ``smg``: opt-in (``--smg PATH``, the ``smg`` executable of a venv of its own:
  ``python -m venv V && V/bin/pip install smg``), SGLang's gateway with its
  ``cache_aware`` policy pointed at the same engines.

Figures per run: goodput (requests per second whose time to first token met
``--slo``), TTFT p50/p95, prompt tokens the engines computed and their hit rate
(their own counters: ``llamacpp:prompt_tokens_total`` computed, and
``prompt_tokens_cached_total`` reused), the hit rate an oracle would reach (a
router that finds, for every request, every token that an earlier request or
reply left in some cache, with caches that never evict: an upper bound; a prompt
is in a cache from its request's first token on, not from when it was sent), load
imbalance (max over mean of the replicas' busy time, the engines' own prompt
and generation seconds), and, from the router's access log, how many later turns
of a session went to another replica than the turn before (``moved``), how many
stayed and found their conversation gone from the cache (``lost``), and how many
requests load sent elsewhere than affinity's first choice (``spilled``; each
request's ``route=``, counted by why on a ``routes:`` line). The router's
CPU per request, by load and by prefix, is measured apart, side by side
(``router_cpu``: a goodput run's few requests over a minute say more about what a
router spends per second than per request). Beside the prompt tokens computed, the
goal's line gives what the oracle would have computed, as a share of round robin's:
where round robin finds much cached too, no router gets far below it.

One seed's goodput on a loaded fleet moves several-fold between runs of it (a few
requests more that queue behind a prefill miss the SLO together), so ``--seed 1-6``
runs each seed in turn, on one calibration, each starting with the next policy (so
that none always runs first, on a machine that changes as it goes), and judges the
goals on them all pooled
(goodput: the requests that met the SLO over the runs' wall time; tokens and hits
summed; imbalance the median run's), saying on how many seeds each was met and
how far the pooled figure moves over sets of the seeds drawn with replacement
(the 5th to the 95th percentile over ``RESAMPLES`` draws): where that range straddles a
goal's line, the sweep does not say whether it is met. Two sweeps of the shared
prompts' twelve seeds at one load gave one seed's ``smg`` 0.29 and 2.48 good/s.

``--replicas`` above the machine's cores share them (one thread each): the
calibration counts the cores, not the replicas, as the fleet's capacity, and the
multi-turn workload has four conversations per replica unless told otherwise.

    .venv/bin/python -m tools.bench_goodput                   # the slow model, ~25 minutes
    .venv/bin/python -m tools.bench_goodput --smg /tmp/smg/bin/smg
    .venv/bin/python -m tools.bench_goodput --workload shared --size shared_load=3
    .venv/bin/python -m tools.bench_goodput --replicas 4 --seed 1-6 --no-cpu  # six seeds, pooled
    .venv/bin/python -m tools.bench_goodput --quick            # tiny sizes, the tiny model
    .venv/bin/python -m tools.bench_goodput --cpu-only         # the router CPU measure alone

Every process is ended on the way out, Ctrl-C included; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import httpx
import trio

from tools import bench_router as br
from tools.support.benchlib import cpu_seconds, free_port, percentile
from tools.support.llama import start_servers
from tools.support.procs import Procs, interrupt_on_sigterm
from tools.support.slowmodel import write_slow_model
from tools.support.tinymodel import write_model as write_tiny_model

POLICIES = ("rr", "load", "prefix", "smg")
WORKLOADS = ("multiturn", "shared", "unique")
SLOTS = 2
SLOT_CONTEXT = 4096
SIMILARITY = "0.5"  # the llama.cpp adapter's --slot-prompt-similarity
RUN_TIMEOUT_S = 600.0
IDLE_S = 2.0
_WORDS = ("river", "stone", "lantern", "harbor", "meadow", "copper", "thistle", "orchard",
          "signal", "ember", "quarry", "willow", "falcon", "granite", "tundra", "velvet")  # fmt: skip


@dataclass
class Sizes:
    """The workloads' sizes. Their arrival rates and the SLO are set from ``Miss``, what
    one replica of this machine takes to serve a first prompt it has to compute whole,
    so that a run loads the fleet the same way on a fast machine and a slow one: a load
    of 1.0 is as much work as the replicas can do when no prompt is found cached."""

    # all at once under load: four per replica fit its cache, eight do not (0: four per replica)
    conversations: int = 0
    turns: int = 4
    doc_chars: int = 600  # about 440 tokens of this model, 3.6 MiB of its KV
    # a user reads the reply and types the next question: this many times an idle
    # miss's whole reply (the loads below were set with 10 s where that took 3.4 s; a
    # fixed time offered a machine four times as fast a quarter of the load)
    think_factor: float = 3.0
    # conversations start at this many times the rate the fleet could serve if their
    # turns came back to back, every prompt computed whole; they do not (a turn waits
    # for the reply and the think time), so the load offered is less: at 3.0 eight
    # conversations of four turns offered 0.88 of the fleet's uncached capacity over
    # the run (144 replica-seconds of misses in 82 s on two replicas), at 5.0 about
    # 1.1, the regime routing by cache is for (see the module docstring)
    multiturn_load: float = 5.0
    systems: int = 8
    skew: float = 1.0  # Zipf exponent of the system prompts' popularity (0: all alike)
    system_chars: int = 600
    requests: int = 60  # of the shared workload
    shared_load: float = 2.0
    unique: int = 40  # requests of the unique workload, at a load the replicas can take
    unique_load: float = 0.6
    max_tokens: int = 16
    cpu_rounds: int = 7  # of the side-by-side router CPU measure, each policy
    cpu_requests: int = 300  # per round (the workload's requests, repeated)
    # requests at once in a round: one, so that where they go cannot change how the
    # engines deliver their tokens (see ``router_cpu``)
    cpu_concurrency: int = 1
    slo_factor: float = 2.0  # the TTFT SLO: this many times an unloaded replica's miss
    # set from the calibration unless given (--size NAME=VALUE)
    conversation_rate: float = 0.0  # conversations starting per second
    request_rate: float = 0.0  # shared requests per second
    unique_rate: float = 0.0
    slo_s: float = 0.0
    think_s: float = 0.0

    def calibrate(self, miss: Miss, replicas: int, cores: int) -> None:
        """Rates and SLO from ``miss`` (what is set already stays). Replicas run one
        thread each: more replicas than ``cores`` share them, and serve no more."""
        self.conversations = self.conversations or 4 * replicas
        per_s = min(replicas, cores) / miss.total_s  # misses the fleet serves per second
        self.conversation_rate = self.conversation_rate or (
            self.multiturn_load * per_s / self.turns
        )
        self.request_rate = self.request_rate or self.shared_load * per_s
        self.unique_rate = self.unique_rate or self.unique_load * per_s
        self.slo_s = self.slo_s or self.slo_factor * miss.ttft_s
        self.think_s = self.think_s or self.think_factor * miss.total_s


@dataclass
class Miss:
    """One replica, idle, serving a first prompt of the workloads' length that it has to
    compute whole: its time to first token and to the end (``max_tokens``)."""

    ttft_s: float
    total_s: float


QUICK = Sizes(
    conversations=3, turns=3, doc_chars=1100, think_s=0.05, systems=3, system_chars=1100,
    requests=6, unique=6, max_tokens=4, multiturn_load=4, shared_load=4, unique_load=4,
    cpu_rounds=1, cpu_requests=20,
)  # fmt: skip


# --- workloads ----------------------------------------------------------------------------


@dataclass
class Turn:
    """One request of a session: its messages are built when it is sent (with the
    replies before it); ``shared``: the characters of it an oracle finds cached."""

    question: str
    ttft: float | None = None
    status: int = 0
    reply: str = ""
    prompt_chars: int = 0
    shared_chars: int = 0
    # what the engine said of it (llama-server's last event's ``timings``): the prompt
    # tokens it found cached and the ones it computed; -1: not said
    cache_n: int = -1
    prompt_n: int = -1
    prompt_ms: float = -1.0  # how long the engine computed its prompt
    sent_at: float = 0.0  # wall clock (time.time()) when it was sent
    ended_at: float = 0.0  # wall clock (time.time()) when its reply ended
    # from the router's access log (llmgw's policies): the replica that answered, and
    # the prompt tokens it reused of how many; "" / -1: not known
    replica: str = ""
    cached: int = -1
    prompt_tokens: int = -1
    route: str = ""  # why affinity sent it there (``route=``); "": it did not


@dataclass
class Session:
    start: float  # seconds after the run starts
    prefix: list[dict[str, str]]  # the messages before its first question
    turns: list[Turn]
    think_s: float = 0.0
    group: str = ""  # what it shares with other sessions (a system prompt), for the oracle


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        word = rng.choice(_WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)


def workload(name: str, sizes: Sizes, seed: int) -> list[Session]:
    rng = random.Random(f"{name}-{seed}")
    clock = 0.0
    sessions: list[Session] = []
    if name == "multiturn":
        system = {"role": "system", "content": "Answer questions about the document."}
        for c in range(sizes.conversations):
            clock += rng.expovariate(sizes.conversation_rate)
            doc = f"Document {c}: {text(rng, sizes.doc_chars)}"
            turns = [Turn(f"{doc}\nWhat is it about?")]
            turns += [Turn(f"Question {t}: {text(rng, 30)}?") for t in range(1, sizes.turns)]
            sessions.append(Session(clock, [system], turns, sizes.think_s, group="system"))
    elif name == "shared":
        systems = [
            {"role": "system", "content": f"Rules {s}: {text(rng, sizes.system_chars)}"}
            for s in range(sizes.systems)
        ]
        # popularity falls off as 1/rank (Zipf): a hot prompt or two, a tail of cold ones
        popularity = [1 / (rank + 1) ** sizes.skew for rank in range(sizes.systems)]
        for i in range(sizes.requests):
            clock += rng.expovariate(sizes.request_rate)
            s = rng.choices(range(sizes.systems), weights=popularity)[0]
            question = f"User {i} asks: {text(rng, 40)}?"
            sessions.append(Session(clock, [systems[s]], [Turn(question)], group=f"s{s}"))
    else:
        for i in range(sizes.unique):
            clock += rng.expovariate(sizes.unique_rate)
            prompt = f"Request {i}: {text(rng, sizes.system_chars + 40)}?"
            sessions.append(Session(clock, [], [Turn(prompt)], group=f"u{i}"))
    return sessions


def oracle(sessions: list[Session]) -> None:
    """Mark each turn with the characters an oracle finds cached (see the module
    docstring), from when the run's engines computed each: for a session's later
    turns, all of the previous turn and its reply; for a first turn, the first
    messages it shares with other sessions, where one of those had its first token
    (its prompt computed) before this one's engine began computing (its first token
    less its ``prompt_ms``: a request that waited for a slot began late). Before that
    no cache anywhere held them, and no router could have found them: a first count,
    from when a request was sent, put 3-7 of the shared workload's 60 requests, sent
    while the first request of their system prompt was computing it and given a free
    slot, among the hits."""
    computed: dict[str, list[tuple[float, Turn]]] = {}  # group -> (first token, turn)
    for session in sessions:
        first = session.turns[0]
        if first.ttft is not None and first.sent_at:
            computed.setdefault(session.group, []).append((first.sent_at + first.ttft, first))
    for session in sessions:
        lead = sum(len(m["content"]) for m in session.prefix)
        for i, turn in enumerate(session.turns):
            if i:
                prev = session.turns[i - 1]
                turn.shared_chars = prev.prompt_chars + len(prev.reply)
                continue
            if not turn.sent_at:
                continue
            began = turn.sent_at
            if turn.ttft is not None and turn.prompt_ms >= 0:
                began = max(began, turn.sent_at + turn.ttft - turn.prompt_ms / 1000)
            if any(at <= began for at, t in computed.get(session.group, ()) if t is not turn):
                turn.shared_chars = lead


# --- processes -----------------------------------------------------------------------------


def engines(procs: Procs, model: Path, n: int, cache_ram_mib: int) -> list[str]:
    """``n`` llama-servers as the llama.cpp adapter starts them; base URLs once healthy."""
    options = ["-t", "1", "-tb", "1", "-np", str(SLOTS), "-c", str(SLOT_CONTEXT * SLOTS),
               "--metrics", "--slots", "--cache-prompt", "--cache-ram", str(cache_ram_mib),
               "--slot-prompt-similarity", SIMILARITY, "--alias", "m"]  # fmt: skip
    return start_servers(procs, [f"engine-{i}" for i in range(n)], model, options)


def calibrate(model: Path, sizes: Sizes, workdir: Path, cache_ram_mib: int) -> Miss:
    """``Miss`` on this machine: the median of three prompts of the workloads' length,
    each new to the replica, after a warm-up."""
    (workdir / "calibrate").mkdir(parents=True, exist_ok=True)
    procs = Procs(workdir / "calibrate")
    rng = random.Random("calibrate")
    try:
        (url,) = engines(procs, model, 1, cache_ram_mib)
        timings: list[tuple[float, float]] = []
        for i in range(4):
            body = {"model": "m", "max_tokens": sizes.max_tokens, "messages": [
                {"role": "system", "content": f"Rules {i}: {text(rng, sizes.system_chars)}"},
                {"role": "user", "content": f"User {i} asks: {text(rng, 40)}?"}]}  # fmt: skip
            t = time.monotonic()
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=RUN_TIMEOUT_S)
            reply.raise_for_status()
            prompt_ms = float(reply.json()["timings"]["prompt_ms"])
            if i:  # the first warms the engine up
                timings.append((prompt_ms / 1000, time.monotonic() - t))
    finally:
        procs.stop_all()
    timings.sort()
    ttft, total = timings[len(timings) // 2]
    return Miss(ttft_s=ttft, total_s=total)


def catalog(policy: str, urls: list[str], bound: float | None = None) -> str:
    if policy == "rr":  # one model per replica: the client takes them in turn
        return "".join(
            f'[models.rr{i}]\nstatic_endpoints = ["{u}"]\nstatic_engine = "llama.cpp"\n'
            for i, u in enumerate(urls)
        )
    quoted = ", ".join(f'"{u}"' for u in urls)
    affinity = "prefix" if policy == "prefix" else "off"
    bounded = "" if bound is None else f", affinity_bound = {bound}"
    return (
        f'[models.m]\nstatic_endpoints = [{quoted}]\nstatic_engine = "llama.cpp"\n'
        f'routing = {{ affinity = "{affinity}"{bounded} }}\n'
    )


def start_smg(procs: Procs, smg: str, urls: list[str]) -> tuple[int, int]:
    port = free_port()
    argv = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
            "--worker-urls", *urls, "--log-level", "warn", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port())]  # fmt: skip
    p = procs.start("smg", argv)
    procs.wait_until("smg", lambda: br.http_get(f"http://127.0.0.1:{port}/health") == 200, 60)
    return p.pid, port


def engine_counters(url: str) -> dict[str, float]:
    try:
        raw = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in raw.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            out[name.removeprefix("llamacpp:")] = float(value)
    return out


# --- one run -------------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    policy: str
    seed: int = 0  # 0: pooled over the seeds (``pooled``)
    requests: int = 0
    ok: int = 0
    met: int = 0  # requests whose TTFT met the SLO
    wall_s: float = 0.0
    goodput: float = 0.0  # requests per second that met the SLO
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    computed: float = 0.0  # prompt tokens the engines computed
    cached: float = 0.0  # and reused
    hit_rate: float = 0.0
    oracle_rate: float = 0.0
    # the prompt tokens an oracle would have computed (each turn's tokens, less the
    # share of its characters the oracle finds cached): what no routing gets below
    oracle_computed: float = 0.0
    imbalance: float = 0.0  # max / mean busy seconds per replica
    ttfts: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    # later turns that went to another replica than their previous turn, and later
    # turns that stayed but found less than half of their previous prompt cached
    moved: int | None = None
    lost: int | None = None
    # requests by why affinity sent them where they went (the access log's ``route=``):
    # held, first, even, spill:<why>; empty: no affinity (or not our router)
    routes: dict[str, int] = field(default_factory=dict)
    error: str = ""


async def run_sessions(
    sessions: list[Session], url: str, key: str, models: list[str], max_tokens: int
) -> None:
    rr = iter(range(1 << 30))
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(120, connect=5)
    start = trio.current_time()

    async def one(client: httpx.AsyncClient, session: Session) -> None:
        await trio.sleep_until(start + session.start)
        messages = list(session.prefix)
        for turn in session.turns:
            messages.append({"role": "user", "content": turn.question})
            turn.prompt_chars = sum(len(m["content"]) for m in messages)
            body = {"model": models[next(rr) % len(models)], "messages": messages,
                    "max_tokens": max_tokens, "stream": True}  # fmt: skip
            sent = trio.current_time()
            turn.sent_at = time.time()
            pieces: list[str] = []
            try:
                async with client.stream(
                    "POST", url, json=body, headers={"authorization": f"Bearer {key}"}
                ) as r:
                    turn.status = r.status_code
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        timings = event.get("timings")
                        if timings:
                            turn.cache_n = int(timings.get("cache_n", -1))
                            turn.prompt_n = int(timings.get("prompt_n", -1))
                            turn.prompt_ms = float(timings.get("prompt_ms", -1.0))
                        for choice in event.get("choices") or ():
                            piece = (choice.get("delta") or {}).get("content") or ""
                            if piece:
                                if turn.ttft is None:
                                    turn.ttft = trio.current_time() - sent
                                pieces.append(piece)
            except httpx.HTTPError:
                turn.status = -1
            turn.reply = "".join(pieces)
            turn.ended_at = time.time()
            messages.append({"role": "assistant", "content": turn.reply})
            if session.think_s:
                await trio.sleep(session.think_s)

    with trio.fail_after(RUN_TIMEOUT_S):
        async with (
            httpx.AsyncClient(limits=limits, timeout=timeout) as client,
            trio.open_nursery() as nursery,
        ):
            for session in sessions:
                nursery.start_soon(one, client, session)


def run(
    name: str, policy: str, sizes: Sizes, seed: int, model: Path, args: argparse.Namespace
) -> Result:
    result = Result(name, policy, seed)
    sessions = workload(name, sizes, seed)
    workdir = args.workdir / (f"seed-{seed}" if len(args.seeds) > 1 else "") / f"{name}-{policy}"
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Procs(workdir)
    try:
        urls = engines(procs, model, args.replicas, args.cache_ram_mib)
        if policy == "smg":
            _, port = start_smg(procs, args.smg, urls)
            key, models = "none", ["m"]
        else:
            # each request's line (replica, ttft, cached=N/M) in the run's llmgw.log
            _, port, key = br.start_llmgw(
                procs,
                0,
                None,
                catalog=catalog(policy, urls, args.bound),
                router="access_log = true\n",
            )
            models = [f"rr{i}" for i in range(len(urls))] if policy == "rr" else ["m"]
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        before = [engine_counters(u) for u in urls]
        t0 = time.monotonic()
        trio.run(run_sessions, sessions, url, key, models, sizes.max_tokens)
        result.wall_s = time.monotonic() - t0
        after = [engine_counters(u) for u in urls]
    except (RuntimeError, trio.TooSlowError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    finally:
        procs.stop_all()
    oracle(sessions)
    turns = [t for s in sessions for t in s.turns]
    if policy != "smg":
        from_access_log(workdir / "llmgw.log", turns)
        result.moved, result.lost = moves(sessions)
        if policy == "prefix":  # round robin's models have one replica each: no choice
            result.routes = dict(Counter(t.route for t in turns if t.route))
    # each turn as it went, for a look at what missed and why (in the run's folder)
    (workdir / "turns.json").write_text(
        json.dumps(
            [
                {"session": i, "group": s.group, "start": round(s.start, 2), "turn": j,
                 "status": t.status, "ttft": t.ttft, "prompt_chars": t.prompt_chars,
                 "shared_chars": t.shared_chars, "cache_n": t.cache_n, "prompt_n": t.prompt_n,
                 "replica": t.replica, "cached": t.cached, "prompt_tokens": t.prompt_tokens,
                 "route": t.route}
                for i, s in enumerate(sessions)
                for j, t in enumerate(s.turns)
            ],
            indent=0,
        )
    )  # fmt: skip
    ttfts = [t.ttft for t in turns if t.ttft is not None and t.status == 200]
    result.requests = len(turns)
    result.ok = len(ttfts)
    result.ttfts = ttfts
    result.met = sum(1 for t in ttfts if t <= sizes.slo_s)
    result.goodput = result.met / result.wall_s if result.wall_s else 0.0
    result.ttft_p50 = percentile(ttfts, 0.5)
    result.ttft_p95 = percentile(ttfts, 0.95)

    def delta(key: str, i: int) -> float:
        return after[i].get(key, 0.0) - before[i].get(key, 0.0)

    n = len(urls)
    result.computed = sum(delta("prompt_tokens_total", i) for i in range(n))
    result.cached = sum(delta("prompt_tokens_cached_total", i) for i in range(n))
    total = result.computed + result.cached
    result.hit_rate = result.cached / total if total else 0.0
    shared = sum(t.shared_chars / t.prompt_chars for t in turns if t.prompt_chars)
    result.oracle_rate = shared / len(turns) if turns else 0.0
    result.oracle_computed = sum(
        (t.cache_n + t.prompt_n) * (1 - t.shared_chars / t.prompt_chars)
        for t in turns
        if t.prompt_chars and t.cache_n >= 0
    )
    result.busy_s = [
        delta("prompt_seconds_total", i) + delta("tokens_predicted_seconds_total", i)
        for i in range(n)
    ]
    mean = sum(result.busy_s) / n if n else 0.0
    result.imbalance = max(result.busy_s) / mean if mean else 0.0
    return result


_ACCESS = re.compile(
    r"^(\S+ \S+) INFO llmgw\.router\.access: .* replica=(\S+) .* cached=(\d+)/(\d+) "
    r"(?:.* route=(\S+))?"
)


def from_access_log(log: Path, turns: list[Turn]) -> None:
    """Each turn's replica and what it reused, from the router's access log: the line
    written as its reply ended (within 0.25 s), the one saying what the reply's own
    timings said it reused where there is one (two replies can end within a few ms,
    and the nearest then may be the other's), else the nearest."""
    lines: list[tuple[float, str, int, int, str]] = []
    for line in log.read_text(errors="replace").splitlines():
        if m := _ACCESS.match(line):
            when = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append((when, m[2], int(m[3]), int(m[4]), m[5] or ""))
    for turn in sorted(turns, key=lambda t: t.ended_at):
        if not turn.ended_at:
            continue
        said = (turn.cache_n, turn.cache_n + turn.prompt_n) if turn.cache_n >= 0 else None
        i = _access_line(lines, turn.ended_at, said)
        if i is not None:
            _, turn.replica, turn.cached, turn.prompt_tokens, turn.route = lines.pop(i)


def _access_line(
    lines: list[tuple[float, str, int, int, str]], ended_at: float, said: tuple[int, int] | None
) -> int | None:
    """The access line of a reply that ended at ``ended_at``: of those within 0.25 s, the
    one that says the reuse ``said`` if one does, else the nearest; None: none is near."""
    near = [i for i in range(len(lines)) if abs(lines[i][0] - ended_at) <= 0.25]
    if not near:
        return None
    return min(near, key=lambda i: (lines[i][2:4] != said, abs(lines[i][0] - ended_at)))


def moves(sessions: list[Session]) -> tuple[int | None, int | None]:
    """(later turns sent elsewhere than their previous turn, later turns that stayed
    and found less than half of their previous prompt cached); None: not known."""
    moved = lost = 0
    known = False
    for session in sessions:
        for prev, turn in itertools.pairwise(session.turns):
            if not prev.replica or not turn.replica:
                continue
            known = True
            if turn.replica != prev.replica:
                moved += 1
            elif turn.cached * 2 < prev.prompt_tokens:
                lost += 1
    return (moved, lost) if known else (None, None)


def bodies(name: str, sizes: Sizes, seed: int) -> list[dict[str, object]]:
    """The workload's requests as they are sent, each earlier turn answered with a reply
    of ``max_tokens`` words, in the order they come (a later turn a think time after
    the one before; the replies' own time is left out), without the schedule: for what
    the router spends on them."""
    out: list[tuple[float, dict[str, object]]] = []
    for session in workload(name, sizes, seed):
        messages = list(session.prefix)
        for t, turn in enumerate(session.turns):
            messages.append({"role": "user", "content": turn.question})
            body = {"model": "m", "messages": list(messages), "max_tokens": sizes.max_tokens,
                    "stream": True}  # fmt: skip
            out.append((session.start + t * session.think_s, body))
            messages.append({"role": "assistant", "content": " ".join(["word"] * sizes.max_tokens)})
    out.sort(key=lambda entry: entry[0])  # stable: a conversation's turns stay in order
    return [body for _, body in out]


def decision_cost(name: str, sizes: Sizes, seed: int, replicas: int) -> tuple[float, float]:
    """Microseconds per request the router's choice takes by load alone, and by prefix
    (reading the prompt's key, choosing, recording it), over this workload's requests
    as they are sent: what routing by prefix adds to the router's CPU per request,
    without the noise of a whole process on a shared machine."""
    from llmgw.router.balancer import Admission, Endpoint, choose
    from llmgw.router.prefix import prompt_key

    encoded = [json.dumps(body).encode() for body in bodies(name, sizes, seed)]
    admission = Admission()

    def fleet() -> list[Endpoint]:
        return [Endpoint(key=f"r{i}", model="m", url=f"http://r{i}") for i in range(replicas)]

    def by_load() -> None:
        eps = fleet()
        for _ in encoded:
            choose(eps, 0.0, admission=admission, model="m")

    def by_prefix() -> None:
        eps = fleet()
        for body in encoded:
            key = prompt_key(body, "prefix")
            choice = choose(eps, 0.0, admission=admission, model="m", key=key)
            if key is not None and choice.endpoint is not None:
                choice.endpoint.prefix.record(key.blocks)

    def best(f: Callable[[], None]) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return 1e6 * min(times) / len(encoded)

    return best(by_load), best(by_prefix)


@dataclass
class Cpu:
    """Router CPU per request (ms) by load and by prefix, measured side by side."""

    workload: str
    load_ms: float
    prefix_ms: float
    rounds: int
    requests: int  # per round

    @property
    def ratio(self) -> float:
        return self.prefix_ms / self.load_ms if self.load_ms else 0.0


async def _closed_loop(url: str, key: str, sent: list[dict[str, object]], concurrency: int) -> int:
    """Send ``sent`` through the router, ``concurrency`` at a time, each stream read to
    its end; how many were answered 200."""
    todo = iter(sent)
    ok = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"authorization": f"Bearer {key}"}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal ok
        for body in todo:
            async with client.stream("POST", url, json=body, headers=headers) as r:
                async for _ in r.aiter_bytes():
                    pass
                ok += r.status_code == 200

    with trio.fail_after(RUN_TIMEOUT_S):
        async with (
            httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60, connect=5)) as client,
            trio.open_nursery() as nursery,
        ):
            for _ in range(concurrency):
                nursery.start_soon(worker, client)
    return ok


def router_cpu(names: list[str], sizes: Sizes, seed: int, args: argparse.Namespace) -> list[Cpu]:
    """What a router process spends per request by load and by prefix, side by side.

    The goodput runs cannot say it: their few requests are spread over a minute or
    more, and what a router spends per second with no request (reading the engines'
    gauges) outweighs them. Here two routers, ``load`` (``affinity = "off"``) and
    ``prefix``, stand in front of the same two llama-servers of the tiny model
    (answers in milliseconds, so a round is mostly the router's work); each workload's
    requests (as sent, with their earlier replies) go through one, then the other, in
    rounds that alternate which goes first, ``cpu_rounds`` times. Each round's figure:
    the router's CPU over the round less its idle rate, per request answered.
    Reported: the median round of each.

    One request at a time (``cpu_concurrency``): a router's CPU per streamed request
    depends on how the engine delivers the tokens (one event per wake-up, or several
    read at once), and where requests go changes that. With four at once, the
    load-only router spent 1.27x as much per request sending them all to one of the
    two engines as spreading them over both (4.78 against 3.77 ms, the shared
    workload, median of 7 rounds), and the prefix router, which keeps a prompt's
    requests on the replica that holds it, paid for that more than for its choice
    (1.10-1.15x load-only four at once; 1.03-1.07x one at a time). One at a time,
    both routers see the engines alike, and the difference is the choice.
    (One router with both as two models would rule out a difference between two
    processes, but a static engine serves one model of a catalog.)"""
    workdir = args.workdir / "cpu"
    workdir.mkdir(parents=True, exist_ok=True)
    engine_procs = Procs(workdir)
    routers = {p: Procs(workdir / p) for p in ("load", "prefix")}
    out: list[Cpu] = []
    try:
        tiny = workdir / "tiny.gguf"
        write_tiny_model(tiny, ends_after=None, context_length=SLOT_CONTEXT)
        urls = engines(engine_procs, tiny, 2, args.cache_ram_mib)
        started = {
            p: br.start_llmgw(procs, 0, None, catalog=catalog(p, urls))
            for p, procs in routers.items()
        }
        time.sleep(IDLE_S)  # their start's work done
        idle: dict[str, float] = {}
        for p, (pid, _, _) in started.items():
            c0, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(IDLE_S)
            idle[p] = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
        for name in names:
            sent = bodies(name, sizes, seed)
            sent = sent * max(1, sizes.cpu_requests // len(sent))
            per: dict[str, list[float]] = {"load": [], "prefix": []}
            for r in range(sizes.cpu_rounds):
                for p in ("load", "prefix") if r % 2 == 0 else ("prefix", "load"):
                    pid, port, key = started[p]
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    c0, t0 = cpu_seconds(pid), time.monotonic()
                    ok = trio.run(_closed_loop, url, key, sent, sizes.cpu_concurrency)
                    spent = cpu_seconds(pid) - c0 - idle[p] * (time.monotonic() - t0)
                    if ok:
                        per[p].append(1000 * spent / ok)
            load, prefix = percentile(per["load"], 0.5), percentile(per["prefix"], 0.5)
            if load is not None and prefix is not None:
                out.append(Cpu(name, load, prefix, sizes.cpu_rounds, len(sent)))
            if args.verbose:
                print(f"# cpu {name}: load {[round(v, 3) for v in per['load']]} ms, "
                      f"prefix {[round(v, 3) for v in per['prefix']]} ms", flush=True)  # fmt: skip
    finally:
        for procs in routers.values():
            procs.stop_all()
        engine_procs.stop_all()
    return out


# --- the report ----------------------------------------------------------------------------


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def spilled(r: Result) -> int | None:
    """Requests affinity sent elsewhere than its first choice, by load; None: not known."""
    if not r.routes:
        return None
    return sum(n for route, n in r.routes.items() if route.startswith("spill:"))


def routes(results: list[Result]) -> list[str]:
    """A line per run that routed by affinity: its requests by why they went where."""
    return [
        f"routes: {r.workload} {r.policy}: "
        + ", ".join(f"{route} {n}" for route, n in sorted(r.routes.items()))
        for r in results
        if r.routes
    ]


def table(results: list[Result]) -> str:
    head = ("workload", "policy", "ok", "goodput/s", "ttft p50", "ttft p95", "computed",
            "hit", "oracle", "imbal", "moved", "lost", "spilled")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for r in results:
        if r.error:
            rows.append((r.workload, r.policy, "error:", r.error, *[""] * (len(head) - 4)))
            continue
        rows.append((r.workload, r.policy, f"{r.ok}/{r.requests}", fmt(r.goodput, ".3f"),
                     fmt(r.ttft_p50), fmt(r.ttft_p95), f"{r.computed:.0f}",
                     f"{r.hit_rate:.0%}", f"{r.oracle_rate:.0%}", fmt(r.imbalance),
                     fmt(r.moved, "d"), fmt(r.lost, "d"), fmt(spilled(r), "d")))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


@dataclass
class Goal:
    what: str
    value: float | None
    ok: bool | None  # None: not judged (a policy it needs did not run)
    note: str = ""  # a figure beside it that differs by run (the oracle's)

    def line(self, seeds: str = "") -> str:
        verdict = "n/a" if self.value is None or self.ok is None else (
            "met" if self.ok else "NOT met")  # fmt: skip
        note = f" ({self.note})" if self.note else ""
        return f"goal: {self.what}{note}: {fmt(self.value)} {verdict}{seeds}"


def goals(results: list[Result], cpus: list[Cpu]) -> list[Goal]:
    """The issue's goals, each judged from these figures (one seed's, or pooled)."""
    by = {(r.workload, r.policy): r for r in results if not r.error}
    out: list[Goal] = []

    def ratio(a: float | None, b: float | None) -> float | None:
        """a / b; infinite where b is 0 and a is not (round robin met the SLO with no
        request), None where either is not known."""
        if a is None or b is None or (a == 0 and b == 0):
            return None
        return math.inf if b == 0 else a / b

    def judge(what: str, value: float | None, ok: bool | None, note: str = "") -> None:
        out.append(Goal(what, value, ok, note))

    for w in ("multiturn", "shared"):
        p, rr, smg = by.get((w, "prefix")), by.get((w, "rr")), by.get((w, "smg"))
        if p is None:
            continue
        g = ratio(p.goodput, rr.goodput if rr else None)
        judge(f"{w}: goodput >= 2x round robin", g, None if g is None else g >= 2)
        g = ratio(p.goodput, smg.goodput if smg else None)
        judge(f"{w}: goodput >= 1.1x smg cache_aware", g, None if g is None else g >= 1.1)
        c = ratio(p.computed, rr.computed if rr else None)
        bound = ratio(p.oracle_computed, rr.computed if rr else None)
        judge(
            f"{w}: prompt tokens computed <= 0.5x round robin",
            c,
            None if c is None else c <= 0.5,
            f"an oracle's: {fmt(bound)}",
        )
        h = ratio(p.hit_rate, p.oracle_rate)
        judge(f"{w}: hit rate >= 90% of the oracle's", h, None if h is None else h >= 0.9)
        judge(f"{w}: load imbalance <= 1.25", p.imbalance, p.imbalance <= 1.25)
    p, load = by.get(("unique", "prefix")), by.get(("unique", "load"))
    if p is not None and load is not None:
        g = ratio(p.goodput, load.goodput)
        judge("unique: goodput within 5% of load-only", g, None if g is None else g >= 0.95)
        t = ratio(p.ttft_p95, load.ttft_p95)
        judge("unique: TTFT p95 within 5% of load-only", t, None if t is None else t <= 1.05)
    for cpu in cpus:
        judge(f"{cpu.workload}: router CPU per request <= 1.1x load-only", cpu.ratio,
              cpu.ratio <= 1.1)  # fmt: skip
    return out


def pooled(results: list[Result]) -> list[Result]:
    """Each workload and policy over the seeds, as one run of them all: goodput the
    requests that met the SLO over the runs' wall time, the TTFTs and tokens of all,
    the oracle's rate by request; imbalance the median run's (a replica of one run is
    not one of another's)."""
    out: list[Result] = []
    keys = dict.fromkeys((r.workload, r.policy) for r in results)
    for name, policy in keys:
        runs = [r for r in results if (r.workload, r.policy) == (name, policy) and not r.error]
        if not runs:
            continue
        p = Result(name, policy)
        p.requests = sum(r.requests for r in runs)
        p.ok = sum(r.ok for r in runs)
        p.met = sum(r.met for r in runs)
        p.wall_s = sum(r.wall_s for r in runs)
        p.goodput = p.met / p.wall_s if p.wall_s else 0.0
        p.ttfts = [t for r in runs for t in r.ttfts]
        p.ttft_p50 = percentile(p.ttfts, 0.5)
        p.ttft_p95 = percentile(p.ttfts, 0.95)
        p.computed = sum(r.computed for r in runs)
        p.cached = sum(r.cached for r in runs)
        total = p.computed + p.cached
        p.hit_rate = p.cached / total if total else 0.0
        p.oracle_rate = sum(r.oracle_rate * r.requests for r in runs) / (p.requests or 1)
        p.oracle_computed = sum(r.oracle_computed for r in runs)
        p.imbalance = statistics.median(r.imbalance for r in runs)
        if all(r.moved is not None for r in runs):
            p.moved = sum(r.moved or 0 for r in runs)
            p.lost = sum(r.lost or 0 for r in runs)
        p.routes = dict(sum((Counter(r.routes) for r in runs), Counter()))
        out.append(p)
    return out


RESAMPLES = 1000  # seed sets drawn (with replacement) to say how far a pooled figure moves


def resampled(
    results: list[Result], seeds: list[int]
) -> dict[str, tuple[float | None, float | None]]:
    """Each pooled goal's figure over ``RESAMPLES`` sets of the seeds drawn with
    replacement (a fixed draw): the 5th and 95th percentile, by goal. One sweep's
    pooled figure is one draw of the seeds; where this range straddles the goal's
    line, the sweep does not say whether it is met (a goodput at a load near the
    fleet's capacity moves several-fold between runs of one seed)."""
    rng = random.Random("resample")
    by_seed = {seed: [r for r in results if r.seed == seed] for seed in seeds}
    values: dict[str, list[float]] = {}
    for _ in range(RESAMPLES):
        draw = [r for seed in rng.choices(seeds, k=len(seeds)) for r in by_seed[seed]]
        for goal in goals(pooled(draw), []):
            if goal.value is not None:  # infinite where round robin met the SLO with none
                values.setdefault(goal.what, []).append(goal.value)
    return {
        what: (percentile(v, 0.05), percentile(v, 0.95))
        for what, v in values.items()
        if len(v) == RESAMPLES
    }


def seed_range(text: str) -> list[int]:
    """``--seed``: ``N`` or ``N-M`` (both included)."""
    first, _, last = text.partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a seed is N or N-M, e.g. 3 or 1-6") from None
    if hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: the range runs backwards; write {hi}-{lo}")
    return list(range(lo, hi + 1))


@contextlib.contextmanager
def model_file(which: str, workdir: Path) -> Iterator[Path]:
    path = workdir / f"{which}.gguf"
    if which == "slow":
        write_slow_model(path, context_length=SLOT_CONTEXT)
    else:
        write_tiny_model(path, ends_after=None, context_length=SLOT_CONTEXT)
    yield path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and the tiny model")
    parser.add_argument("--model", choices=("slow", "tiny"), help="default: slow (tiny if quick)")
    parser.add_argument("--workload", action="append", choices=WORKLOADS)
    parser.add_argument("--policy", action="append", choices=POLICIES,
                        help="default: rr, load, prefix (and smg with --smg)")  # fmt: skip
    parser.add_argument("--smg", help="the smg executable (its own venv): adds policy smg")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--cache-ram-mib", type=int, default=16,
                        help="each engine's prompt cache (--cache-ram), default 16")  # fmt: skip
    parser.add_argument("--slo", type=float,
                        help="the TTFT SLO in seconds (default: slo_factor x the idle miss)")  # fmt: skip
    parser.add_argument("--bound", type=float,
                        help="prefix: routing.affinity_bound (default: the router's)")  # fmt: skip
    parser.add_argument("--seed", action="append", type=seed_range, metavar="N[-M]",
                        help="the workloads' seed, or seeds: each runs in turn, and the goals "
                        "are judged on all of them pooled too (default 1)")  # fmt: skip
    parser.add_argument("--size", action="append", default=[], metavar="NAME=VALUE",
                        help="override one of the workloads' sizes, e.g. requests=64")  # fmt: skip
    parser.add_argument("--no-cpu", dest="cpu", action="store_false",
                        help="skip the side-by-side router CPU measure (tiny model, ~1 min)")  # fmt: skip
    parser.add_argument("--cpu-only", action="store_true",
                        help="only the side-by-side router CPU measure")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="each CPU round's figure")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    args.seeds = list(dict.fromkeys(n for span in args.seed or [[1]] for n in span))
    sizes = replace(QUICK) if args.quick else Sizes()
    if args.slo is not None:
        sizes.slo_s = args.slo
    for item in args.size:
        name, _, value = item.partition("=")
        if name not in Sizes.__dataclass_fields__:
            parser.error(
                f"--size {item}: no such size; sizes are {', '.join(Sizes.__dataclass_fields__)}"
            )
        setattr(sizes, name, type(getattr(sizes, name))(value))
    policies = args.policy or ["rr", "load", "prefix", *(["smg"] if args.smg else [])]
    if "smg" in policies and not args.smg:
        parser.error("policy smg needs --smg PATH (the smg executable)")
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            args.workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        args.workdir.mkdir(parents=True, exist_ok=True)
        which = args.model or ("tiny" if args.quick else "slow")
        cores = len(os.sched_getaffinity(0))
        if args.cpu_only:  # the schedule is not used: any rates do
            policies = []
            miss = Miss(ttft_s=1.0, total_s=1.0)
        else:
            model = stack.enter_context(model_file(which, args.workdir))
            miss = calibrate(model, sizes, args.workdir, args.cache_ram_mib)
        sizes.calibrate(miss, args.replicas, cores)
        print(f"# one replica's miss, idle: TTFT {miss.ttft_s:.2f} s, whole reply "
              f"{miss.total_s:.2f} s; think time {sizes.think_s:.1f} s; rates per second: "
              f"conversations {sizes.conversation_rate:.3f}, shared {sizes.request_rate:.3f}, unique "
              f"{sizes.unique_rate:.3f}", flush=True)  # fmt: skip
        seeds = ", ".join(map(str, args.seeds))
        print(f"# {which} model, {args.replicas} replicas x {SLOTS} slots, 1 thread each "
              f"on {cores} cores, {sizes.conversations} conversations, --cache-ram "
              f"{args.cache_ram_mib} MiB, TTFT SLO {sizes.slo_s:.2f} s, seed {seeds}",
              flush=True)  # fmt: skip
        names = args.workload or list(WORKLOADS)
        for n, seed in enumerate(args.seeds):
            for name in names:
                # each seed starts with the next policy: none always runs first (or last)
                turn = n % max(1, len(policies))
                for policy in policies[turn:] + policies[:turn]:
                    r = run(name, policy, sizes, seed, model, args)
                    results.append(r)
                    print(f"# {name} {policy} seed {seed}: "
                          f"{r.error or f'{r.goodput:.3f} good/s'}", flush=True)  # fmt: skip
        cpus = router_cpu(names, sizes, args.seeds[0], args) if args.cpu else []
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    if len(args.seeds) == 1:
        print("\n".join([table(results), *routes(results)]))
        for goal in goals(results, cpus):
            print(goal.line())
    else:
        by_seed: dict[int, list[Goal]] = {}
        for seed in args.seeds:
            ran = sorted(
                (r for r in results if r.seed == seed),
                key=lambda r: (names.index(r.workload), policies.index(r.policy)),
            )
            by_seed[seed] = goals(ran, [])
            print(f"## seed {seed}")
            print("\n".join([table(ran), *routes(ran)]))
            for goal in by_seed[seed]:
                print(goal.line())
        pool = pooled(results)
        print(f"## pooled over seeds {seeds}")
        print("\n".join([table(pool), *routes(pool)]))
        spread = resampled(results, args.seeds)
        for goal in goals(pool, cpus):
            judged = [
                g.ok for gs in by_seed.values() for g in gs
                if g.what == goal.what and g.ok is not None
            ]  # fmt: skip
            said = [f"met on {sum(judged)} of {len(judged)} seeds"] if judged else []
            if goal.what in spread:
                lo, hi = spread[goal.what]
                said.append(f"{fmt(lo)}-{fmt(hi)} over resampled seeds")
            print(goal.line(f" ({'; '.join(said)})" if said else ""))
    for c in cpus:
        print(f"cpu: {c.workload}: router CPU per request by load {c.load_ms:.3f} ms, by prefix "
              f"{c.prefix_ms:.3f} ms (median of {c.rounds} rounds of {c.requests} "
              f"requests each, side by side)")  # fmt: skip
    for name in names:
        load_us, prefix_us = decision_cost(name, sizes, args.seeds[0], args.replicas)
        print(f"choice: {name}: by load {load_us:.1f} us, by prefix {prefix_us:.1f} us per "
              f"request (prompt key, choice and record; +{prefix_us - load_us:.1f} us)")  # fmt: skip
    return 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())

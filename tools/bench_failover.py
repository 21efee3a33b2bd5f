"""Failover, measured: what a client's streams see when one of two engines dies or
stops mid-run.

Each event gets a fresh set of processes: two real llama-servers of one model (32
slots each, so either can hold every stream: a fleet sized to lose one), ``llmgw
server`` routing the model to both as static endpoints (``static_engine =
"llama.cpp"``, the router's defaults otherwise), and 32 concurrent greedy streams of
200 tokens through it, each with its own prompt. Events:

- ``unbroken``: no fault. Its texts are the reference the others are held to.
- ``again``: no fault, a second time: the noise floor of "identical" (llama.cpp's
  batched decoding on the CPU may not be bit-for-bit the same from run to run).
- ``kill``: once the first engine's leading stream is a third of the way (as its
  ``/slots`` count it), ``kill -9`` that engine.
- ``stop``: the same moment, ``SIGSTOP`` the first engine (its sockets stay open and
  silent) for the rest of the run.

Per event:

- ``intact``: streams that ended as a stream ends (a finish reason, ``[DONE]``, no
  error event) with all their 200 tokens;
- ``identical``: streams whose text equals the unbroken run's for the same prompt;
- ``resumed``: streams the router carried on from the other engine (its log names
  each by its response id);
- ``stall``: per resumed stream, the longest gap between two of its events after the
  fault: what the client saw as a pause (p50, p95, max); beside it, the unbroken
  run's longest gap per stream (its p95), for scale;
- ``prefill``: per continuation, the surviving engine's own prompt eval time (its
  log: the tasks it started after the fault), p50 and p95; ``stall/prefill`` is the
  ratio of the two p95s;
- ``detect`` (stop): seconds from the signal to the router's log saying the replica
  is wedged.

    .venv/bin/python -m tools.bench_failover                 # every event, ~6 minutes
    .venv/bin/python -m tools.bench_failover --event kill --json
    .venv/bin/python -m tools.bench_failover --model tiny    # the tiny test model
    .venv/bin/python -m tools.bench_failover --cost          # per event, in the router

The model by default is ``tools/support/slowmodel.py``'s (a couple of hundred tokens per
second on one thread), so prefill takes the time it takes on real hardware relative
to the router's own work; ``--model tiny`` makes the engines nearly free. Every
process is ended on the way out, Ctrl-C included; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import trio

from tools import bench_router as br
from tools.support.benchlib import percentile
from tools.support.llama import decoded, start_servers
from tools.support.procs import Procs, interrupt_on_sigterm
from tools.support.slowmodel import write_slow_model
from tools.support.tinymodel import write_model as write_tiny

STREAMS = 32
TOKENS = 200
SLOT_CONTEXT = 320  # prompt and 200 tokens, with room
FAULT_AT = TOKENS // 3  # tokens the first engine's leading stream has generated at the fault
RUN_TIMEOUT_S = 300.0
EVENTS = ("unbroken", "again", "kill", "stop")
_RESUMED = re.compile(
    r"stream (\S+) of \S+ broke mid-way on replica \S+; replica \S+ carries it on "
    r"from token (\d+)"
)
_LAUNCHED = re.compile(r"\| task (\d+) \| processing task")
_PROMPT_EVAL = re.compile(r"\| task (\d+) \| prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def prompt(i: int) -> list[dict[str, str]]:
    """The i-th stream's chat: each its own, all of one length."""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Story {i:02d}: tell me about the sea."},
    ]


@dataclass
class Stream:
    """One client stream, as the client saw it."""

    index: int
    id: str = ""
    text: str = ""
    tokens: int = 0  # the usage the stream reported
    finished: bool = False  # a finish reason, and [DONE]
    error: str = ""
    times: list[float] = field(default_factory=list)  # of each event with text
    done: bool = False  # the client is done with it, however it ended

    def longest_gap(self, after: float = 0.0) -> float:
        """The longest pause between two of its events, counting those from ``after``."""
        times = [t for t in self.times if t >= after]
        start = [t for t in self.times if t < after][-1:]
        times = start + times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class Result:
    event: str
    streams: int = 0
    intact: int = 0
    identical: int | None = None
    resumed: int = 0
    faulted: bool = False  # the fault landed while the engine was still at work
    stall_p50_s: float | None = None
    stall_p95_s: float | None = None
    stall_max_s: float | None = None
    gap_p95_s: float | None = None  # the longest gap of the streams not resumed, p95
    prefill_p50_s: float | None = None
    prefill_p95_s: float | None = None
    prefill_tokens_p50: float | None = None
    detect_s: float | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def stall_over_prefill(self) -> float | None:
        if self.stall_p95_s is None or not self.prefill_p95_s:
            return None
        return self.stall_p95_s / self.prefill_p95_s


def engines(procs: Procs, model: Path) -> list[str]:
    """Two llama-servers of ``model``; their base URLs once both are healthy."""
    options = ["-t", "1", "-tb", "1", "-np", str(STREAMS),
               "-c", str(SLOT_CONTEXT * STREAMS), "--metrics", "--slots"]  # fmt: skip
    return start_servers(procs, ("engine-a", "engine-b"), model, options)


def catalog(urls: list[str]) -> str:
    quoted = ", ".join(f'"{u}"' for u in urls)
    return f'[models.m]\nstatic_endpoints = [{quoted}]\nstatic_engine = "llama.cpp"\n'


async def one_stream(client: httpx.AsyncClient, url: str, key: str, s: Stream) -> None:
    body = {
        "model": "m",
        "messages": prompt(s.index),
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {key}"}
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                s.error = f"status {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    s.finished = s.finished and not s.error
                    break
                event = json.loads(data)
                if "error" in event:
                    s.error = str(event["error"].get("message", event["error"]))[:300]
                    continue
                s.id = s.id or event.get("id", "")
                if event.get("usage"):
                    s.tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        text.append(piece)
                        s.times.append(time.monotonic())
                    if choice.get("finish_reason"):
                        s.finished = True
            else:
                s.finished = False  # the body ended without [DONE]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    finally:
        s.text = "".join(text)
        s.done = True


def run_event(event: str, model: Path, workdir: Path, reference: dict[int, str]) -> Result:
    """One event on fresh processes."""
    result = Result(event, streams=STREAMS)
    procs = Procs(workdir)
    try:
        urls = engines(procs, model)
        _, port, key = br.start_llmgw(procs, 0, None, catalog=catalog(urls))
        streams = [Stream(i) for i in range(STREAMS)]
        fault_at: list[float] = []
        survivor_offset: list[int] = []
        t0 = time.monotonic()

        async def fault_when_due() -> None:
            if event not in ("kill", "stop"):
                return
            async with httpx.AsyncClient() as client:
                while await decoded(client, urls[0]) < FAULT_AT:
                    if all(s.done for s in streams):
                        return  # it never got that far: no fault, and the figures say so
                    await trio.sleep(0.02)
            survivor_offset.append(len(procs.log("engine-b")))
            procs["engine-a"].send_signal(signal.SIGKILL if event == "kill" else signal.SIGSTOP)
            fault_at.append(time.monotonic())
            if event == "stop":
                while time.monotonic() - fault_at[0] < 60:
                    if "is wedged" in procs.log("llmgw"):
                        result.detect_s = time.monotonic() - fault_at[0]
                        return
                    await trio.sleep(0.05)

        async def main() -> None:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            limits = httpx.Limits(max_connections=STREAMS + 4)
            timeout = httpx.Timeout(120, connect=5)
            with trio.fail_after(RUN_TIMEOUT_S):
                async with (
                    httpx.AsyncClient(limits=limits, timeout=timeout) as client,
                    trio.open_nursery() as nursery,
                ):
                    nursery.start_soon(fault_when_due)
                    for s in streams:
                        nursery.start_soon(one_stream, client, url, key, s)

        trio.run(main)
        result.wall_s = time.monotonic() - t0
        result.faulted = bool(fault_at)
        if event == "stop":
            procs["engine-a"].send_signal(signal.SIGCONT)
        measure(result, streams, reference, fault_at, survivor_offset, procs)
        if not reference:
            reference.update({s.index: s.text for s in streams})
    finally:
        for proc in procs.procs.values():
            proc.send_signal(signal.SIGCONT)
        procs.stop_all()
    return result


def measure(
    result: Result,
    streams: list[Stream],
    reference: dict[int, str],
    fault_at: list[float],
    survivor_offset: list[int],
    procs: Procs,
) -> None:
    result.intact = sum(1 for s in streams if s.finished and not s.error and s.tokens == TOKENS)
    resumed_ids = {m.group(1): int(m.group(2)) for m in _RESUMED.finditer(procs.log("llmgw"))}
    if reference:
        result.identical = sum(1 for s in streams if s.text == reference[s.index])
        for s in streams:
            ref = reference[s.index]
            if s.text != ref:
                at = next(
                    (i for i, (a, b) in enumerate(zip(s.text, ref, strict=False)) if a != b),
                    min(len(s.text), len(ref)),
                )
                k = resumed_ids.get(s.id)
                how = "not resumed" if k is None else f"resumed from token {k}"
                result.notes.append(
                    f"stream {s.index} ({how}) differs from the unbroken run's from character "
                    f"{at} of {len(ref)}: {s.text[at : at + 12]!r} for {ref[at : at + 12]!r}"
                )
    for s in streams:
        if s.error:
            result.notes.append(f"stream {s.index}: {s.error}")
    resumed = [s for s in streams if s.id in resumed_ids]
    result.resumed = len(resumed)
    after = fault_at[0] if fault_at else 0.0
    stalls = [s.longest_gap(after) for s in resumed]
    rest = [s.longest_gap(after) for s in streams if s.id not in resumed_ids]
    result.stall_p50_s = percentile(stalls, 0.50)
    result.stall_p95_s = percentile(stalls, 0.95)
    result.stall_max_s = max(stalls, default=None)
    result.gap_p95_s = percentile(rest, 0.95)
    if survivor_offset:
        log = procs.log("engine-b")[survivor_offset[0] :]
        launched = {int(t) for t in _LAUNCHED.findall(log)}
        evals = [
            (float(ms) / 1000, int(n))
            for task, ms, n in _PROMPT_EVAL.findall(log)
            if int(task) in launched
        ]
        result.prefill_p50_s = percentile([e for e, _ in evals], 0.50)
        result.prefill_p95_s = percentile([e for e, _ in evals], 0.95)
        result.prefill_tokens_p50 = percentile([float(n) for _, n in evals], 0.50)
        if len(evals) != len(resumed):
            result.notes.append(
                f"{len(evals)} tasks began on the surviving engine after the fault, "
                f"{len(resumed)} streams were resumed"
            )


def _f(x: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def table(results: list[Result]) -> str:
    head = ("event", "intact", "identical", "resumed", "stall p50/p95/max",
            "gap p95", "prefill p50/p95 (tok)", "stall/prefill", "detect", "wall")  # fmt: skip
    rows = [head]
    for r in results:
        rows.append((
            r.event,
            f"{r.intact}/{r.streams} ({100 * r.intact / r.streams:.1f} %)",
            "-" if r.identical is None else f"{r.identical}/{r.streams}",
            str(r.resumed),
            "-" if r.stall_p95_s is None
            else f"{_f(r.stall_p50_s)}/{_f(r.stall_p95_s)}/{_f(r.stall_max_s)} s",
            _f(r.gap_p95_s, " s"),
            "-" if r.prefill_p95_s is None
            else f"{_f(r.prefill_p50_s)}/{_f(r.prefill_p95_s)} s ({r.prefill_tokens_p50:.0f})",
            _f(r.stall_over_prefill, "x"),
            _f(r.detect_s, " s", 1),
            _f(r.wall_s, " s", 1),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


# a llama.cpp chat event as it streams when asked for its token's id (n_probs 1)
_EVENT = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" the"},'
    b'"logprobs":{"content":[{"id":1234,"token":" the","bytes":[32,116,104,101],"prob":0.93,'
    b'"top_probs":[{"id":1234,"token":" the","bytes":[32,116,104,101],"prob":0.93}]}]}}],'
    b'"created":1796217819,"id":"chatcmpl-SQvGIVEoKFnJyzR1rb8PdP5wh4SUNefA","model":"m",'
    b'"system_fingerprint":"b11434","object":"chat.completion.chunk"}'
)


def event_cost(n: int = 200_000) -> float:
    """Microseconds the router spends per event keeping a resumable stream's transcript
    (taking the id out, noting the text): its cost over a plain relay, per token."""
    from llmgw.router.resume import Transcript, plan

    best = float("inf")
    for _ in range(5):
        t = plan(b'{"model":"m","messages":[],"stream":true,"max_tokens":200}', chat=True)
        assert isinstance(t, Transcript)
        t.request("llama.cpp")
        start = time.perf_counter()
        for _ in range(n // 5):
            t.observe(_EVENT)
        best = min(best, (time.perf_counter() - start) / (n // 5))
    return best * 1e6


def write_model(kind: str, workdir: Path) -> Path:
    if kind == "tiny":
        return write_tiny(workdir / "tiny.gguf", ends_after=None)
    return write_slow_model(workdir / "slow.gguf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--event", action="append", choices=EVENTS,
                        help="run only these (the unbroken run always runs first)")  # fmt: skip
    parser.add_argument("--model", choices=("slow", "tiny"), default="slow")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cost", action="store_true",
                        help="only the router's per-event cost of keeping a transcript")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.cost:
        print(f"transcript: {event_cost():.2f} us per event (best of 5)")
        return 0
    events = ["unbroken", *[e for e in (args.event or EVENTS) if e != "unbroken"]]
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        model = write_model(args.model, workdir)
        reference: dict[int, str] = {}
        results = []
        for event in events:
            d = workdir / event
            d.mkdir(exist_ok=True)
            r = run_event(event, model, d, reference)
            results.append(r)
            if not args.json:
                print(table([r]).splitlines()[-1], file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps([asdict(r) | {"stall_over_prefill": r.stall_over_prefill}
                              for r in results], indent=2))  # fmt: skip
        else:
            print(table(results))
            for r in results:
                for note in r.notes[:5]:
                    print(f"  {r.event}: {note}")
    return 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())

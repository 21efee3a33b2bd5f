"""Replicas that follow demand, measured: a model with a range of replicas against the
same model at a fixed count of its ``max``, under one recorded load shape.

Each run is a whole fleet on this machine: a private CA, ``llmgw server`` (control
plane and router), one agent on mutual TLS, and real llama-servers it starts for a
model of ``tools/support/slowmodel.py`` (a couple of hundred tokens a second on one
thread, so an engine's work is what limits a replica, as on real hardware). The
model runs either ``replicas = { min = 0, max = MAX, target = TARGET, idle_s = IDLE }``
(``elastic``) or ``replicas = MAX`` (``fixed``), and both runs get the same load:

1. ``first``: after 5 s of nothing, one request at a model with no replica
   (elastic: none yet), then nothing for longer than ``idle_s`` (back to zero);
2. ``burst``: ``--users`` users at once (50), each a closed loop of one streamed
   request (16 tokens) and ``--think-s`` (3 s) of thought;
3. ``gap``: nothing, for longer than ``idle_s`` (elastic: back to zero);
4. ``sine``: users rising and falling as a slow sine (``--period`` seconds, two
   periods), from none to half the burst;
5. ``idle``: nothing, for longer than ``idle_s``.

Figures, per run: requests failed (any answer but 200, or none; goal 0); the first
request's time to first token, against its replica's start (placed to Ready) as the
control plane measured it (``llmgw_replica_start_seconds``; goal: at most that + 1 s); replica starts in each rise of the
sine (goal: at most one); goodput, the requests whose time to first token met the
SLO (``--slo``, 2 s); and replica-seconds, every second's count of the model's
replicas that hold an engine (starting, ready or draining). The elastic run's goodput
against the fixed run's (goal at least 95 %), and its replica-seconds against the
fixed run's (goal at most 60 %).

    .venv/bin/python -m tools.bench_demand             # both runs, ~15 minutes
    .venv/bin/python -m tools.bench_demand --quick     # a shorter shape, ~6 minutes
    .venv/bin/python -m tools.bench_demand --only elastic --json

Every process is ended on the way out, Ctrl-C included; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from llmgw.controlplane.demand import UP_S
from llmgw.router.keys import hash_key, new_key
from llmgw.tls import init_ca, issue_agent, issue_server, load_ca
from tools.support import fleetapi
from tools.support.benchlib import free_port, percentile
from tools.support.procs import Procs, interrupt_on_sigterm, llmgw, stop_engines
from tools.support.slowmodel import write_slow_model

MODEL = "m"
HI = [{"role": "user", "content": "hi"}]
ENGINE_STATES = ("Pending", "Starting", "Ready", "Draining")  # holding an engine


@dataclass
class Shape:
    users: int = 50
    burst_s: float = 60.0
    period_s: float = 120.0
    periods: int = 2
    idle_s: float = 20.0  # the model's idle_s: the quiet phases last longer
    think_s: float = 3.0  # a user's pause between its requests

    def sine_users(self, t: float) -> int:
        """Users at ``t`` seconds into the sine: none to half the burst and back."""
        top = self.users / 2
        return round(top * (1 - math.cos(2 * math.pi * t / self.period_s)) / 2)


@dataclass
class Request:
    phase: str
    at: float  # seconds since the run's load began
    ok: bool
    ttft: float | None
    said: str = ""


@dataclass
class Result:
    kind: str
    requests: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    first_ttft_s: float | None = None
    start_s: float | None = None  # the control plane's measured start time
    met_slo: int = 0
    replica_seconds: float = 0.0
    starts_per_rise: list[int] = field(default_factory=list)
    stops_in_sine: int = 0
    flaps_in_sine: int = 0  # a stop, then a start again, within the sine
    changes: list[str] = field(default_factory=list)
    ttft_p95_s: dict[str, float | None] = field(default_factory=dict)
    peak_replicas: int = 0


class Fleet:
    """One run's processes: CA, server (control plane and router), one agent."""

    def __init__(
        self, d: Path, procs: Procs, catalog: str, access_log: bool = False, log_level: str = "info"
    ) -> None:
        pki = d / "pki"
        init_ca(pki)
        ca = load_ca(pki)
        issue_server(ca, ["127.0.0.1"], pki)
        issue_agent(ca, "n1", pki)
        self.key = new_key()
        stream, admin, router = free_port(), free_port(), free_port()
        (d / "catalog.toml").write_text(catalog)
        (d / "server.toml").write_text(
            f"""state_dir = "state"
catalog = "catalog.toml"
log_level = "{log_level}"
[router]
listen = "127.0.0.1:{router}"
access_log = {"true" if access_log else "false"}
[[router.keys]]
name = "bench"
sha256 = "{hash_key(self.key)}"
[reconcile]
settle_s = 1
[agent_stream]
listen = "127.0.0.1:{stream}"
[admin]
listen = "127.0.0.1:{admin}"
"""
        )
        low = free_port()
        (d / "agent.toml").write_text(
            f'control_plane = ["127.0.0.1:{stream}"]\nnode_id = "n1"\nstate_dir = "agent"\n'
            f"[engines]\nport_range = [{low}, {low + 20}]\n"
            '[discovery]\nnvidia_smi = "/nonexistent"\n'
            "[inventory]\nmemory_gb = 64\n"
        )
        self.admin = f"http://127.0.0.1:{admin}"
        self.base = f"http://127.0.0.1:{router}/v1"
        procs.start("server", llmgw("server", "--config", "server.toml"))
        token_file = d / "state" / "admin-token"
        procs["server"].wait_until(
            lambda: (token_file.exists() and fleetapi.up(self.admin)) or None, "its admin API", 30
        )
        self.token = token_file.read_text().strip()
        procs.start("agent", llmgw("agent", "--config", "agent.toml"))
        procs["agent"].wait_until(
            lambda: fleetapi.ready_nodes(self.admin, self.token) >= 1 or None, "Ready", 30
        )

    def replicas(self) -> list[dict[str, Any]]:
        return [r for r in fleetapi.replicas(self.admin, self.token) if r["model"] == MODEL]

    def metrics(self) -> dict[str, float]:
        """The control plane's samples of the model (name -> value; labels dropped)."""
        r = httpx.get(
            self.admin + "/metrics", headers={"authorization": f"Bearer {self.token}"}, timeout=5
        )
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line.startswith("#") or f'model="{MODEL}"' not in line:
                continue
            name, value = line.partition("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
        return out


def catalog(kind: str, model: Path, most: int, target: float, idle_s: float) -> str:
    replicas = (
        f"{{ min = 0, max = {most}, target = {target:g}, idle_s = {idle_s:g} }}"
        if kind == "elastic"
        else str(most)
    )
    return f"""[models.{MODEL}]
replicas = {replicas}
[[models.{MODEL}.profiles]]
name = "cpu"
engine = "llama.cpp"
gpus = 0
min_memory_gb = 1
model_path = "{model}"
settings = {{ context = 1024, parallel = 2, threads = 1, threads_batch = 1 }}
startup_timeout_s = 120
"""


class Sampler:
    """Every second: the model's replicas that hold an engine (a thread of its own, so
    that the load's event loop does not delay it)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.counts: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                rows = self.fleet.replicas()
            except (httpx.HTTPError, OSError):
                continue
            n = sum(1 for r in rows if r["state"] in ENGINE_STATES)
            self.counts.append((time.monotonic(), n))


async def one(client: httpx.AsyncClient, fleet: Fleet, phase: str, began: float) -> Request:
    at = time.monotonic()
    body = {"model": MODEL, "messages": HI, "max_tokens": 16, "stream": True}
    ttft = None
    try:
        async with client.stream(
            "POST",
            fleet.base + "/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {fleet.key}"},
        ) as r:
            if r.status_code != 200:
                said = (await r.aread()).decode(errors="replace")[:120]
                return Request(phase, at - began, False, None, f"{r.status_code} {said}")
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: ") and '"content"' in line:
                    ttft = time.monotonic() - at
                if line == "data: [DONE]":
                    break
    except httpx.HTTPError as exc:
        return Request(phase, at - began, False, None, f"{type(exc).__name__} {exc}"[:120])
    return Request(phase, at - began, ttft is not None, ttft, "" if ttft else "no token")


async def load(fleet: Fleet, shape: Shape) -> tuple[list[Request], dict[str, float]]:
    """The shape, played; the requests, and when each phase began (s since the load)."""
    done: list[Request] = []
    marks: dict[str, float] = {}
    began = time.monotonic()
    limits = httpx.Limits(max_connections=shape.users + 10, max_keepalive_connections=shape.users)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        # idle first: a control plane places nothing in its first settle_s (agents may
        # still be coming back), and this one has just started
        await trio.sleep(5.0)
        marks["first"] = time.monotonic() - began
        done.append(await one(client, fleet, "first", began))
        # that replica's own start, as the control plane measured it (the histogram's
        # first observation)
        samples = await trio.to_thread.run_sync(fleet.metrics)
        marks["first_start_s"] = samples.get("llmgw_replica_start_seconds_sum", math.nan)
        await trio.sleep(shape.idle_s * 1.5 + 5)  # back to zero (elastic)

        async def users(phase: str, count: Callable[[float], int], until: float) -> None:
            marks[phase] = time.monotonic() - began

            async def user(i: int) -> None:
                while time.monotonic() < until:
                    if i >= count(time.monotonic()):
                        await trio.sleep(0.2)
                        continue
                    done.append(await one(client, fleet, phase, began))
                    await trio.sleep(shape.think_s)

            async with trio.open_nursery() as nursery:
                for i in range(shape.users):
                    nursery.start_soon(user, i)

        end = time.monotonic() + shape.burst_s
        await users("burst", lambda now: shape.users, end)
        marks["gap"] = time.monotonic() - began
        await trio.sleep(shape.idle_s * 1.5 + 5)  # back to zero (elastic)
        start = time.monotonic()
        marks["wall_sine"] = time.time()
        await users(
            "sine",
            lambda now: shape.sine_users(now - start),
            start + shape.period_s * shape.periods,
        )
        marks["idle"] = time.monotonic() - began
        await trio.sleep(shape.idle_s * 1.5 + 5)
        marks["end"] = time.monotonic() - began
    return done, marks


def run(kind: str, args: argparse.Namespace, shape: Shape) -> Result:
    with tempfile.TemporaryDirectory(prefix=f"llmgw-bench-demand-{kind}-") as tmp:
        d = Path(tmp)
        procs = Procs(d)
        try:
            model = write_slow_model(d / "slow.gguf", context_length=1024)
            text = catalog(kind, model, args.max, args.target, shape.idle_s)
            fleet = Fleet(d, procs, text, args.access_log, args.log_level)
            if kind == "fixed":
                procs["server"].wait_until(
                    lambda: (
                        sum(r["state"] == "Ready" for r in fleet.replicas()) >= args.max or None
                    ),
                    f"{args.max} Ready replicas",
                    180,
                )
            with Sampler(fleet) as sampler:
                requests, marks = trio.run(load, fleet, shape)
            log = procs.log("server")
            return summarize(
                kind,
                requests,
                marks,
                sampler.counts,
                log,
                args.slo,
                shape.period_s,
                shape.periods,
            )
        finally:
            procs.stop_all()
            stop_engines(d, signal.SIGKILL)
            if args.keep:  # the logs, for a look at what happened when
                keep = Path(args.keep) / kind
                keep.mkdir(parents=True, exist_ok=True)
                for kept in d.glob("*.log"):
                    shutil.copy(kept, keep / kept.name)


def summarize(
    kind: str,
    requests: list[Request],
    marks: dict[str, float],
    counts: list[tuple[float, int]],
    log: str,
    slo: float,
    period_s: float,
    periods: int,
) -> Result:
    r = Result(kind=kind, requests=len(requests))
    for q in requests:
        if not q.ok:
            r.failed += 1
            r.failures[q.said] = r.failures.get(q.said, 0) + 1
        elif q.ttft is not None and q.ttft <= slo:
            r.met_slo += 1
    first = next((q for q in requests if q.phase == "first"), None)
    r.first_ttft_s = None if first is None else first.ttft
    start = marks.get("first_start_s", math.nan)
    r.start_s = None if math.isnan(start) else start  # the first replica's own start
    r.replica_seconds = float(sum(n for _, n in counts))  # one sample a second
    r.peak_replicas = max((n for _, n in counts), default=0)
    for phase in ("first", "burst", "sine"):
        ttfts = [q.ttft for q in requests if q.phase == phase and q.ttft is not None]
        p95 = percentile(ttfts, 0.95) if ttfts else None
        r.ttft_p95_s[phase] = None if p95 is None else round(p95, 3)
    r.changes = [
        line.split("scaling m: ", 1)[1] for line in log.splitlines() if "scaling m: " in line
    ]
    if "wall_sine" in marks:
        r.starts_per_rise, r.stops_in_sine, r.flaps_in_sine = _sine(
            log, marks["wall_sine"], period_s, periods
        )
    return r


def _sine(log: str, start: float, period: float, periods: int) -> tuple[list[int], int, int]:
    """Upward changes in each rise of the sine (its rising half, and the rule's ``UP_S``
    after it, from the server log's timestamps), downward changes during it, and flaps:
    a rise after a fall within it (a replica stopped, then one started again)."""
    ups: list[float] = []
    downs: list[float] = []
    for line in log.splitlines():
        if "scaling m: " not in line:
            continue
        before, _, rest = line.split("scaling m: ", 1)[1].partition(" → ")
        after = rest.split(":", 1)[0]
        if not (before.isdigit() and after.isdigit()):
            continue
        stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1e3
        (ups if int(after) > int(before) else downs).append(stamp)
    rises = []
    for k in range(periods):
        lo = start + k * period
        rises.append(sum(1 for u in ups if lo <= u < lo + period / 2 + UP_S))
    end = start + periods * period
    flaps = sum(1 for u in ups if start <= u < end and any(start <= d < u for d in downs))
    return rises, sum(1 for d in downs if start <= d < end), flaps


def table(results: list[Result], slo: float) -> str:
    lines = []
    for r in results:
        lines.append(
            f"{r.kind}: {r.requests} requests, {r.failed} failed {r.failures or ''}; "
            f"met the {slo:g} s TTFT SLO: {r.met_slo}; replica-seconds {r.replica_seconds:.0f} "
            f"(peak {r.peak_replicas}); TTFT p95 {r.ttft_p95_s}"
        )
        if r.kind == "elastic":
            lines.append(
                f"  first request at zero: TTFT {_s(r.first_ttft_s)} against its replica's "
                f"start, {_s(r.start_s)} as measured (goal <= start + 1 s: "
                f"{_met(r.first_ttft_s is not None and r.start_s is not None and r.first_ttft_s <= r.start_s + 1)})"
            )
            lines.append(
                f"  starts per rise of the sine: {r.starts_per_rise} (goal <= 1: "
                f"{_met(all(n <= 1 for n in r.starts_per_rise))}; a rise from zero starts one "
                "for its first request and more as it grows); stops during it: "
                f"{r.stops_in_sine}; flapping, a start after a stop within it: "
                f"{r.flaps_in_sine} (goal 0: {_met(r.flaps_in_sine == 0)})"
            )
            lines.append("  changes: " + "; ".join(r.changes))
    by = {r.kind: r for r in results}
    if "elastic" in by and "fixed" in by:
        e, f = by["elastic"], by["fixed"]
        good = e.met_slo / f.met_slo if f.met_slo else math.nan
        cost = e.replica_seconds / f.replica_seconds if f.replica_seconds else math.nan
        lines.append(
            f"elastic / fixed: goodput {good:.1%} (goal >= 95 %: {_met(good >= 0.95)}), "
            f"replica-seconds {cost:.1%} (goal <= 60 %: {_met(cost <= 0.6)}); failed "
            f"{e.failed} (goal 0: {_met(e.failed == 0)})"
        )
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a shorter shape")
    ap.add_argument("--only", choices=["elastic", "fixed"])
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--max", type=int, default=3, help="the range's max, the fixed count")
    ap.add_argument("--target", type=float, default=2.0, help="requests at once per replica")
    ap.add_argument("--slo", type=float, default=2.0, help="time to first token, seconds")
    ap.add_argument("--period", type=float, default=None, help="the sine's, seconds")
    ap.add_argument("--periods", type=int, default=None, help="of the sine")
    ap.add_argument("--burst-s", type=float, default=None)
    ap.add_argument("--idle-s", type=float, default=None, help="the model's idle_s")
    ap.add_argument("--think-s", type=float, default=None, help="a user's pause")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="copy each run's logs into DIR/KIND")
    ap.add_argument("--access-log", action="store_true", help="the router's, in the server's log")
    ap.add_argument("--log-level", default="info", help="the server's")
    args = ap.parse_args(argv)
    shape = Shape(users=args.users)
    if args.quick:
        shape.burst_s, shape.period_s, shape.periods, shape.idle_s = 30.0, 80.0, 1, 12.0
    if args.period:
        shape.period_s = args.period
    if args.periods:
        shape.periods = args.periods
    if args.burst_s:
        shape.burst_s = args.burst_s
    if args.idle_s:
        shape.idle_s = args.idle_s
    if args.think_s is not None:
        shape.think_s = args.think_s
    interrupt_on_sigterm()
    results = []
    for kind in ("elastic", "fixed"):
        if args.only in (None, kind):
            results.append(run(kind, args, shape))
            print(json.dumps(asdict(results[-1])), flush=True)
    if not args.json:
        print("\n" + table(results, args.slo))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does ``llmgw router`` scale with its worker processes? workers = 1 against workers = 2.

One run on loopback, reusing ``tools/bench_router.py``'s pieces (the stand-in engine,
the ``llmgw server`` start, the load generator, the /proc readers):

- the fast stand-in engine (``tools/bench_router_engine.py``);
- ``llmgw server`` whose catalog is one static model (``tiny``) on that engine: the
  control plane, whose admin API publishes the routing table (its own router port
  is left unused);
- two standalone ``llmgw router --config ...`` processes, ``workers = 1`` and
  ``workers = 2`` (SO_REUSEPORT), each following the server's ``GET /v1/routing`` with
  its admin token file; the run starts measuring once every worker has logged
  "routing table now version ...: 1 routes" and a request went through;
- the load generator (a separate process): non-streaming requests at concurrency 16
  and 64, a bounded window each, rounds interleaved (w1 c16, w2 c16, w1 c64, w2 c64,
  then again) so drift on a shared machine hits both sides alike; the median run by
  requests/s is kept.

Reported per cell: requests/s, p50/p99, the router's CPU per request (utime + stime of
the parent and its worker children, /proc/<pid>/stat), how that CPU split across the
router's processes, the engine's and load generator's CPU, how busy each core was over
the window (/proc/stat deltas) and what the rest of the machine used; then the scaling
ratio (rps with 2 workers / rps with 1) per concurrency, and the requests/s per core
of router CPU for each (equal figures: each worker adds capacity in proportion to the
cores it is given, which is what near-linear scaling means on a machine with cores to
spare).

Nothing is pinned: with two cores, pinning the router to one would put both of its
workers on one core (the ratio could only be ~1), and there is no third core to move
the engine and the load generator to. The kernel schedules all of them on both cores,
so the ratio says how far a second worker helps on *this* machine; the per-core busy
columns say whether the machine (both cores near 100%) or the router was the limit.

    python -m tools.bench_router_scaling              # ~4 s windows, 3 rounds, ~1.5 minutes
    python -m tools.bench_router_scaling --seconds 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from tools import bench_router as br
from tools.support.benchlib import descendants, free_port, tree_cpu
from tools.support.procs import ROOT, Procs, interrupt_on_sigterm, llmgw

WORKERS = (1, 2)


# --------------------------------------------------------------------------- measuring


def proc_stat() -> dict[str, tuple[int, int]]:
    """Per core: (busy, total) jiffies since boot, from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *rest = line.split()
        if not re.fullmatch(r"cpu\d+", name):
            continue
        v = [int(x) for x in rest]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
        out[name] = (total - idle, total)
    return out


def all_processes() -> dict[int, tuple[str, float]]:
    """Every process now: pid -> (command name, utime + stime seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[int(entry.name)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def loadgen_with_marks(spec: dict[str, Any]) -> dict[str, Any]:
    """bench_router's load generator, plus /proc/stat and every process's CPU at the
    window's edges: it reads the router's tree CPU exactly once as the window opens
    and once as it closes, so readings taken alongside those mark the window."""
    marks: list[tuple[dict[str, tuple[int, int]], dict[int, tuple[str, float]]]] = []

    def marked(pid: int) -> float:
        marks.append((proc_stat(), all_processes()))
        return tree_cpu(pid)

    result = br.loadgen(spec, proxy_cpu=marked)
    (stat0, ps0), (stat1, ps1) = marks[0], marks[-1]
    result["cores"] = {
        name: (stat1[name][0] - stat0[name][0], stat1[name][1] - stat0[name][1])
        for name in stat1
        if name in stat0
    }
    # CPU over the window of every process alive at its end (one that started inside
    # the window counts from 0, one that ended inside it is not seen)
    result["processes"] = {
        str(pid): [comm, cpu - ps0.get(pid, (comm, 0.0))[1]]
        for pid, (comm, cpu) in ps1.items()
        if cpu - ps0.get(pid, (comm, 0.0))[1] > 0
    }
    result["loadgen_pid"] = os.getpid()
    return result


def run_cell(
    python: Path,
    *,
    port: int,
    key: str,
    router_pid: int,
    engine_pid: int,
    concurrency: int,
    seconds: float,
    warmup_s: float,
) -> dict[str, Any]:
    spec = {
        "port": port,
        "key": key,
        "path": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 16,
        },
        "pids": [router_pid],
        "engine_pid": engine_pid,
        "concurrency": concurrency,
        "seconds": seconds,
        "max_requests": 10**9,  # bounded by time only
        "warmup_s": warmup_s,
        "stagger_s": 0.0,
    }
    return br.spawn_loadgen(python, "tools.bench_router_scaling", spec)


# --------------------------------------------------------------------------- processes


def start_server(procs: Procs, engine_port: int) -> tuple[str, Path, str]:
    """``llmgw server`` (bench_router's, a static model on the engine): admin URL,
    admin token file, and an API key its routers accept (its hash goes in their config)."""
    _, _, key = br.start_llmgw(procs, engine_port, None)
    m = procs["llmgw"].wait_log(r"admin API listening on (http://\S+?)(?:,|\s|$)", timeout=30)
    made = re.search(r"created admin token in (\S+)", procs.log("llmgw"))
    token_file = (
        Path(made.group(1)) if made else procs.workdir / "llmgw-server" / "state" / "admin-token"
    )
    if not token_file.is_absolute():
        token_file = procs.workdir / token_file
    return m.group(1), token_file, key


def start_router(
    procs: Procs, workers: int, admin_url: str, token_file: Path, key: str
) -> tuple[int, int]:
    from llmgw.router.keys import hash_key

    name = f"router-w{workers}"
    port = free_port()
    config = procs.workdir / f"{name}.toml"
    config.write_text(
        f"""admin_url = "{admin_url}"
admin_token_file = "{token_file}"
workers = {workers}
log_level = "info"

[router]
listen = "127.0.0.1:{port}"

[[router.keys]]
name = "bench"
sha256 = "{hash_key(key)}"
models = []
"""
    )
    p = procs.start(name, llmgw("router", "--config", str(config)))
    routed = re.compile(r"routing table now version \S+ 1 routes")

    def ready() -> bool:
        text = procs.log(name)
        return len(routed.findall(text)) >= workers and len(descendants(p.pid)) >= workers

    procs.wait_until(name, ready, 60)
    procs.wait_until(
        name,
        lambda: (
            b"chat.completion"
            in br.http_post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                key,
                timeout=5,
            )
        ),
        15,
    )
    return p.pid, port


# --------------------------------------------------------------------------- report


def fmt_ms(s: float) -> str:
    return "-" if s != s else f"{s * 1e3:.2f}"


def row(w: int, c: int, r: dict[str, Any]) -> str:
    el = r["elapsed"] or 1.0
    n = r["n"]
    cores = r["cores"]
    core_busy = [
        100 * b / t if t else 0.0
        for b, t in (cores[k] for k in sorted(cores, key=lambda k: int(k[3:])))
    ]
    busy_s = sum(b for b, _ in cores.values()) / os.sysconf("SC_CLK_TCK")
    procs = r["processes"]
    per = sorted((procs.get(str(p), ["", 0.0])[1] for p in r["router_pids"]), reverse=True)
    split = "/".join(f"{100 * x / (sum(per) or 1):.0f}" for x in per) if len(per) > 1 else "100"
    cp = sum(procs.get(str(p), ["", 0.0])[1] for p in r["server_pids"])
    rest = busy_s - r["proxy_cpu_s"] - r["engine_cpu_s"] - r["loadgen_cpu_s"] - cp
    return (
        f"{w:>2} {c:>3} {r['rps']:>7.0f} {fmt_ms(r['p50']):>7} {fmt_ms(r['p99']):>7} "
        f"{1e3 * r['proxy_cpu_s'] / n if n else float('nan'):>8.3f} {split:>7} "
        f"{100 * r['proxy_cpu_s'] / el:>5.0f} {100 * r['engine_cpu_s'] / el:>5.0f} "
        f"{100 * r['loadgen_cpu_s'] / el:>5.0f} {100 * cp / el:>4.0f} {100 * rest / el:>6.0f} "
        f"{' '.join(f'{b:>5.0f}' for b in core_busy)} "
        f"{1e3 * busy_s / n if n else float('nan'):>8.3f} {n:>6} {r['errors']:>4}"
    )


def other_share(r: dict[str, Any]) -> float:
    """The cores' busy time not spent by the benchmark's processes, in % of one core."""
    busy_s = sum(b for b, _ in r["cores"].values()) / os.sysconf("SC_CLK_TCK")
    cp = sum(r["processes"].get(str(p), ["", 0.0])[1] for p in r["server_pids"])
    ours = r["proxy_cpu_s"] + r["engine_cpu_s"] + r["loadgen_cpu_s"] + cp
    return float(100 * (busy_s - ours) / (r["elapsed"] or 1.0))


def machine_busy(r: dict[str, Any]) -> float:
    """How busy the cores were on average over the window, in percent."""
    cores = r["cores"].values()
    return float(100 * sum(b for b, _ in cores) / (sum(t for _, t in cores) or 1))


def others(r: dict[str, Any]) -> dict[str, float]:
    """CPU share (100 = one core) of processes outside the benchmark, by command name."""
    ours = {*r["router_pids"], *r["server_pids"], r["engine_pid"], r["loadgen_pid"]}
    out: dict[str, float] = {}
    for pid, (comm, cpu) in r["processes"].items():
        if int(pid) not in ours:
            out[comm] = out.get(comm, 0.0) + 100 * cpu / (r["elapsed"] or 1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loadgen", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured window per cell")
    ap.add_argument("--warmup", type=float, default=0.5, help="warm-up per cell")
    ap.add_argument("--rounds", type=int, default=3, help="runs per cell; the median is kept")
    ap.add_argument("-c", "--concurrency", type=int, action="append", help="default 16, 64")
    args = ap.parse_args()
    if args.loadgen:
        print(json.dumps(loadgen_with_marks(json.loads(args.loadgen))))
        return
    concs = args.concurrency or [16, 64]

    (ROOT / ".llmgw").mkdir(exist_ok=True)
    python = br.venv_python(br.VENV_ASGI, br.ASGI_PACKAGES, ROOT / ".llmgw" / "bench-install.log")

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    ncores = len(os.sched_getaffinity(0))
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    results: dict[tuple[int, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-scaling-") as tmp:
        procs = Procs(Path(tmp))
        try:
            engine_pid, engine_port = br.start_engine(procs, python, None)
            admin_url, token_file, key = start_server(procs, engine_port)
            server_pids = descendants(procs["llmgw"].pid)
            routers = {w: start_router(procs, w, admin_url, token_file, key) for w in WORKERS}
            idle_s = 1.0
            cpu0 = {w: tree_cpu(pid) for w, (pid, _) in routers.items()}
            time.sleep(idle_s)
            idle = {w: (tree_cpu(pid) - cpu0[w]) / idle_s for w, (pid, _) in routers.items()}

            print(
                f"# machine: {ncores} cores (os.cpu_count() {os.cpu_count()}), shared by the "
                "engine, the load generator, the router's workers and anything else running"
            )
            print(
                "# nothing pinned: pinning the router to one core would put both workers on "
                "it (ratio ~1 by construction) and there is no spare core for the engine and "
                "load generator; the kernel spreads everything over both cores"
            )
            print(
                f"# non-streaming, window {args.seconds:g} s after {args.warmup:g} s warm-up, "
                f"{args.rounds} interleaved round(s), median by rps kept; CPU from /proc "
                f"({tick_ms:g} ms ticks); both routers run throughout, the idle one costs "
                + ", ".join(f"w{w} {1e3 * v:.1f} ms/s" for w, v in idle.items())
                + " at rest"
            )
            for _ in range(args.rounds):
                for c in concs:
                    for w in WORKERS:
                        pid, port = routers[w]
                        r = run_cell(
                            python,
                            port=port,
                            key=key,
                            router_pid=pid,
                            engine_pid=engine_pid,
                            concurrency=c,
                            seconds=args.seconds,
                            warmup_s=args.warmup,
                        )
                        r["router_pids"] = descendants(pid)
                        r["server_pids"] = server_pids
                        r["engine_pid"] = engine_pid
                        results.setdefault((w, c), []).append(r)
        finally:
            procs.stop_all()

    core_cols = " ".join(f"{'cpu' + str(i) + '%':>5}" for i in range(ncores))
    print(
        f"\n{'w':>2} {'c':>3} {'rps':>7} {'p50 ms':>7} {'p99 ms':>7} {'rtr ms/r':>8} "
        f"{'split%':>7} {'rtr%':>5} {'eng%':>5} {'lg%':>5} {'cp%':>4} {'other%':>6} {core_cols} "
        f"{'all ms/r':>8} {'n':>6} {'err':>4}"
    )
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for c in concs:
        for w in WORKERS:
            runs = sorted(results[(w, c)], key=lambda r: r["rps"])
            best[(w, c)] = runs[len(runs) // 2]
            print(row(w, c, best[(w, c)]))
    print(
        "\n# w: router workers; rtr ms/r: router CPU (parent + workers) per request; split%: "
        "that CPU by process; rtr/eng/lg%: router, engine, load generator CPU over the "
        "window (100 = one core); cp%: the llmgw server (control plane) it follows; other%: "
        "the rest of the cores' busy time (other processes on the machine, kernel, "
        "processes that ended inside the window, so not seen by name below); cpuN%: how busy each core was (/proc/stat); all ms/r: busy core time "
        f"per request, so {ncores} cores cap the machine near {ncores}000 / all ms/r rps"
    )
    for (w, c), r in best.items():
        top = sorted(others(r).items(), key=lambda kv: -kv[1])[:4]
        print(
            f"# outside the benchmark in w{w} c{c}: "
            + (", ".join(f"{comm} {v:.0f}%" for comm, v in top if v >= 1) or "nothing >= 1%")
        )
    for c in concs:
        verdicts = []
        for w in WORKERS:
            r = best[(w, c)]
            rtr = 100 * r["proxy_cpu_s"] / (r["elapsed"] or 1.0)
            busy = machine_busy(r)
            limit = (
                f"router-bound ({w} worker(s) at {rtr:.0f}% of one core)"
                if rtr >= 90 * w
                else f"machine-bound (cores {busy:.0f}% busy, router {rtr:.0f}%)"
                if busy >= 95
                else f"neither saturated (cores {busy:.0f}%, router {rtr:.0f}%)"
            )
            verdicts.append(f"w{w} {limit}")
        print(f"# c{c}: " + "; ".join(verdicts))
    for c in concs:
        one, two = best[(1, c)], best[(2, c)]
        ratio = two["rps"] / one["rps"] if one["rps"] else float("nan")
        print(
            f"# scaling c{c}: {ratio:.2f}x rps with 2 workers vs 1 "
            f"({two['rps']:.0f} vs {one['rps']:.0f}; all rounds w1 "
            + ", ".join(f"{r['rps']:.0f}" for r in results[(1, c)])
            + "; w2 "
            + ", ".join(f"{r['rps']:.0f}" for r in results[(2, c)])
            + ")"
        )
        # Linear in the cores it gets: requests/s per core-second of router CPU.
        eff = [b["rps"] / (b["proxy_cpu_s"] / (b["elapsed"] or 1.0)) for b in (one, two)]
        print(
            f"#   per router core c{c}: w1 {eff[0]:.0f} rps per core busy, w2 {eff[1]:.0f} "
            f"({eff[1] / eff[0]:.2f}x): a second worker adds {100 * eff[1] / eff[0]:.0f}% "
            "of a first one's capacity for each core it is given; here it was given "
            f"{two['proxy_cpu_s'] / (two['elapsed'] or 1.0) - 1:.2f} of a core more"
        )
        q1, q2 = (min(results[(w, c)], key=other_share) for w in WORKERS)
        print(
            f"#   in each side's quietest round (least other%): "
            f"{q2['rps'] / q1['rps'] if q1['rps'] else float('nan'):.2f}x "
            f"({q2['rps']:.0f} at other {other_share(q2):.0f}% vs {q1['rps']:.0f} at other "
            f"{other_share(q1):.0f}%)"
        )


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()

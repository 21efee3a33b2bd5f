"""llmgw's router against direct access, a Python ceiling and LiteLLM, side by side.

One run, one fast stand-in engine on loopback (``tools/bench_router_engine.py``),
one proxy process each in front of it:

- ``direct``:  no proxy, the load generator talks to the engine;
- ``relay``:   a raw TCP byte relay on uvloop (``tools/bench_router_relay.py``), no
               HTTP at all: the floor, what this machine charges any process in
               the middle;
- ``relay-trio``: the same relay on trio, written like llmgw's hot path: the
               floor for any trio proxy;
- ``llmgw``:   ``llmgw server`` as a plain router over a static endpoint;
- ``asgi``:    a minimal uvicorn + aiohttp proxy (``tools/bench_router_proxy.py``),
               the Python ceiling;
- ``litellm``: LiteLLM's proxy (``litellm --config ... --num_workers 1``), installed
               by this script into its own virtualenv.

Each proxy is pinned to one core; the engine, the load generator and this
script share the other. The load generator is a separate process (asyncio on
uvloop, an httptools parser, raw keep-alive connections, one request
outstanding per connection). It warms each cell up, then measures a window
bounded by time and by request count: requests/s, p50/p99 latency, time to
first body byte, and the proxy's CPU over the window from /proc/<pid>/stat
(utime + stime of the proxy and every descendant). Its own CPU and the
engine's are reported too, so a saturated core 0 shows.

Modes: non-streaming; streaming (16 SSE chunks at once); paced streaming
(16 chunks 10 ms apart). Concurrency 1, 16 and 64. The issue's goals are
computed from the same run and printed as met / NOT met.

    python -m tools.bench_router            # full: ~3 s a cell, about 4 minutes
    python -m tools.bench_router --quick    # ~1 s a cell, about 2 minutes
    python -m tools.bench_router --no-litellm --only plain -c 16

Virtualenvs (made on first use, under .llmgw/): ``bench-venv-asgi`` (uvicorn,
uvloop, httptools, aiohttp; also runs the engine and the load generator, told where
this checkout is by ``PYTHONPATH``) and ``bench-venv-litellm`` (``litellm[proxy]``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.support.benchlib import cpu_seconds, free_port, percentile, server_head, tree_cpu
from tools.support.procs import ROOT, Procs, interrupt_on_sigterm, llmgw, python_path

VENV_ASGI = ROOT / ".llmgw" / "bench-venv-asgi"
VENV_LITELLM = ROOT / ".llmgw" / "bench-venv-litellm"
ASGI_PACKAGES = ["uvicorn==0.54.0", "uvloop==0.23.0", "httptools==0.9.0", "aiohttp==3.14.5"]
LITELLM_PACKAGE = "litellm[proxy]==1.108.7"
CHUNKS = 16  # per streamed response (the engine's constant)
PACE_MS = 10
MODES = {"plain": "non-streaming", "stream": "streaming", "paced": "paced streaming"}
PROXIES = ["direct", "relay", "relay-trio", "llmgw", "asgi", "litellm"]


# --------------------------------------------------------------------------- load generator


def loadgen(spec: dict[str, Any], proxy_cpu: Callable[[int], float] = tree_cpu) -> dict[str, Any]:
    """Run in its own process: drive one cell, return its measurements. ``proxy_cpu``
    reads a proxy's CPU (its tree's), once as the window opens and once as it closes."""
    import asyncio
    import random

    import httptools

    try:
        import uvloop
    except ImportError:  # the project's interpreter: plain asyncio, still cheap enough
        uvloop = None

    body = json.dumps(spec["body"], separators=(",", ":")).encode()
    head = (
        f"POST {spec['path']} HTTP/1.1\r\nHost: 127.0.0.1:{spec['port']}\r\n"
        f"Authorization: Bearer {spec['key']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    request = head + body
    pids: list[int] = spec["pids"]
    engine_pid: int = spec["engine_pid"]
    now = time.perf_counter

    class State:
        phase = "warmup"  # warmup -> measure -> drain
        window_start = 0.0
        done = 0
        errors = 0
        latencies: list[float] = []
        ttfbs: list[float] = []
        body_bytes = 0
        outstanding = 0
        finished: asyncio.Event

    st = State()

    class Conn(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpResponseParser(self)
            self.transport: asyncio.Transport | None = None
            self.t0 = 0.0
            self.ttfb = 0.0
            self.status = 0
            self.nbytes = 0
            self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
            self.send()

        def send(self) -> None:
            if st.phase == "drain" or self.transport is None:
                if self.transport is not None:
                    self.transport.close()
                return
            st.outstanding += 1
            self.t0 = now()
            self.ttfb = 0.0
            self.nbytes = 0
            self.transport.write(request)

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                st.errors += 1
                assert self.transport is not None
                self.transport.close()

        def on_headers_complete(self) -> None:
            self.status = self.parser.get_status_code()

        def on_body(self, chunk: bytes) -> None:
            if not self.ttfb:
                self.ttfb = now()
            self.nbytes += len(chunk)

        def on_message_complete(self) -> None:
            t = now()
            st.outstanding -= 1
            if st.phase == "measure":
                if self.status != 200:
                    st.errors += 1
                else:
                    st.done += 1
                    st.latencies.append(t - self.t0)
                    st.ttfbs.append((self.ttfb or t) - self.t0)
                    st.body_bytes += self.nbytes
                if st.done >= spec["max_requests"]:
                    st.finished.set()
            if st.phase == "drain" and st.outstanding == 0:
                st.finished.set()
            self.send()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.transport is not None and st.phase != "drain":
                st.errors += 1
                st.outstanding -= 1
            self.transport = None
            if not self.lost.done():
                self.lost.set_result(None)

    async def connection() -> None:
        loop = asyncio.get_running_loop()
        # spread the first requests over one response time, so paced streams are not in step
        await asyncio.sleep(random.uniform(0, spec["stagger_s"]))
        while st.phase != "drain":
            try:
                _, conn = await loop.create_connection(Conn, "127.0.0.1", spec["port"])
            except OSError:
                st.errors += 1
                await asyncio.sleep(0.05)
                continue
            await conn.lost
            if st.phase != "drain":
                await asyncio.sleep(0.01)

    async def run() -> dict[str, Any]:
        st.finished = asyncio.Event()
        tasks = [asyncio.ensure_future(connection()) for _ in range(spec["concurrency"])]
        await asyncio.sleep(spec["warmup_s"])
        cpu0 = [proxy_cpu(p) for p in pids]
        engine0 = cpu_seconds(engine_pid)
        own0 = time.process_time()
        st.window_start = now()
        st.phase = "measure"
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(st.finished.wait(), spec["seconds"])
        elapsed = now() - st.window_start
        cpu1 = [proxy_cpu(p) for p in pids]
        engine1 = cpu_seconds(engine_pid)
        own1 = time.process_time()
        st.phase = "drain"
        st.finished.clear()
        if st.outstanding > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(st.finished.wait(), 15)
        for t in tasks:
            t.cancel()
        lat = sorted(st.latencies)
        ttfb = sorted(st.ttfbs)
        n = st.done
        return {
            "n": n,
            "errors": st.errors,
            "elapsed": elapsed,
            "rps": n / elapsed if elapsed > 0 else 0.0,
            "p50": percentile(lat, 0.50),
            "p99": percentile(lat, 0.99),
            "ttfb50": percentile(ttfb, 0.50),
            "ttfb99": percentile(ttfb, 0.99),
            "proxy_cpu_s": sum(cpu1) - sum(cpu0) if pids else None,
            "engine_cpu_s": engine1 - engine0,
            "loadgen_cpu_s": own1 - own0,
            "bytes_per_response": st.body_bytes / n if n else 0,
        }

    if uvloop is not None:
        measured: dict[str, Any] = uvloop.run(run())
        return measured
    return asyncio.run(run())


# --------------------------------------------------------------------------- processes


def venv_python(venv: Path, packages: list[str], log: Path) -> Path:
    """The venv's interpreter, the venv made and ``packages`` installed on first use."""
    python = venv / "bin" / "python"
    stamp = venv / ".bench-installed"
    if python.exists() and stamp.exists() and stamp.read_text() == " ".join(packages):
        return python
    print(f"# installing {' '.join(packages)} into {venv} (once) ...", flush=True)
    with log.open("ab") as out:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out
            )
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *packages],
            check=True,
            stdout=out,
            stderr=out,
        )
    stamp.write_text(" ".join(packages))
    return python


def http_get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def http_post(url: str, body: dict[str, Any], key: str = "", timeout: float = 30.0) -> bytes:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return bytes(r.read())


def start_engine(procs: Procs, python: Path, core: int | None) -> tuple[int, int]:
    port_file = procs.workdir / "engine.port"
    argv = [str(python), "-m", "tools.bench_router_engine", str(port_file)]
    p = procs.start("engine", argv, core=core, env=python_path())
    procs.wait_until("engine", port_file.exists, 10)
    return p.pid, int(port_file.read_text())


def start_llmgw(
    procs: Procs, engine_port: int, core: int | None, catalog: str = "", router: str = ""
) -> tuple[int, int, str]:
    """``llmgw server`` routing the ``tiny`` model to the engine on ``engine_port`` (or
    what ``catalog`` says), with ``router``'s lines added to its ``[router]`` section:
    its pid, the router's port, and an API key it accepts."""
    from llmgw.router.keys import hash_key, new_key

    d = procs.workdir / "llmgw-server"
    d.mkdir(parents=True, exist_ok=True)
    key = new_key()
    port = free_port()
    (d / "catalog.toml").write_text(
        catalog or f'[models.tiny]\nstatic_endpoints = ["http://127.0.0.1:{engine_port}"]\n'
    )
    (d / "server.toml").write_text(
        server_head(d)
        + f"""[router]
listen = "127.0.0.1:{port}"
{router}[[router.keys]]
name = "bench"
sha256 = "{hash_key(key)}"
"""
    )
    p = procs.start("llmgw", llmgw("server", "--config", str(d / "server.toml")), core=core)
    p.wait_log("OpenAI-compatible endpoint on", timeout=30)
    return p.pid, port, key


def start_asgi(procs: Procs, python: Path, engine_port: int, core: int | None) -> tuple[int, int]:
    port = free_port()
    argv = [
        str(python),
        "-m",
        "tools.bench_router_proxy",
        str(port),
        f"http://127.0.0.1:{engine_port}",
    ]
    p = procs.start("asgi", argv, core=core, env=python_path())
    procs.wait_until("asgi", lambda: http_get(f"http://127.0.0.1:{port}/v1/models") == 200, 30)
    return p.pid, port


def start_relay(
    procs: Procs, python: Path, engine_port: int, core: int | None, loop: str = "uvloop"
) -> tuple[int, int]:
    name = "relay" if loop == "uvloop" else f"relay-{loop}"
    port = free_port()
    argv = [str(python), "-m", "tools.bench_router_relay", str(port), str(engine_port), loop]
    p = procs.start(name, argv, core=core, env=python_path())
    procs.wait_until(name, lambda: http_get(f"http://127.0.0.1:{port}/v1/models") == 200, 30)
    return p.pid, port


def start_litellm(
    procs: Procs, venv: Path, engine_port: int, core: int | None, master_key: str
) -> tuple[int, int]:
    """LiteLLM's proxy, started (it is slow to be ready: ``main`` waits for it last): its
    pid and port."""
    port = free_port()
    config = procs.workdir / "litellm.yaml"
    config.write_text(
        f"""model_list:
  - model_name: tiny
    litellm_params:
      model: openai/tiny
      api_base: http://127.0.0.1:{engine_port}/v1
      api_key: sk-dummy
litellm_settings:
  telemetry: false
  set_verbose: false
  json_logs: false
  drop_params: true
  turn_off_message_logging: true
  callbacks: []
  success_callback: []
  failure_callback: []
  cache: false
general_settings:
  master_key: {master_key}
  disable_spend_logs: true
  disable_reset_budget: true
  disable_adding_master_key_hash_to_db: true
  background_health_checks: false
"""
    )
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the cost map at start
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "DISABLE_SCHEMA_UPDATE": "True",
        "LITELLM_MODE": "PRODUCTION",
        "NO_DOCS": "True",
        "NO_REDOC": "True",
    }
    for var in ("DATABASE_URL", "REDIS_HOST", "REDIS_URL", "LITELLM_MASTER_KEY"):
        os.environ.pop(var, None)
    p = procs.start(
        "litellm",
        [
            str(venv / "bin" / "litellm"),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        core=core,
        env=env,
    )
    return p.pid, port


# --------------------------------------------------------------------------- the run


def run_cell(
    python: Path,
    core: int | None,
    *,
    port: int,
    key: str,
    pids: list[int],
    engine_pid: int,
    mode: str,
    concurrency: int,
    seconds: float,
    max_requests: int,
    warmup_s: float,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
    }
    if mode != "plain":
        body["stream"] = True
    spec = {
        "port": port,
        "key": key,
        "path": "/v1/chat/completions",
        "body": body,
        "pids": pids,
        "engine_pid": engine_pid,
        "concurrency": concurrency,
        "seconds": seconds,
        "max_requests": max_requests,
        "warmup_s": warmup_s,
        "stagger_s": CHUNKS * PACE_MS / 1e3 if mode == "paced" and concurrency > 1 else 0.0,
    }
    return spawn_loadgen(python, "tools.bench_router", spec, core)


def spawn_loadgen(
    python: Path, module: str, spec: dict[str, Any], core: int | None = None
) -> dict[str, Any]:
    """Run ``python -m MODULE --loadgen SPEC`` (``loadgen`` in a process of its own, on
    ``core`` if given; ``python`` is another virtualenv's, told where this checkout is)
    and return what it printed."""

    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    out = subprocess.run(
        [str(python), "-m", module, "--loadgen", json.dumps(spec)],
        env=dict(os.environ, **python_path()),
        capture_output=True,
        preexec_fn=pin,
        timeout=spec["seconds"] + spec["warmup_s"] + 60,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr.decode(errors='replace')}")
    return dict(json.loads(out.stdout))


def fmt_ms(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1e3:.2f}"


def print_table(mode: str, rows: list[tuple[str, int, dict[str, Any]]]) -> None:
    print(f"\n== {MODES[mode]} ==")
    cols = (
        f"{'proxy':10} {'c':>3} {'rps':>8} {'p50 ms':>8} {'p99 ms':>8} {'ttfb50':>8} "
        f"{'cpu ms/req':>10} {'ms/chunk':>8} {'proxy%':>6} {'eng%':>5} {'lg%':>5} {'n':>6} "
        f"{'err':>4}"
    )
    print(cols)
    for name, c, r in rows:
        n = r["n"]
        cpu = r["proxy_cpu_s"]
        per_req = cpu / n if cpu is not None and n else None
        per_chunk = per_req / CHUNKS if per_req is not None and mode != "plain" else None
        el = r["elapsed"] or 1.0
        busy = f"{100 * cpu / el:.0f}" if cpu is not None else "-"
        print(
            f"{name:10} {c:>3} {r['rps']:>8.0f} {fmt_ms(r['p50']):>8} {fmt_ms(r['p99']):>8} "
            f"{fmt_ms(r['ttfb50']):>8} {fmt_ms(per_req):>10} {fmt_ms(per_chunk):>8} "
            f"{busy:>6} {100 * r['engine_cpu_s'] / el:>5.0f} {100 * r['loadgen_cpu_s'] / el:>5.0f} "
            f"{n:>6} {r['errors']:>4}",
            flush=True,
        )


def goals(results: dict[tuple[str, str, int], dict[str, Any]], idle: dict[str, float]) -> None:
    def get(proxy: str, mode: str, c: int) -> dict[str, Any] | None:
        return results.get((proxy, mode, c))

    def cpu_ms(r: dict[str, Any] | None) -> float | None:
        if r is None or not r["n"] or r["proxy_cpu_s"] is None:
            return None
        return 1e3 * float(r["proxy_cpu_s"]) / int(r["n"])

    def net(r: dict[str, Any] | None, per: int = 1) -> str:
        """The same, less the proxy's idle background CPU over the window."""
        if r is None or not r["n"] or r["proxy_cpu_s"] is None:
            return ""
        v = 1e3 * (r["proxy_cpu_s"] - idle.get("llmgw", 0.0) * r["elapsed"]) / r["n"] / per
        return f"; {v:.3f} ms net of idle"

    def line(ok: bool | None, text: str) -> None:
        mark = "n/a    " if ok is None else ("met    " if ok else "NOT met")
        print(f"  [{mark}] {text}")

    print("\n== goals (llmgw, from this run) ==")
    concs = sorted({c for (_, _, c) in results})
    ref_c = 16 if 16 in concs else concs[-1]
    top_c = 64 if 64 in concs else concs[-1]
    # 1. throughput vs LiteLLM, where the proxies are CPU-bound (paced rps is set by the pace)
    for mode in ("plain", "stream"):
        for c in sorted({ref_c, top_c}):
            g, lt = get("llmgw", mode, c), get("litellm", mode, c)
            if g and lt and lt["rps"] > 0:
                ratio = g["rps"] / lt["rps"]
                line(
                    ratio >= 40,
                    f"throughput >= 40x LiteLLM ({MODES[mode]}, c{c}): {ratio:.1f}x "
                    f"({g['rps']:.0f} vs {lt['rps']:.1f} rps)",
                )
            elif g and lt:
                line(False, f"throughput >= 40x LiteLLM ({MODES[mode]}, c{c}): LiteLLM did 0")
    if get("llmgw", "plain", ref_c) and not get("litellm", "plain", ref_c):
        line(None, "throughput >= 40x LiteLLM: no LiteLLM result in this run")
    # 2. router CPU per request / per chunk
    for c in concs:
        v = cpu_ms(get("llmgw", "plain", c))
        if v is not None:
            line(
                v <= 0.7,
                f"CPU <= 0.7 ms per non-streamed request (c{c}): {v:.3f} ms"
                + net(get("llmgw", "plain", c)),
            )
    for mode in ("stream", "paced"):
        for c in concs:
            v = cpu_ms(get("llmgw", mode, c))
            if v is not None:
                floors = [
                    f"{name} {f / CHUNKS:.3f} ms"
                    for name in ("relay", "relay-trio")
                    if (f := cpu_ms(get(name, mode, c))) is not None
                ]
                above = f"; raw byte relays: {', '.join(floors)}" if floors else ""
                line(
                    v / CHUNKS <= 0.15,
                    f"CPU <= 0.15 ms per streamed chunk ({MODES[mode]}, c{c}): "
                    f"{v / CHUNKS:.3f} ms ({v:.2f} ms / {CHUNKS}-chunk response"
                    + net(get("llmgw", mode, c), CHUNKS)
                    + above
                    + ")",
                )
    # 3. added p50 at c1
    g, d = get("llmgw", "plain", 1), get("direct", "plain", 1)
    if g and d:
        added = (g["p50"] - d["p50"]) * 1e3
        line(added < 0.8, f"added p50 latency < 0.8 ms at c1 (non-streaming): {added:.3f} ms")
    # 4. paced streaming throughput and TTFB
    for c in concs:
        g, d = get("llmgw", "paced", c), get("direct", "paced", c)
        if g and d and d["rps"] > 0:
            share = g["rps"] / d["rps"]
            added = (g["ttfb50"] - d["ttfb50"]) * 1e3
            line(
                share >= 0.9 and added < 20,
                f"paced streaming >= 90% of direct rps and < 20 ms added TTFB (c{c}): "
                f"{100 * share:.1f}%, +{added:.2f} ms TTFB p50",
            )
    # 5. tail at the top concurrency
    for mode in MODES:
        g = get("llmgw", mode, top_c)
        if g and g["p50"] > 0:
            ratio = g["p99"] / g["p50"]
            line(
                ratio <= 2,
                f"p99 within 2x of p50 at c{top_c} ({MODES[mode]}): {ratio:.2f}x "
                f"(p50 {fmt_ms(g['p50'])}, p99 {fmt_ms(g['p99'])} ms)",
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loadgen", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="~1 s a cell instead of ~3 s")
    ap.add_argument("--seconds", type=float, help="measured window per cell")
    ap.add_argument("--requests", type=int, help="max requests per cell (LiteLLM: a tenth)")
    ap.add_argument("-c", "--concurrency", type=int, action="append", help="default 1, 16, 64")
    ap.add_argument("--only", action="append", choices=list(MODES), help="modes to run")
    ap.add_argument("--proxies", default=",".join(PROXIES), help="comma-separated subset")
    ap.add_argument("--no-litellm", action="store_true", help="skip LiteLLM")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; the median is kept")
    ap.add_argument("--json", type=Path, help="also write every cell's numbers here")
    args = ap.parse_args()
    if args.loadgen:
        print(json.dumps(loadgen(json.loads(args.loadgen))))
        return

    seconds = args.seconds or (1.0 if args.quick else 3.0)
    warmup = 0.3 if args.quick else 0.5
    max_requests = args.requests or (10000 if args.quick else 50000)
    concs = args.concurrency or [1, 16, 64]
    modes = args.only or list(MODES)
    proxies = [p for p in args.proxies.split(",") if p in PROXIES]
    if args.no_litellm and "litellm" in proxies:
        proxies.remove("litellm")

    allowed = sorted(os.sched_getaffinity(0))
    load_core: int | None
    proxy_core: int | None
    if len(allowed) >= 2:
        load_core, proxy_core = allowed[0], allowed[1]
    else:
        load_core = proxy_core = None
    (ROOT / ".llmgw").mkdir(exist_ok=True)
    install_log = ROOT / ".llmgw" / "bench-install.log"
    asgi_python = venv_python(VENV_ASGI, ASGI_PACKAGES, install_log)

    litellm_note = ""
    litellm_version = ""
    if "litellm" in proxies:
        try:
            venv_python(VENV_LITELLM, [LITELLM_PACKAGE], install_log)
            litellm_version = subprocess.run(
                [
                    str(VENV_LITELLM / "bin" / "python"),
                    "-c",
                    "import importlib.metadata as m; print(m.version('litellm'))",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (subprocess.CalledProcessError, OSError) as exc:
            litellm_note = f"LiteLLM not installed ({exc}); see {install_log}"
            proxies.remove("litellm")

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        procs = Procs(Path(tmp))
        try:
            if load_core is not None:
                os.sched_setaffinity(0, {load_core})
            engine_pid, engine_port = start_engine(procs, asgi_python, load_core)
            lite: tuple[int, int] | None = None
            if "litellm" in proxies:  # slow to start: start it first, wait for it last
                lite_key = "sk-" + secrets.token_hex(24)  # it refuses to start with none
                lite = start_litellm(procs, VENV_LITELLM, engine_port, proxy_core, lite_key)
            targets: dict[str, tuple[int, str, list[int]]] = {}
            targets["direct"] = (engine_port, "", [])
            if "relay" in proxies:
                pid, port = start_relay(procs, asgi_python, engine_port, proxy_core)
                targets["relay"] = (port, "", [pid])
            if "relay-trio" in proxies:
                pid, port = start_relay(
                    procs, Path(sys.executable), engine_port, proxy_core, "trio"
                )
                targets["relay-trio"] = (port, "", [pid])
            if "llmgw" in proxies:
                pid, port, key = start_llmgw(procs, engine_port, proxy_core)
                targets["llmgw"] = (port, key, [pid])
            if "asgi" in proxies:
                pid, port = start_asgi(procs, asgi_python, engine_port, proxy_core)
                targets["asgi"] = (port, "", [pid])
            if lite is not None:
                lite_pid, port = lite
                try:
                    procs.wait_until(
                        "litellm",
                        lambda: http_get(f"http://127.0.0.1:{port}/health/liveliness") == 200,
                        180,
                    )
                    http_post(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                        lite_key,
                    )
                    targets["litellm"] = (port, lite_key, [lite_pid])
                except (RuntimeError, OSError) as exc:
                    tail = procs.log("litellm")[-3000:]
                    litellm_note = f"LiteLLM did not start: {exc}\n{tail}"
                    procs.stop("litellm")
            idle_s = 1.0 if args.quick else 2.0
            cpu0 = {n: sum(map(tree_cpu, t[2])) for n, t in targets.items() if t[2]}
            time.sleep(idle_s)
            idle = {n: (sum(map(tree_cpu, targets[n][2])) - cpu0[n]) / idle_s for n in cpu0}
            print(
                f"# cores: engine+load generator on {load_core}, each proxy on {proxy_core}; "
                f"window {seconds:g} s, paced {max(2.0, 1.5 * seconds):g} s, LiteLLM "
                f"{2 * seconds + 1:g} s (at most {max_requests} requests, LiteLLM "
                f"{max_requests // 10}), warm-up {warmup:g} s (LiteLLM 1 s); CPU from /proc "
                "the scheduler's nanosecond account (schedstat); "
                f"{args.repeat} run(s) a cell, the median kept"
            )
            print(f"# LiteLLM {litellm_version or '-'}  {litellm_note}".rstrip())
            print(
                "# idle CPU of each proxy (background work, in every cell's CPU): "
                + ", ".join(f"{n} {1e3 * v:.1f} ms/s" for n, v in idle.items())
            )
            for mode in modes:
                pace = PACE_MS if mode == "paced" else 0
                req = urllib.request.Request(
                    f"http://127.0.0.1:{engine_port}/_bench/pace?ms={pace}", method="POST"
                )
                urllib.request.urlopen(req, timeout=5).read()
                rows = []
                # a paced response takes ~160 ms: a longer window, so each cell sees many
                window = max(2.0, 1.5 * seconds) if mode == "paced" else seconds
                for name in [p for p in PROXIES if p in targets]:
                    port, key, pids = targets[name]
                    for c in concs:
                        runs = [
                            run_cell(
                                asgi_python,
                                load_core,
                                port=port,
                                key=key,
                                pids=pids,
                                engine_pid=engine_pid,
                                mode=mode,
                                concurrency=c,
                                # LiteLLM is ~100x slower: longer windows, or c64 finishes nothing
                                seconds=max(window, 2 * seconds + 1)
                                if name == "litellm"
                                else window,
                                max_requests=max_requests // 10
                                if name == "litellm"
                                else max_requests,
                                warmup_s=1.0
                                if name == "litellm"
                                else max(warmup, 0.5)
                                if mode == "paced"
                                else warmup,
                            )
                            for _ in range(args.repeat)
                        ]
                        runs.sort(key=lambda r: r["rps"])
                        r = runs[len(runs) // 2]  # the median run by rps
                        results[(name, mode, c)] = r
                        rows.append((name, c, r))
                print_table(mode, rows)
            goals(results, idle)
            if args.json:
                args.json.write_text(
                    json.dumps(
                        {
                            "litellm_version": litellm_version,
                            "cells": [
                                {"proxy": p, "mode": m, "concurrency": c, **r}
                                for (p, m, c), r in results.items()
                            ],
                        },
                        indent=1,
                    )
                )
        finally:
            procs.stop_all()


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()

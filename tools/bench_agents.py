"""How much does one control plane pay to hold a fleet of agents?

Starts ONE real ``llmgw server`` process (config written to a temporary
folder, ports read from its log), then connects N simulated agents to it from
``--workers`` separate processes. Every simulated agent speaks the real
protocol over the real transport: its own client certificate from the project
CA (CN = node id), TLS, WebSocket upgrade with ``llmgw.agent.v1``, Register,
RegisterAck, then a Heartbeat every interval (the interval the RegisterAck
names) followed by a WebSocket ping, as ``llmgw agent`` does. Connects are
spread over ``--connect-spread`` seconds and heartbeat phases are randomised,
as in a fleet that has been up for a while.

For each N it reports:

1. server CPU per second of wall time over a steady window once the whole
   fleet has registered (``/proc/<pid>/stat`` utime + stime; % of one core),
   and the agent processes' CPU over the same window (they share the cores);
2. server memory (VmRSS before the agents and at steady state; per agent);
3. heartbeat delay, sent -> processed, from the server's
   ``llmgw_heartbeat_delay_seconds`` histogram (bucket deltas over the window:
   bucket resolution), and client-side the round trip of heartbeat + ping;
4. how late a silent agent is marked Unreachable: one agent stops
   heartbeating (connection kept open); ``/v1/nodes`` is polled every ~50 ms
   until it says Unreachable; lateness = that moment - (last heartbeat sent +
   ``unreachable_after``);
5. registration time of the whole fleet: from the first connect until all N
   are Ready (the ``llmgw_nodes{state="Ready"}`` gauge polled every 100 ms,
   which is far cheaper for the server than ``/v1/nodes``; then confirmed
   node by node in ``/v1/nodes``), and agent-side until the last RegisterAck;
6. what one ``GET /v1/nodes`` costs the server at that fleet size.

``--quick`` is a smoke run: 50 agents, heartbeat 0.5 s, window 5 s,
unreachable after 2 s. ``--py-spy`` profiles the server in each phase (and so
skews the CPU figures); ``--no-ping`` stops the agents' per-heartbeat ping to
show what it costs the server.

Other tools drive these workers too (``WorkerProc``, ``Fleet``): a worker spec with
``"shards": true`` makes its agents obey the control plane, as ``llmgw agent`` does
without an engine: ShardStatus ``starting`` then ``ready`` (after ``ready_after_s``)
for each StartShard, ``stopped`` for each StopShard (``draining`` first for a
DrainShard), over the same session; with ``"weights": {node: [[model, path], ...]}``
a node reports those weights (found in its ``weights_dirs``). Neither is used here.

Certificates are issued once into ``.llmgw/bench-pki/`` and reused.
Everything runs on 127.0.0.1; every wait is bounded; every process started
here is stopped on exit, Ctrl-C included.

    python -m tools.bench_agents [--agents 100,1000] [--heartbeat 5] [--window 30]
        [--unreachable-after 15] [--workers 2] [--connect-spread 2] [--quick]
        [--keep-logs] [--py-spy] [--no-ping]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import queue
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import wrap_client_stream

from llmgw.protocol import SUBPROTOCOL, CloseCode, Role, Session
from llmgw.protocol.messages import (
    DrainShard,
    Engine,
    Gpu,
    Heartbeat,
    Inventory,
    Memory,
    Register,
    RegisterAck,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
    WeightCopy,
)
from llmgw.tls import client_context, init_ca, issue_agent, issue_server, load_ca
from llmgw.wsio import close_quietly, close_ws
from tools.support.benchlib import cpu_seconds, percentile
from tools.support.procs import ROOT, Failed, Proc, interrupt_on_sigterm, llmgw

PKI_DIR = ROOT / ".llmgw" / "bench-pki"
HOST = "127.0.0.1"
GOAL_AGENTS = 1000
GOAL_CPU_PCT = 25.0
NODE_PREFIX = "bench-"


def node_name(i: int) -> str:
    return f"{NODE_PREFIX}{i:05d}"


def raise_nofile(want: int = 65536) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# =========================================================================== worker
# A worker process runs one trio loop with its share of the simulated agents.
# It talks to the orchestrator with JSON lines: commands on stdin, events on
# stdout. Stdin closing (the orchestrator died) ends it.


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


@dataclass(eq=False)
class SimAgent:
    node_id: str
    index: int  # position in the whole fleet (sets its connect time)
    ctx: Any  # ssl.SSLContext
    start_at: float = 0.0  # trio clock
    registered_after: float | None = None  # first registration, s after start_at
    connected: bool = False
    silent: bool = False
    seq: int = 0
    last_sent: float = 0.0  # wall clock of the last heartbeat sent
    sessions: int = 0
    running: dict[str, int] = field(default_factory=dict)  # shard id -> its made-up pid


@dataclass
class WorkerStats:
    heartbeats: int = 0
    rtts: list[float] = field(default_factory=list)  # heartbeat send -> pong, s
    lags: list[float] = field(default_factory=list)  # heartbeat timer lateness, s
    errors: Counter[str] = field(default_factory=Counter)
    reconnects: int = 0


def _inventory(
    node_id: str, weights: list[list[str]] | None = None, dirs: list[str] | None = None
) -> Inventory:
    """What a simulated node reports: 8 H100s, llama.cpp, and (only when given) the
    weights its discovery found, as ``[model, path]`` pairs, in ``dirs``."""
    found: dict[str, Any] = {}
    if weights is not None:
        found = {
            "weights": [
                WeightCopy(model=m, path=p, format="gguf", size_bytes=4 * 2**30, storage="local")
                for m, p in weights
            ],
            "weights_scanned": True,
            "weights_dirs": list(dirs or []),
        }
    return Inventory(
        hostname=node_id,
        address=HOST,
        cpus=64,
        memory=Memory(total_bytes=512 * 2**30, available_bytes=480 * 2**30),
        gpus=[
            Gpu(
                index=g,
                uuid=f"GPU-{node_id}-{g}",
                name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"00000000:{0x18 + g:02X}:00.0",
                memory_total_mib=81559,
                memory_used_mib=0,
                memory_free_mib=81559,
                utilization_pct=0,
                temperature_c=30,
                driver_version="550.54.15",
                compute_capability="9.0",
            )
            for g in range(8)
        ],
        engines=[Engine(name="llama.cpp", version="b4000", path="/usr/local/bin/llama-server")],
        labels={"bench": "1"},
        **found,
    )


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.port: int = spec["port"]
        self.total: int = spec["total"]
        self.ping: bool = spec["ping"]
        # opt-in (other tools): obey StartShard/StopShard; report weights
        self.shards: bool = spec.get("shards", False)
        self.ready_after: float = spec.get("ready_after_s", 0.05)
        self.weights: dict[str, list[list[str]]] | None = spec.get("weights")
        self.weights_dirs: list[str] = spec.get("weights_dirs", [])
        self.starts = 0
        self.stops = 0
        pki = Path(spec["pki"])
        self.agents: list[SimAgent] = []
        for i in spec["indices"]:
            node = node_name(i)
            ctx = client_context(pki / "ca.pem", pki / f"{node}.pem", pki / f"{node}-key.pem")
            self.agents.append(SimAgent(node_id=node, index=i, ctx=ctx))
        self.by_node = {a.node_id: a for a in self.agents}
        self.stats = WorkerStats()
        self.registered = 0
        self.all_registered: Any = None  # a trio.Event, once the loop runs

    async def main(self) -> None:
        emit({"ev": "ready", "pid": os.getpid(), "agents": len(self.agents)})
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async with trio.open_nursery() as nursery:
            buf = b""
            while True:
                data = await stdin.receive_some(65536)
                if not data:
                    break
                buf += data
                quit_ = False
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip() and not self.command(json.loads(line), nursery):
                        quit_ = True
                if quit_:
                    break
            nursery.cancel_scope.cancel()

    def command(self, cmd: dict[str, Any], nursery: Any) -> bool:
        kind = cmd["cmd"]
        if kind == "go":
            # t0 is wall clock; agent i starts at t0 + i/total * spread
            base = trio.current_time() + (cmd["t0"] - time.time())
            self.all_registered = trio.Event()
            for a in self.agents:
                a.start_at = base + a.index / self.total * cmd["spread"]
                nursery.start_soon(self.run_agent, a)
            nursery.start_soon(self.watch_registration)
        elif kind == "stats":
            s = self.stats
            emit(
                {
                    "ev": "stats",
                    "heartbeats": s.heartbeats,
                    "rtts": s.rtts,
                    "lags": s.lags,
                    "errors": dict(s.errors),
                    "reconnects": s.reconnects,
                    "connected": sum(a.connected for a in self.agents),
                    **(
                        {
                            "starts": self.starts,
                            "stops": self.stops,
                            "running": sum(len(a.running) for a in self.agents),
                        }
                        if self.shards
                        else {}
                    ),
                }
            )
            self.stats = WorkerStats(errors=s.errors, reconnects=s.reconnects)
        elif kind == "silence":
            a = self.by_node[cmd["node"]]
            a.silent = True  # read under no await: no heartbeat can slip in between
            emit({"ev": "silenced", "node": a.node_id, "last_sent": a.last_sent, "seq": a.seq})
        elif kind == "quit":
            return False
        return True

    async def watch_registration(self) -> None:
        await self.all_registered.wait()
        lat = sorted(a.registered_after or 0.0 for a in self.agents)
        emit({"ev": "registered", "at": time.time(), "latencies": lat})

    async def run_agent(self, a: SimAgent) -> None:
        await trio.sleep_until(a.start_at)
        attempt = 0
        while True:
            try:
                await self.session(a)
                reason = "session ended"
            except Exception as exc:
                reason = _describe(exc)
            a.connected = False
            self.stats.errors[reason] += 1
            self.stats.reconnects += 1
            attempt += 1
            await trio.sleep(random.uniform(0, min(5.0, 0.5 * 2**attempt)))

    async def session(self, a: SimAgent) -> None:
        a.sessions += 1
        with trio.fail_after(10):
            tcp = await trio.open_tcp_stream(HOST, self.port)
        tls = trio.SSLStream(tcp, a.ctx, server_hostname=HOST)
        try:
            with trio.fail_after(10):
                await tls.do_handshake()
            async with trio.open_nursery() as nursery:
                with trio.fail_after(10):
                    ws = await wrap_client_stream(
                        nursery, tls, HOST, "/agent", subprotocols=[SUBPROTOCOL]
                    )
                try:
                    session = Session(Role.AGENT)
                    weights = None if self.weights is None else self.weights.get(a.node_id, [])
                    inventory = _inventory(a.node_id, weights, self.weights_dirs)
                    a.running.clear()  # a new session: the control plane hears of none
                    register = Register(
                        node_id=a.node_id, inventory=inventory, agent_version="bench"
                    )
                    await ws.send_message(session.send(register))
                    with trio.fail_after(10):
                        ack = session.receive(await ws.get_message())
                    assert isinstance(ack, RegisterAck)
                    a.connected = True
                    if a.registered_after is None:
                        a.registered_after = trio.current_time() - a.start_at
                        self.registered += 1
                        if self.registered == len(self.agents) and self.all_registered is not None:
                            self.all_registered.set()
                    if self.shards:
                        nursery.start_soon(self.obey, a, ws, session, nursery)
                    await self.heartbeats(a, ws, session, ack.heartbeat_interval_s)
                finally:
                    await close_ws(ws, CloseCode.GOING_AWAY, "bench agent stopping")
                nursery.cancel_scope.cancel()
        finally:
            await close_quietly(tls)

    async def obey(self, a: SimAgent, ws: Any, session: Any, nursery: Any) -> None:
        """The control plane's commands, answered as ``llmgw agent`` answers them when
        every engine starts at once: ``starting``, then ``ready`` a moment later; a stop
        (or drain) is over at once. A silenced agent answers nothing."""
        while True:
            msg = session.receive(await ws.get_message())
            if a.silent:
                continue
            if isinstance(msg, StartShard):
                sid = msg.spec.shard_id
                pid = a.running[sid] = 100000 + random.randrange(800000)
                self.starts += 1
                nursery.start_soon(self.start_shard, a, ws, session, sid, pid)
            elif isinstance(msg, (StopShard, DrainShard)):
                sid = msg.shard_id
                if sid in a.running and isinstance(msg, DrainShard):
                    status = ShardStatus(shard_id=sid, state=ShardState.DRAINING)
                    await ws.send_message(session.send(status))
                a.running.pop(sid, None)
                self.stops += 1
                status = ShardStatus(shard_id=sid, state=ShardState.STOPPED, detail="stopped")
                await ws.send_message(session.send(status))

    async def start_shard(self, a: SimAgent, ws: Any, session: Any, sid: str, pid: int) -> None:
        starting = ShardStatus(shard_id=sid, state=ShardState.STARTING, pid=pid)
        await ws.send_message(session.send(starting))
        await trio.sleep(self.ready_after)
        if a.running.get(sid) != pid or a.silent:
            return  # stopped meanwhile
        ready = ShardStatus(shard_id=sid, state=ShardState.READY, pid=pid, engine_key=f"key-{sid}")
        await ws.send_message(session.send(ready))

    async def heartbeats(self, a: SimAgent, ws: Any, session: Any, interval: float) -> None:
        due = trio.current_time() + random.uniform(0, interval)  # a random phase
        while True:
            await trio.sleep_until(due)
            self.stats.lags.append(trio.current_time() - due)
            due += interval
            if a.silent:
                await trio.sleep_forever()  # silent, but the connection stays open
            a.seq += 1
            sent = time.time()
            a.last_sent = sent
            memory = Memory(
                total_bytes=512 * 2**30, available_bytes=480 * 2**30 - random.randrange(2**30)
            )
            t = trio.current_time()
            await ws.send_message(session.send(Heartbeat(seq=a.seq, sent_at=sent, memory=memory)))
            if self.ping:
                with trio.fail_after(max(interval, 1.0) * 3):
                    await ws.ping()
            self.stats.rtts.append(trio.current_time() - t)
            self.stats.heartbeats += 1


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = str(exc)
    reason = getattr(exc, "reason", None)  # ConnectionClosed carries a CloseReason
    if reason is not None and not isinstance(reason, str):
        text = f"{getattr(reason, 'code', '')} {getattr(reason, 'reason', '')}"
    return f"{type(exc).__name__}: {text}"[:160]


def worker_main() -> int:
    raise_nofile()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator stops us
    line = b""
    while not line.endswith(b"\n"):  # unbuffered: the rest of stdin is read by trio
        byte = os.read(sys.stdin.fileno(), 1)
        if not byte:
            return 1
        line += byte
    spec = json.loads(line)
    trio.run(Worker(spec).main)
    return 0


# =========================================================================== orchestrator


def ensure_pki(n: int) -> Path:
    """CA, server certificate and agent certificates 0..n-1, issued once and reused."""

    d = PKI_DIR
    if not (d / "ca.pem").exists():
        init_ca(d, name="llmgw bench CA")
    ca = load_ca(d)
    if not (d / "server.pem").exists():
        issue_server(ca, [HOST, "localhost"], d)
    missing = [i for i in range(n) if not (d / f"{node_name(i)}-key.pem").exists()]
    if missing:
        t = time.monotonic()
        for i in missing:
            issue_agent(ca, node_name(i), d)
        print(f"  issued {len(missing)} agent certificates in {time.monotonic() - t:.1f} s")
    return d


def _pdeathsig() -> None:
    """In the child: die with the orchestrator, even if it is SIGKILLed."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def proc_mem(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class WorkerProc:
    """One process of simulated agents: its commands on its stdin, its events on its
    stdout, its stderr in ``workdir/worker-IDX.log``."""

    def __init__(self, idx: int, workdir: Path) -> None:
        self.idx = idx
        argv = [sys.executable, "-m", "tools.bench_agents", "--worker"]
        self.proc = Proc(f"worker-{idx}", argv, workdir, session=True, preexec=_pdeathsig,
                         output="pipes", fresh=True).start()  # fmt: skip
        self.pid = self.proc.pid

    def send(self, obj: dict[str, Any]) -> None:
        stdin = self.proc.popen.stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps(obj) + "\n").encode())
            stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise Failed(f"agent worker {self.idx} is gone: {self.stderr()}") from exc

    def stderr(self) -> str:
        return self.proc.tail()

    def stop(self) -> None:
        if self.proc.running():
            with contextlib.suppress(Failed):
                self.send({"cmd": "quit"})
        self.proc.stop()  # its stdin closed: it quits; SIGTERM, SIGKILL if it does not


class Fleet:
    """The worker processes and their event lines."""

    def __init__(self, workers: list[WorkerProc]) -> None:
        self.workers = workers
        self.events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        for w in workers:  # threads only after every fork: no preexec_fn under threads
            threading.Thread(target=self._read, args=(w,), daemon=True).start()

    def _read(self, w: WorkerProc) -> None:
        stdout = w.proc.popen.stdout
        assert stdout is not None
        for line in stdout:
            with contextlib.suppress(ValueError):
                self.events.put((w.idx, json.loads(line)))
        self.events.put((w.idx, None))

    def send_all(self, obj: dict[str, Any]) -> None:
        for w in self.workers:
            w.send(obj)

    def gather(self, ev: str, timeout: float, count: int | None = None) -> list[dict[str, Any]]:
        """Wait for ``count`` (default: one per worker) events of kind ``ev``."""
        want = len(self.workers) if count is None else count
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed(f"timed out waiting for {want} {ev!r} events from the agent workers")
            try:
                idx, obj = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if obj is None:
                raise Failed(f"agent worker {idx} exited early:\n{self.workers[idx].stderr()}")
            if obj.get("ev") == ev:
                got.append(obj)
        return got

    def stop(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.send({"cmd": "quit"})
        for w in self.workers:
            w.stop()


class Admin:
    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=10.0
        )

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """name -> {sorted label items -> value}, for every sample."""

        r = self.client.get("/metrics")
        r.raise_for_status()
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def nodes(self) -> dict[str, dict[str, Any]]:
        r = self.client.get("/v1/nodes")
        r.raise_for_status()
        return {n["node_id"]: n for n in r.json()["nodes"]}

    def close(self) -> None:
        self.client.close()


def ready_count(m: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> int:
    return int(m.get("llmgw_nodes", {}).get((("state", "Ready"),), 0))


def histogram(
    m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str
) -> list[tuple[float, float]]:
    """[(le, cumulative count)], sorted by le (+Inf last)."""
    rows = [
        (float(dict(k)["le"]), v) for k, v in m.get(f"{name}_bucket", {}).items() if "le" in dict(k)
    ]
    return sorted(rows)


def bucket_quantile(delta: list[tuple[float, float]], q: float) -> tuple[float, float] | None:
    """Prometheus-style quantile of a cumulative histogram: (interpolated, bucket bound)."""
    if not delta or delta[-1][1] <= 0:
        return None
    total = delta[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in delta:
        if c >= rank:
            if math.isinf(le):
                return prev_le, le  # above the largest finite bucket
            frac = (rank - prev_c) / (c - prev_c) if c > prev_c else 1.0
            return prev_le + (le - prev_le) * frac, le
        prev_le, prev_c = le, c
    return None


def counter_total(
    m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str
) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in m.get(name, {}).items():
        out[",".join(f"{a}={b}" for a, b in k) or "-"] = v
    return out


def write_config(
    workdir: Path, pki: Path, hb: float, unreachable: float, lost: float, *, more: str = ""
) -> Path:
    """The server's config; ``more``: top-level keys first (a catalog), then sections."""
    top, _, sections = more.partition("[")
    cfg = workdir / "server.toml"
    cfg.write_text(
        f"""state_dir = "state"
{top}log_level = "info"
[agent_stream]
listen = "{HOST}:0"
ca = "{pki / "ca.pem"}"
cert = "{pki / "server.pem"}"
key = "{pki / "server-key.pem"}"
[liveness]
heartbeat_interval_s = {hb}
unreachable_after_s = {unreachable}
lost_after_s = {lost}
[admin]
listen = "{HOST}:0"
"""
        + (f"[{sections}" if sections else "")
    )
    return cfg


@dataclass
class Params:
    heartbeat: float
    window: float
    unreachable: float
    lost: float
    workers: int
    spread: float
    keep_logs: bool
    py_spy: bool
    ping: bool


def run_case(n: int, p: Params, pki: Path) -> dict[str, Any]:
    print(f"\n=== {n} agents, heartbeat {p.heartbeat:g} s, {p.workers} agent processes ===")
    workdir = Path(tempfile.mkdtemp(prefix=f"llmgw-bench-{n}-"))
    profiles: dict[str, dict[str, Any]] = {}
    res: dict[str, Any] = {"n": n, "workdir": str(workdir), "py_spy": profiles}
    server: Proc | None = None
    fleet: Fleet | None = None
    admin: Admin | None = None
    try:
        cfg = write_config(workdir, pki, p.heartbeat, p.unreachable, p.lost)
        argv = llmgw("server", "--config", str(cfg))
        server = Proc("server", argv, workdir, session=True, preexec=_pdeathsig, grace_s=10)
        server.start()
        m = server.wait_log(r"agent stream listening on 127\.0\.0\.1:(\d+)", timeout=30)
        port = int(m.group(1))
        url = server.wait_log(r"admin API listening on (http://\S+)", timeout=30).group(1)
        token = (workdir / "state" / "admin-token").read_text().strip()
        admin = Admin(url, token)

        nworkers = max(1, min(p.workers, n))
        procs = [WorkerProc(i, workdir) for i in range(nworkers)]
        fleet = Fleet(procs)
        for w in procs:
            w.send(
                {
                    "port": port,
                    "total": n,
                    "ping": p.ping,
                    "pki": str(pki),
                    "indices": list(range(w.idx, n, nworkers)),
                }
            )
        fleet.gather("ready", timeout=60 + n * 0.05)
        time.sleep(1.0)
        server.check_running()
        res["rss_before"] = proc_mem(server.pid)["VmRSS"]

        # ---- registration
        print(f"  connecting {n} agents over {p.spread:g} s ...")
        spy = Spy(server.pid, workdir / f"py-spy-{n}-register.txt") if p.py_spy else None
        cpu0 = cpu_seconds(server.pid)
        ccpu0 = sum(cpu_seconds(w.pid) for w in procs)
        t0 = time.time() + 0.2
        fleet.send_all({"cmd": "go", "t0": t0, "spread": p.spread})
        deadline = time.monotonic() + p.spread + 60 + n * 0.05
        while True:
            server.check_running()
            ready = ready_count(admin.metrics())
            if ready >= n:
                break
            if time.monotonic() > deadline:
                raise Failed(f"only {ready} of {n} agents Ready after {time.time() - t0:.0f} s")
            time.sleep(0.1)
        res["register_s"] = time.time() - t0
        res["register_cpu_s"] = cpu_seconds(server.pid) - cpu0
        res["register_client_cpu_s"] = sum(cpu_seconds(w.pid) for w in procs) - ccpu0
        if spy is not None:
            profiles["registration"] = spy.finish()
        nodes = admin.nodes()
        not_ready = [
            x for x in (node_name(i) for i in range(n)) if nodes.get(x, {}).get("state") != "Ready"
        ]
        if not_ready:
            raise Failed(f"/v1/nodes: {len(not_ready)} nodes not Ready, e.g. {not_ready[:3]}")
        regs = fleet.gather("registered", timeout=30)
        res["register_client_s"] = max(r["at"] for r in regs) - t0
        lat = sorted(x for r in regs for x in r["latencies"])
        res["register_lat"] = (percentile(lat, 0.5), percentile(lat, 0.99), lat[-1])
        print(
            f"  all {n} Ready in {res['register_s']:.2f} s (connects spread over {p.spread:g} s); "
            f"server CPU during registration {res['register_cpu_s']:.2f} s"
        )

        # ---- steady state
        settle = p.heartbeat + 1.0
        print(f"  settling {settle:g} s, then a {p.window:g} s steady window ...")
        time.sleep(settle)
        server.check_running()
        fleet.send_all({"cmd": "stats"})
        fleet.gather("stats", timeout=10)
        spy = Spy(server.pid, workdir / f"py-spy-{n}-steady.txt") if p.py_spy else None
        m0 = admin.metrics()
        w0 = time.monotonic()
        s0 = cpu_seconds(server.pid)
        c0 = sum(cpu_seconds(w.pid) for w in procs)
        per_sec: list[float] = []
        last_t, last_c = w0, s0
        while time.monotonic() - w0 < p.window:
            time.sleep(min(1.0, max(0.0, p.window - (time.monotonic() - w0))))
            server.check_running()
            t, c = time.monotonic(), cpu_seconds(server.pid)
            if t - last_t > 0.5:
                per_sec.append((c - last_c) / (t - last_t))
            last_t, last_c = t, c
        elapsed = time.monotonic() - w0
        s1 = cpu_seconds(server.pid)
        c1 = sum(cpu_seconds(w.pid) for w in procs)
        m1 = admin.metrics()
        mem = proc_mem(server.pid)
        fleet.send_all({"cmd": "stats"})
        stats = fleet.gather("stats", timeout=10)
        if spy is not None:
            profiles["steady"] = spy.finish()
        res["window_s"] = elapsed
        res["cpu_pct"] = 100 * (s1 - s0) / elapsed
        res["cpu_max_1s_pct"] = 100 * max(per_sec) if per_sec else None
        res["client_cpu_pct"] = 100 * (c1 - c0) / elapsed
        res["rss_steady"] = mem["VmRSS"]
        res["rss_peak"] = mem["VmHWM"]
        res["rss_per_agent"] = (res["rss_steady"] - res["rss_before"]) / n
        h0 = dict(histogram(m0, "llmgw_heartbeat_delay_seconds"))
        h1 = histogram(m1, "llmgw_heartbeat_delay_seconds")
        delta = [(le, c - h0.get(le, 0.0)) for le, c in h1]
        res["hb_processed"] = delta[-1][1] if delta else 0
        res["hb_expected"] = n * elapsed / p.heartbeat
        res["hb_p50"] = bucket_quantile(delta, 0.5)
        res["hb_p99"] = bucket_quantile(delta, 0.99)
        rtts = [x for s in stats for x in s["rtts"]]
        lags = [x for s in stats for x in s["lags"]]
        res["rtt"] = (percentile(rtts, 0.5), percentile(rtts, 0.99))
        res["client_lag_p99"] = percentile(lags, 0.99)
        res["connected"] = sum(s["connected"] for s in stats)
        res["reconnects"] = sum(s["reconnects"] for s in stats)
        errors: Counter[str] = Counter()
        for s in stats:
            errors.update(s["errors"])
        res["client_errors"] = dict(errors)
        print(
            f"  server CPU {res['cpu_pct']:.1f}% of a core, agents' CPU {res['client_cpu_pct']:.1f}%;"
            f" RSS {mb(res['rss_before'])} -> {mb(res['rss_steady'])}"
        )

        # ---- a silent agent
        res.update(silent_agent(n, p, fleet, admin, server, workdir, profiles))

        # ---- what one /v1/nodes costs the server at this fleet size
        cpu0, t, calls = cpu_seconds(server.pid), time.monotonic(), 0
        while time.monotonic() - t < 1.0 and calls < 200:
            admin.nodes()
            calls += 1
        res["nodes_call_cpu_s"] = (cpu_seconds(server.pid) - cpu0) / calls
        res["nodes_call_s"] = (time.monotonic() - t) / calls

        # ---- what the server said
        m2 = admin.metrics()
        res["refusals"] = counter_total(m2, "llmgw_agent_stream_refusals_total")
        res["connects"] = sum(m2.get("llmgw_agent_stream_connects_total", {}).values())
        res["log_problems"] = log_problems(server.log(), res.get("silent_node"))
        return res
    finally:
        if admin is not None:
            admin.close()
        if fleet is not None:
            fleet.stop()
        if server is not None:
            server.stop()
            res["server_exit"] = server.returncode()
        if p.keep_logs:
            print(f"  logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def silent_agent(
    n: int,
    p: Params,
    fleet: Fleet,
    admin: Admin,
    server: Proc,
    workdir: Path,
    profiles: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    node = node_name((n - 1) - ((n - 1) % len(fleet.workers)))  # one of worker 0's
    print(f"  silencing {node}; polling /v1/nodes every 50 ms until it is Unreachable ...")
    fleet.workers[0].send({"cmd": "silence", "node": node})
    ev = fleet.gather("silenced", timeout=10, count=1)[0]
    last_sent = ev["last_sent"]
    due = last_sent + p.unreachable
    # poll from a little before it is due (polling 1,000 nodes costs the server CPU)
    time.sleep(max(0.0, due - 1.0 - time.time()))
    limit = due + max(10.0, p.unreachable)
    spy = Spy(server.pid, workdir / f"py-spy-{n}-poll.txt") if p.py_spy else None
    polls, request_s = 0, []
    prev_sent = time.time()
    while True:
        server.check_running()
        sent = time.time()
        view = admin.nodes().get(node, {})
        got = time.time()
        polls += 1
        request_s.append(got - sent)
        if view.get("state") == "Unreachable":
            break
        if got > limit:
            raise Failed(f"{node} still {view.get('state')} {got - due:.1f} s after it was due")
        prev_sent = sent
        time.sleep(max(0.0, 0.05 - (time.time() - sent)))
    if spy is not None:
        profiles["polling /v1/nodes"] = spy.finish()
    out: dict[str, Any] = {
        "silent_node": node,
        "late_s": got - due,
        "late_lower_s": prev_sent - due,  # it was still Ready at a poll sent then
        "poll_request_s": percentile(request_s, 0.5),
        "polls": polls,
    }
    # the server's own account: the log line's timestamp and "no heartbeat for X s"
    m = re.search(
        rf"^(\S+ \S+) WARNING \S+: node {re.escape(node)} is Unreachable \(was Ready\): "
        r"no heartbeat for ([\d.]+) s",
        server.log(),
        re.M,
    )
    if m:
        stamp = time.mktime(time.strptime(m.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S"))
        logged = stamp + int(m.group(1).split(",")[1]) / 1000
        out["late_log_s"] = logged - due
        out["silent_for_s"] = float(m.group(2))
    print(f"  {node} Unreachable {out['late_s']:.3f} s after it was due ({polls} polls)")
    return out


def log_problems(text: str, silent: str | None) -> list[tuple[int, str]]:
    """WARNING/ERROR lines of the server log, numbers masked, grouped; the expected ones left out."""
    groups: Counter[str] = Counter()
    for line in text.splitlines():
        m = re.match(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) (.*)$", line)
        if not m:
            if line.startswith(("Traceback", "  File")):
                groups["traceback: " + line.strip()[:100]] += 1
            continue
        msg = m.group(2)
        if silent and f"node {silent} is Unreachable" in msg:
            continue
        key = re.sub(r"\d+(\.\d+)?", "#", f"{m.group(1)} {msg}")[:160]
        groups[key] += 1
    return [(c, k) for k, c in groups.most_common(10)]


class Spy:
    """py-spy recording the server (CPU samples only) until ``finish``."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        exe = shutil.which("py-spy")
        self.proc: Proc | None = None
        if exe is None:
            return
        argv = [exe, "record", "--nonblocking", "--format", "raw", "-r", "200"]
        argv += ["-d", "600", "-p", str(pid), "-o", str(out)]
        self.proc = Proc(out.stem, argv, out.parent, session=True, preexec=_pdeathsig).start()
        time.sleep(0.5)  # attached

    def finish(self) -> dict[str, Any]:
        if self.proc is None:
            return {"error": "py-spy not found (pip install py-spy)"}
        self.proc.stop(signal.SIGINT, grace_s=20)  # py-spy writes what it has and exits
        if not self.out.exists():
            return {"error": f"py-spy wrote nothing (exit {self.proc.returncode()})"}
        return summarize_profile(self.out)


def summarize_profile(path: Path) -> dict[str, Any]:
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += c
        own[_short(frames[-1])] += c
        for f in {_short(f) for f in frames} - _ROOT_FRAMES:
            incl[f] += c
    return {
        "path": str(path),
        "samples": total,
        "self": own.most_common(15),
        "incl": incl.most_common(30),
    }


_ROOT_FRAMES = {  # on every stack of the server: say nothing about where the time goes
    "_run_module_as_main (<frozen runpy>)",
    "_run_code (<frozen runpy>)",
    "<module> (llmgw/__main__.py)",
    "main (llmgw/cli/__init__.py)",
    "server (llmgw/cli/__init__.py)",
    "App.__call__ (cyclopts/core.py)",
    "_run_maybe_async_command (cyclopts/_run.py)",
    "run (trio/_core/_run.py)",
    "unrolled_run (trio/_core/_run.py)",
}


def _short(frame: str) -> str:
    m = re.match(r"^(.*) \((.*?):\d+\)$", frame)
    if not m:
        return frame
    fn, path = m.groups()
    for marker in ("site-packages/", "/llmgw/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{fn} ({path})"


# =========================================================================== report


def mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f} MiB"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f} ms"


def bq(x: tuple[float, float] | None) -> str:
    if x is None:
        return "-"
    value, bound = x
    if math.isinf(bound):
        return f"> {value:g} s"
    return f"{value * 1000:.2f} ms (<= {bound * 1000:g})"


def report(results: list[dict[str, Any]], p: Params) -> bool | None:
    rtt = "hb+ping round trip" if p.ping else "hb send time"
    rows: list[tuple[str, list[str]]] = [
        ("server CPU, steady (% of one core)", [f"{r['cpu_pct']:.1f}%" for r in results]),
        (
            "  busiest second of the window",
            [
                "-" if r["cpu_max_1s_pct"] is None else f"{r['cpu_max_1s_pct']:.1f}%"
                for r in results
            ],
        ),
        ("  per agent", [f"{r['cpu_pct'] / r['n']:.4f}%" for r in results]),
        ("agent processes' CPU (same window)", [f"{r['client_cpu_pct']:.1f}%" for r in results]),
        ("server RSS before agents", [mb(r["rss_before"]) for r in results]),
        (
            "server RSS steady (peak)",
            [f"{mb(r['rss_steady'])} ({mb(r['rss_peak'])})" for r in results],
        ),
        ("  per agent", [f"{r['rss_per_agent'] / 1024:.1f} KiB" for r in results]),
        (
            "heartbeats processed / expected",
            [f"{r['hb_processed']:.0f} / {r['hb_expected']:.0f}" for r in results],
        ),
        ("hb sent->processed p50 (server hist.)", [bq(r["hb_p50"]) for r in results]),
        ("hb sent->processed p99 (server hist.)", [bq(r["hb_p99"]) for r in results]),
        (f"{rtt} p50 (client)", [ms(r["rtt"][0]) for r in results]),
        (f"{rtt} p99 (client)", [ms(r["rtt"][1]) for r in results]),
        ("client timer lag p99", [ms(r["client_lag_p99"]) for r in results]),
        (
            f"Unreachable detection late by (after {p.unreachable:g} s)",
            [f"{r['late_s']:.3f} s (> {max(0.0, r['late_lower_s']):.3f})" for r in results],
        ),
        (
            "  same, from the server's log line",
            ["-" if r.get("late_log_s") is None else f"{r['late_log_s']:.3f} s" for r in results],
        ),
        ("GET /v1/nodes, round trip", [ms(r["nodes_call_s"]) for r in results]),
        ("  server CPU per call", [ms(r["nodes_call_cpu_s"]) for r in results]),
        ("fleet registration, all Ready", [f"{r['register_s']:.2f} s" for r in results]),
        ("  agent-side, last RegisterAck", [f"{r['register_client_s']:.2f} s" for r in results]),
        (
            "  connect->ack per agent p50/p99/max",
            ["/".join(f"{x * 1000:.0f}" for x in r["register_lat"]) + " ms" for r in results],
        ),
        ("  server CPU spent registering", [f"{r['register_cpu_s']:.2f} s" for r in results]),
        (
            "  agent processes' CPU registering",
            [f"{r['register_client_cpu_s']:.2f} s" for r in results],
        ),
        (
            "registrations / reconnects",
            [f"{r['connects']:.0f} / {r['reconnects']}" for r in results],
        ),
    ]
    head = ["", *[f"N = {r['n']}" for r in results]]
    width0 = max(len(k) for k, _ in rows) + 2
    widths = [max(len(h), *(len(v[i]) for _, v in rows)) + 2 for i, h in enumerate(head[1:])]
    print()
    print(
        f"heartbeat {p.heartbeat:g} s, steady window {p.window:g} s, unreachable after "
        f"{p.unreachable:g} s, connects spread over {p.spread:g} s, {p.workers} agent "
        f"processes, {os.cpu_count()} CPUs" + ("" if p.ping else ", agents NOT pinging")
    )
    print(
        head[0].ljust(width0) + "".join(h.rjust(w) for h, w in zip(head[1:], widths, strict=True))
    )
    print("-" * (width0 + sum(widths)))
    for label, values in rows:
        print(
            label.ljust(width0) + "".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
        )
    print()
    print(
        "Heartbeat delay quantiles are interpolated within the histogram's buckets "
        "(bucket resolution; the bound is the bucket's upper edge). Detection lateness "
        f"is measured by polling every 50 ms, so it is known to within a poll "
        f"(interval + request); the server sweeps every {min(1.0, p.unreachable / 10):g} s."
    )
    for r in results:
        problems = []
        if r["refusals"]:
            problems.append(f"refusals: {r['refusals']}")
        if r["client_errors"]:
            problems.append(f"agent-side session ends: {r['client_errors']}")
        if r["connected"] != r["n"]:
            problems.append(f"only {r['connected']} of {r['n']} agents connected at window end")
        if r.get("server_exit") not in (0, None):
            problems.append(f"server exit status {r['server_exit']}")
        for count, line in r["log_problems"]:
            problems.append(f"server log x{count}: {line}")
        print(f"N = {r['n']}: " + ("no problems seen" if not problems else ""))
        for line in problems:
            print(f"  - {line}")
        for phase, spy in r["py_spy"].items():
            print_profile(phase, spy)

    goal = next((r for r in results if r["n"] == GOAL_AGENTS), None)
    print()
    print("Goal: 1,000 agents held by one server using under a quarter of one core.")
    if goal is None:
        print(f"  not measured (no run with N = {GOAL_AGENTS:,}).")
        return None
    met = bool(goal["cpu_pct"] < GOAL_CPU_PCT and goal["connected"] == GOAL_AGENTS)
    verdict = "MET" if met else "NOT MET"
    print(
        f"  {verdict}: {goal['cpu_pct']:.1f}% of one core at N = 1,000 (heartbeat {p.heartbeat:g} s)."
    )
    return met


def print_profile(phase: str, spy: dict[str, Any]) -> None:
    if "error" in spy:
        print(f"  py-spy, {phase}: {spy['error']}")
        return
    total = max(1, spy["samples"])
    print(f"  py-spy, {phase} ({spy['samples']} samples on CPU, {spy['path']}); self time:")
    for name, c in spy["self"]:
        print(f"    {100 * c / total:5.1f}%  {name}")
    print("  inclusive:")
    for name, c in spy["incl"]:
        print(f"    {100 * c / total:5.1f}%  {name}")


# =========================================================================== main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--agents", default=None, help="comma-separated fleet sizes (default 100,1000)")
    ap.add_argument("--heartbeat", type=float, default=None, help="heartbeat interval, s (5)")
    ap.add_argument("--window", type=float, default=None, help="steady window, s (30)")
    ap.add_argument("--unreachable-after", type=float, default=None, help="s (15)")
    ap.add_argument("--lost-after", type=float, default=None, help="s (60)")
    ap.add_argument("--workers", type=int, default=2, help="agent processes (2)")
    ap.add_argument("--connect-spread", type=float, default=None, help="spread connects over s (2)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 50 agents, heartbeat 0.5 s, window 5 s, unreachable 2 s",
    )
    ap.add_argument("--keep-logs", action="store_true", help="keep each run's folder and logs")
    ap.add_argument(
        "--py-spy",
        action="store_true",
        help="profile the server with py-spy while registering, steady and polling "
        "(the profiler skews the CPU figures; use with --keep-logs to keep the raw stacks)",
    )
    ap.add_argument(
        "--no-ping",
        action="store_true",
        help="agents do not ping after each heartbeat (llmgw agent does; shows what pings cost)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main()

    q = args.quick
    sizes = [int(x) for x in (args.agents or ("50" if q else "100,1000")).split(",") if x.strip()]
    hb = args.heartbeat if args.heartbeat is not None else (0.5 if q else 5.0)
    unreachable = (
        args.unreachable_after if args.unreachable_after is not None else (2.0 if q else 15.0)
    )
    lost = args.lost_after if args.lost_after is not None else (10.0 if q else 60.0)
    p = Params(
        heartbeat=hb,
        window=args.window if args.window is not None else (5.0 if q else 30.0),
        unreachable=unreachable,
        lost=lost,
        workers=args.workers,
        spread=args.connect_spread if args.connect_spread is not None else (1.0 if q else 2.0),
        keep_logs=args.keep_logs,
        py_spy=args.py_spy,
        ping=not args.no_ping,
    )
    if not (hb < unreachable < lost):
        ap.error("need heartbeat < unreachable-after < lost-after")
    if not sizes or min(sizes) < 1:
        ap.error("--agents needs positive sizes")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    limit = raise_nofile()
    need = 2 * max(sizes) + 100
    if limit < need:
        print(f"warning: open-file limit {limit} < {need}; large fleets may fail", file=sys.stderr)
    print(f"certificates in {PKI_DIR} ...")
    pki = ensure_pki(max(sizes))
    results = []
    try:
        for n in sizes:
            results.append(run_case(n, p, pki))
    except Failed as exc:
        print(f"\nbenchmark failed: {exc}", file=sys.stderr)
        if results:
            report(results, p)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; every process started here was stopped", file=sys.stderr)
        return 130
    report(results, p)
    return 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())

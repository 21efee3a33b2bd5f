"""What the lab's fault benchmark (``tools/bench_faults.py``) and the lab's tests
(``tests/lab``) hold a fleet to while a fault is on: traffic through the router, each
request's outcome, and whether the fleet is whole again.

``Traffic`` is a few client threads, each sending one chat completion of the tiny model
after another through the lab's router, streamed and not; an ``Outcome`` says how each
ended (a stream that answered 200 and did not end with a finish reason and ``[DONE]``
is ``cut``). The fleet is whole (``not_whole`` says why not) when every node is Ready,
every replica Ready, healthy and not leaving, and every model has its wanted count.
``double_held`` and ``orphans`` look for what a fault may leave wrong: a node's port or
GPU held by two live replicas, and processes in a node's namespace no agent knows.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tools.support import fleetapi
from tools.support.lab import Lab, LabError
from tools.support.procs import alive

MODEL = "tiny"
LIVE = ("Pending", "Starting", "Ready", "Draining", "Stopping")  # holds its node's resources


# -- traffic ----------------------------------------------------------------------


@dataclass
class Outcome:
    t0: float  # monotonic, when it was sent
    t1: float  # when it ended
    stream: bool
    ok: bool
    cut: bool  # a stream that answered 200 and did not end with finish_reason and [DONE]
    why: str  # "" when ok: the status, the error's type, or "cut"


class Traffic:
    """``clients`` threads, each sending one chat completion after another through
    the router, alternating streamed and not, until ``stop``; each one bounded by
    ``timeout``."""

    def __init__(self, lab: Lab, clients: int = 3, timeout: float = 30, pause: float = 0.05):
        self.lab = lab
        self.clients = clients
        self.timeout = timeout
        self.pause = pause
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Traffic:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def _client(self, i: int) -> None:
        timeout = httpx.Timeout(self.timeout, connect=5)
        headers = {"authorization": f"Bearer {self.lab.key}"}
        with httpx.Client(base_url=self.lab.base_url, headers=headers, timeout=timeout) as c:
            n = i
            while not self._stop.is_set():
                out = one_request(c, stream=n % 2 == 1, deadline=self.timeout)
                with self._lock:
                    self.outcomes.append(out)
                n += 1
                self._stop.wait(self.pause)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)


def one_request(c: httpx.Client, *, stream: bool, deadline: float = 30) -> Outcome:
    """One chat completion of the tiny model; its outcome."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": stream,
    }
    t0 = time.monotonic()

    def done(ok: bool, why: str = "", cut: bool = False) -> Outcome:
        return Outcome(t0, time.monotonic(), stream, ok, cut, why)

    try:
        if not stream:
            r = c.post("/chat/completions", json=body)
            if r.status_code != 200:
                return done(False, str(r.status_code))
            choices = r.json().get("choices") or [{}]
            if choices[0].get("finish_reason") is None:
                return done(False, "no finish_reason")
            return done(True)
        with c.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return done(False, str(r.status_code))
            finished = ended = False
            try:
                for line in r.iter_lines():
                    if time.monotonic() - t0 > deadline:
                        return done(False, "cut", cut=True)
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ended = True
                        break
                    with contextlib.suppress(ValueError, IndexError, AttributeError):
                        if json.loads(data)["choices"][0].get("finish_reason"):
                            finished = True
            except httpx.HTTPError:
                return done(False, "cut", cut=True)
            if finished and ended:
                return done(True)
            return done(False, "cut", cut=True)
    except httpx.HTTPError as e:
        return done(False, type(e).__name__)


# -- the fleet --------------------------------------------------------------------


def admin(lab: Lab, path: str) -> Any:
    """``GET path`` of the lab's admin API, its JSON."""
    return fleetapi.admin_get(lab.admin_url, lab.admin_token(), path)


def not_whole(lab: Lab) -> str:
    """Why the fleet is not whole now; "" when it is."""
    try:
        nodes = lab.nodes()
        replicas = lab.replicas()
        models = admin(lab, "/v1/models")["models"]
    except (httpx.HTTPError, OSError, ValueError) as e:
        return f"the control plane does not answer ({type(e).__name__})"
    for n in nodes:
        if n["state"] != "Ready":
            return f"{n['node_id']} is {n['state']}"
    for r in replicas:
        if r["state"] != "Ready" or r["leaving"] or not r["healthy"]:
            return f"{r['replica_id']} is {r['state']}" + (" (leaving)" if r["leaving"] else "")
    for m in models:
        counting = [r for r in replicas if r["model"] == m["model"]]
        if len(counting) != m["wanted"]:
            return f"{m['model']} has {len(counting)} Ready of {m['wanted']}"
    return ""


def wait_whole(lab: Lab, timeout: float) -> float | None:
    """Seconds until the fleet is whole, or None when it is not within ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not not_whole(lab):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def double_held(replicas: list[dict[str, Any]]) -> list[str]:
    """Each node+port and node+GPU that two live replicas hold at once."""
    holders: dict[tuple[str, str], str] = {}
    twice = []
    for r in replicas:
        if r["state"] not in LIVE:
            continue
        for s in r["shards"]:
            things = [f"port {s['port']}"] + [f"gpu {g}" for g in s["gpus"]]
            for thing in things:
                key = (s["node_id"], thing)
                other = holders.setdefault(key, r["replica_id"])
                if other != r["replica_id"]:
                    twice.append(f"{s['node_id']} {thing}: {other} and {r['replica_id']}")
    return twice


def orphans(lab: Lab) -> list[str]:
    """Processes in a node's namespace that are neither its agent nor an engine its
    agent has a record of (nor their children): what no agent knows."""
    out = []
    for node in lab.state["nodes"]:
        ns = lab.state["nodes"][node]["ns"]
        known = set(lab.engine_pids(node))
        recorded = {r.stem for r in (lab.dir / f"agent-{node}").glob("shards/*.json")}
        agent = lab.state["procs"].get(node)
        if agent is not None:
            known.add(agent)
        for pid in Lab._ns_pids(ns):
            if not alive(pid) or any(p in known for p in _ancestry(pid)):
                continue
            if _tagged_shard(pid) in recorded:
                continue  # a daemon of a live shard (Ray's head), carrying its tag

            out.append(f"{node}: pid {pid} {_cmdline(pid)}")
    return out


def _tagged_shard(pid: int) -> str:
    """The shard an agent's engine (or a daemon it started) carries in its environment."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    for entry in env:
        if entry.startswith(b"LLMGW_SHARD_ID="):
            return entry.split(b"=", 1)[1].decode(errors="replace")
    return ""


def _ancestry(pid: int) -> list[int]:
    chain: list[int] = []
    while pid > 1 and len(chain) < 64:
        chain.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def replica_node(lab: Lab, model: str = MODEL) -> str:
    """The node a Ready replica of ``model`` runs on."""
    for r in lab.replicas():
        if r["model"] == model and r["state"] == "Ready":
            return str(r["shards"][0]["node_id"])
    raise LabError(f"{model} has no Ready replica")


def tiny_engines(lab: Lab) -> int:
    return sum(len(lab.engine_pids(node, MODEL)) for node in lab.state["nodes"])

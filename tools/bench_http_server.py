"""Throughput and CPU cost per request of ``llmgw.http.HttpServer``.

Starts the server in a subprocess (one process, a handler returning a small
canned JSON body), then drives it over loopback from this process with
keep-alive connections at each concurrency level, each run bounded by a
request count and a time limit. Reports requests/s and the server's CPU
milliseconds per request, from /proc/<pid>/stat (utime + stime) deltas.

    python -m tools.bench_http_server [--requests 20000] [--seconds 10] [-c 1 -c 16]
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
import subprocess
import sys
import time
from typing import cast

from tools.support.benchlib import cpu_seconds
from tools.support.procs import python_path

REQUEST = b"GET /v1/ping HTTP/1.1\r\nHost: bench\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n"
BODY = b'{"object":"ping","ok":true}'


def serve(yielding: bool) -> None:
    """Subprocess side: serve until stdin closes."""
    import trio

    from llmgw.http import HttpServer, Request, Response

    headers = [("content-type", "application/json")]

    async def handler(request: Request) -> Response:
        if yielding:  # a handler that blocks, as real ones do: the disconnect watcher engages
            await trio.lowlevel.checkpoint()
        return Response(200, headers, BODY)

    async def main() -> None:
        server = HttpServer(handler, name="bench")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            print(listeners[0].socket.getsockname()[1], flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # returns when the parent closes it
            nursery.cancel_scope.cancel()

    trio.run(main)


def response_length(port: int) -> int:
    """Size of one response (constant: the date header has a fixed width)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(REQUEST)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head = data.partition(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return len(head) + 4 + length


def drive(port: int, concurrency: int, total: int, seconds: float, size: int) -> tuple[int, float]:
    """Keep-alive requests, one outstanding per connection. -> (completed, elapsed)."""
    sel = selectors.DefaultSelector()
    pending: dict[socket.socket, int] = {}
    for _ in range(concurrency):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        pending[sock] = 0
        sel.register(sock, selectors.EVENT_READ)
    started = time.perf_counter()
    deadline = started + seconds
    sent = completed = 0
    for sock in pending:
        sock.send(REQUEST)
        sent += 1
    while completed < sent:
        for key, _ in sel.select(timeout=5):
            sock = cast(socket.socket, key.fileobj)
            data = sock.recv(65536)
            if not data:
                raise SystemExit("server closed a connection")
            got = pending[sock] + len(data)
            while got >= size:
                got -= size
                completed += 1
                if sent < total and time.perf_counter() < deadline:
                    sock.send(REQUEST)
                    sent += 1
            pending[sock] = got
    elapsed = time.perf_counter() - started
    for sock in pending:
        sock.close()
    sel.close()
    return completed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=20_000, help="per concurrency level")
    parser.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    parser.add_argument("-c", "--concurrency", type=int, action="append")
    parser.add_argument(
        "--yielding", action="store_true", help="the handler yields to trio once per request"
    )
    args = parser.parse_args()
    if args.serve:
        serve(args.yielding)
        return
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.bench_http_server",
            "--serve",
            *(["--yielding"] if args.yielding else []),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **python_path()),  # this checkout's tools, from anywhere
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        size = response_length(port)
        drive(port, 4, 2000, 5.0, size)  # warm up
        print(f"{'concurrency':>11} {'requests':>9} {'req/s':>9} {'server CPU ms/req':>18}")
        for concurrency in args.concurrency or [1, 16]:
            cpu0 = cpu_seconds(proc.pid)
            done, elapsed = drive(port, concurrency, args.requests, args.seconds, size)
            cpu = cpu_seconds(proc.pid) - cpu0
            print(f"{concurrency:>11} {done:>9} {done / elapsed:>9.0f} {cpu * 1000 / done:>18.3f}")
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()

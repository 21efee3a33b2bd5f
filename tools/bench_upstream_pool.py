"""Client-side cost of ``llmgw.http.UpstreamPool`` next to ``httpx.AsyncClient`` (trio).

Starts one fast upstream in a subprocess (the project's ``HttpServer``, a
handler returning a small canned JSON body), then drives it from this process
with each client at each concurrency level: ``concurrency`` tasks issue
keep-alive GETs back to back, each reading the whole body, until the level's
request count is done (or its time limit passes). Reports requests/s,
p50/p99 latency and this process's CPU milliseconds per request
(``time.process_time`` deltas: the client's cost only, the server is
elsewhere).

    python -m tools.bench_upstream_pool [--requests 5000] [-c 1 -c 16 -c 64] [--client pool]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import trio

from tools.support.benchlib import percentile
from tools.support.procs import python_path

BODY = b'{"object":"ping","ok":true}'
PATH = "/v1/ping"
HEADERS = [("user-agent", "bench"), ("accept", "*/*")]

Fetch = Callable[[], Awaitable[bytes]]


def serve() -> None:
    """Subprocess side: serve until stdin closes."""
    from llmgw.http import HttpServer, Request, Response

    headers = [("content-type", "application/json")]

    async def handler(request: Request) -> Response:
        return Response(200, headers, BODY)

    async def main() -> None:
        server = HttpServer(handler, name="bench")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            print(listeners[0].socket.getsockname()[1], flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # returns when the parent closes it
            nursery.cancel_scope.cancel()

    trio.run(main)


async def drive(
    fetch: Fetch, concurrency: int, total: int, seconds: float
) -> tuple[int, float, float, list[float]]:
    """-> (completed, elapsed s, process CPU s, latencies s)."""
    latencies: list[float] = []
    issued = 0
    deadline = time.perf_counter() + seconds
    perf = time.perf_counter

    async def worker() -> None:
        nonlocal issued
        while issued < total and perf() < deadline:
            issued += 1
            t0 = perf()
            body = await fetch()
            latencies.append(perf() - t0)
            if body != BODY:
                raise AssertionError(f"unexpected body {body!r}")

    cpu0 = time.process_time()
    started = perf()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    elapsed = perf() - started
    cpu = time.process_time() - cpu0
    return len(latencies), elapsed, cpu, latencies


def pool_client(port: int) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    from llmgw.http import UpstreamPool

    pool = UpstreamPool()

    async def fetch() -> bytes:
        response = await pool.request("GET", "127.0.0.1", port, PATH, HEADERS, b"")
        return await response.read()

    return fetch, pool.aclose


def httpx_client(port: int) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    import httpx

    # Unbounded pool and keep-alive set, so no level churns connections.
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), timeout=60
    )
    url = f"http://127.0.0.1:{port}{PATH}"

    async def fetch() -> bytes:
        response = await client.get(url, headers=HEADERS)
        return response.content

    return fetch, client.aclose


async def run_client(
    kind: str, port: int, levels: list[int], total: int, seconds: float
) -> list[tuple[str, int, int, float, float, float, float]]:
    rows = []
    for concurrency in levels:
        # A fresh client per level, so each level opens its own connections.
        fetch, close = pool_client(port) if kind == "pool" else httpx_client(port)
        try:
            await drive(fetch, concurrency, min(total, 500), seconds)  # warm up
            done, elapsed, cpu, latencies = await drive(fetch, concurrency, total, seconds)
        finally:
            await close()
        p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
        assert p50 is not None and p99 is not None, f"{kind} c{concurrency}: no answer"
        rows.append(
            (kind, concurrency, done, done / elapsed, p50 * 1000, p99 * 1000, cpu * 1000 / done)
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=5000, help="per client and level")
    parser.add_argument("--seconds", type=float, default=30.0, help="time cap per run")
    parser.add_argument("-c", "--concurrency", type=int, action="append")
    parser.add_argument(
        "--client", choices=["pool", "httpx"], action="append", help="default: both"
    )
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.bench_upstream_pool", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **python_path()),  # this checkout's tools, from anywhere
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        levels = args.concurrency or [1, 16, 64]
        print(
            f"{'client':>6} {'conc':>5} {'requests':>9} {'req/s':>8} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'client CPU ms/req':>18}"
        )
        for kind in args.client or ["pool", "httpx"]:
            rows = trio.run(run_client, kind, port, levels, args.requests, args.seconds)
            for name, conc, done, rps, p50, p99, cpu in rows:
                print(
                    f"{name:>6} {conc:>5} {done:>9} {rps:>8.0f} "
                    f"{p50:>8.2f} {p99:>8.2f} {cpu:>18.3f}",
                    flush=True,
                )
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

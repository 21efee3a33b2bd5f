#!/usr/bin/env python3
"""A stand-in for Ray's ``ray start`` / ``ray stop``, for the multi-node vLLM path.

Why: real Ray cannot run where the suite runs (it wants GPUs and minutes),
yet the ``vllm-ray`` adapter's commands must be run for real, in order, as
processes: the head daemonizes and returns, a worker joins the head and
blocks, a worker with no head fails. This script keeps exactly that much of
Ray's behaviour, and no more. Standard library only.

- ``ray start --head --port=P [--node-ip-address=IP] [--num-gpus=N] ...``
  starts a small TCP listener on P in a detached child (its own session,
  like Ray's daemons), records its pid in ``$RAY_STANDIN_DIR/head.json``
  (default ``/tmp/ray-standin-$UID``) and exits 0 once it listens. The
  listener counts the cluster's GPUs: its own plus every connected worker's.
  It exits by itself after ``RAY_STANDIN_HEAD_TTL_S`` (default 600) so a
  test that forgets ``ray stop`` leaks nothing for long.
- ``ray start --address=H:P [--num-gpus=N] --block`` connects to H:P and
  joins, then blocks until SIGTERM (exit 0) or until the head goes away
  (exit 1). While nothing listens at H:P it tries again, saying so as Ray
  does ("Unable to connect to GCS at H:P..."), for ``RAY_STANDIN_JOIN_WAIT_S``
  (default 60, about what Ray's own retries take), then fails with exit 1.
- ``ray stop`` ends the head recorded in the state directory.

Wire (one line each way): a worker sends ``join N IP``, the head answers
``ok``; anyone may send ``gpus`` and get the cluster's GPU count (the vLLM
stand-in asks, as real vLLM asks Ray for resources).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

PREFIX = "ray stand-in:"


def say(message: str, *, err: bool = False) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr if err else sys.stdout, flush=True)


def fail(message: str, code: int = 1) -> NoReturn:
    say(f"error: {message}", err=True)
    sys.exit(code)


def state_dir() -> Path:
    d = Path(os.environ.get("RAY_STANDIN_DIR") or f"/tmp/ray-standin-{os.getuid()}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def head_file() -> Path:
    return state_dir() / "head.json"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        fail(f"--address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def exit_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        say(f"signal {signum}, exiting")
        sys.exit(0)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


# --- the head's listener (runs in the detached child) ------------------------


def serve_head(host: str, port: int, gpus: int, ttl: float) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror}")
    listener.listen(64)
    lock = threading.Lock()
    total = [gpus]

    def client(conn: socket.socket) -> None:
        with conn:
            line = conn.makefile("r").readline().split()
            if line[:1] == ["gpus"]:
                with lock:
                    conn.sendall(f"{total[0]}\n".encode())
                return
            if len(line) < 2 or line[0] != "join" or not line[1].isdigit():
                return
            n = int(line[1])
            with lock:
                total[0] += n
            who = " ".join(line[2:]) or "?"
            say(f"worker {who} joined with {n} GPUs")
            try:
                conn.sendall(b"ok\n")
                while conn.recv(1024):
                    pass
            except OSError:
                pass
            finally:
                with lock:
                    total[0] -= n
                say(f"worker {who} left")

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=client, args=(conn,), daemon=True).start()

    exit_on_sigterm()
    threading.Thread(target=accept, daemon=True).start()
    say(f"head listening on {host}:{port} with {gpus} GPUs")
    time.sleep(ttl)
    say("head lived its RAY_STANDIN_HEAD_TTL_S, exiting")


# --- commands -----------------------------------------------------------------


def start_head(args: argparse.Namespace) -> None:
    path = head_file()
    if path.exists():
        old = json.loads(path.read_text())
        try:
            os.kill(old["pid"], 0)
        except OSError:
            path.unlink()
        else:
            fail(f"a head is already running here (pid {old['pid']}, port {old['port']})")
    host = args.node_ip_address or "127.0.0.1"
    ttl = float(os.environ.get("RAY_STANDIN_HEAD_TTL_S", "600"))
    log = (state_dir() / f"head-{args.port}.log").open("ab")
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "_serve-head",
            host,
            str(args.port),
            str(args.num_gpus),
            str(ttl),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,  # detached, like Ray's daemons
    )
    log.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if child.poll() is not None:
            text = (state_dir() / f"head-{args.port}.log").read_text(errors="replace")
            fail(f"the head did not start:\n{text.strip()}")
        try:
            with socket.create_connection((host, args.port), timeout=1) as probe:
                probe.sendall(b"gpus\n")
                probe.recv(64)
            break
        except OSError:
            time.sleep(0.02)
    else:
        child.kill()
        fail(f"the head did not listen on {host}:{args.port} within 10s")
    path.write_text(json.dumps({"pid": child.pid, "host": host, "port": args.port}))
    say(f"started a head on {host}:{args.port} with {args.num_gpus} GPUs (pid {child.pid})")
    say("stop it with: ray stop")


def start_worker(args: argparse.Namespace) -> None:
    host, port = split_address(args.address)
    exit_on_sigterm()
    deadline = time.monotonic() + float(os.environ.get("RAY_STANDIN_JOIN_WAIT_S", "60"))
    said = 0.0
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                fail(f"cannot reach the Ray head at {args.address}: {exc.strerror or exc}")
            if time.monotonic() - said > 5:
                said = time.monotonic()
                say(
                    f"Unable to connect to GCS at {args.address}. Check that (1) Ray GCS "
                    "started successfully at the specified address, and (2) there is no "
                    "firewall setting preventing access.",
                    err=True,
                )
            time.sleep(0.2)
    ip = args.node_ip_address or "?"
    conn.sendall(f"join {args.num_gpus} {ip}\n".encode())
    if conn.makefile("r").readline().strip() != "ok":
        fail(f"{args.address} did not accept this worker")
    say(f"joined the head at {args.address} as {ip} with {args.num_gpus} GPUs")
    if not args.block:
        return  # a real non-blocking worker would keep its daemons; this one just leaves
    conn.settimeout(None)
    while conn.recv(1024):
        pass
    fail(f"lost the head at {args.address}")


def stop() -> None:
    path = head_file()
    if not path.exists():
        say("no head is running here")
        return
    pid = json.loads(path.read_text())["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    path.unlink(missing_ok=True)
    say(f"stopped the head (pid {pid})")


def main(argv: list[str]) -> None:
    if argv[:1] == ["_serve-head"]:
        host, port, gpus, ttl = argv[1:5]
        serve_head(host, int(port), int(gpus), float(ttl))
        return
    parser = argparse.ArgumentParser(prog="ray")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start")
    start.add_argument("--head", action="store_true")
    start.add_argument("--address")
    start.add_argument("--port", type=int, default=6379)
    start.add_argument("--node-ip-address")
    start.add_argument("--num-gpus", type=int, default=0)
    start.add_argument("--block", action="store_true")
    start.add_argument("--disable-usage-stats", action="store_true")
    commands.add_parser("stop").add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "stop":
        stop()
    elif args.head:
        start_head(args)
    elif args.address:
        start_worker(args)
    else:
        parser.error("ray start needs --head or --address")


if __name__ == "__main__":
    main(sys.argv[1:])

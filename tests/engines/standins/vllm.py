#!/usr/bin/env python3
"""A stand-in for ``vllm serve``: vLLM's command line, endpoints and metric names.

Why: vLLM needs GPUs and minutes to start, so the adapter and the agent's
supervisor are tested against this script instead. It accepts what ``vllm
serve`` accepts for the flags the adapter uses (an unknown flag exits 2 with
argparse's message, as vLLM's own parser does), behaves like vLLM where the
supervisor can tell (the port is closed while "loading"; an impossible
tensor x pipeline parallelism fails after a delay, not at once), and serves
the endpoints the gateway uses. Standard library only, so a wrapper can run
it with any Python. Every line it prints starts with "vllm stand-in:" so
nobody mistakes its log for vLLM's.

Environment:

- ``STANDIN_LOAD_S`` (default 0.5): how long "loading" takes.
- ``STANDIN_FAIL_S`` (default 0.3): how long before an impossible layout fails.
- ``STANDIN_TOKEN_DELAY_S`` (default 0.05): delay per generated token, so a
  request stays in flight long enough to be seen in the metrics.
- ``STANDIN_RAY_WAIT_S`` (default 1800, vLLM's own wait for a Ray placement
  group): with ``--distributed-executor-backend ray``, how long to wait for
  every rank to join the Ray stand-in's cluster (its GPUs to add up to TP x
  PP). It says what it waits for every 10 s, as vLLM does, and it serves only
  once they have joined. Once serving, a rank that leaves the cluster ends it
  with exit 1, as a dead Ray worker ends vLLM's engine.
- ``STANDIN_WEDGE_AFTER_TOKENS`` (unset: never): after that many tokens generated
  in all, it generates no more: every request in flight stalls, and new ones too,
  while ``/health`` answers 200 and ``/metrics`` answers with its counters flat
  (vLLM #17972: an engine that accepts requests and makes no progress).
- ``CUDA_VISIBLE_DEVICES``: the GPUs it pretends to have (unset: none).
- ``VLLM_API_KEY``: as vLLM's: when set, every path under ``/v1`` answers 401
  ``{"error": "Unauthorized"}`` without ``Authorization: Bearer <key>``; the
  others (``/health``, ``/metrics``) are open, and so is every ``OPTIONS``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

PREFIX = "vllm stand-in:"
TOKENS = ["Hello", " from", " the", " vLLM", " stand-in", "."]


def say(message: str, *, err: bool = False) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr if err else sys.stdout, flush=True)


def fail(message: str, code: int = 1) -> NoReturn:
    say(f"error: {message}", err=True)
    sys.exit(code)


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def dashed(arg: str) -> str:
    """vLLM's parser takes ``--tensor_parallel_size`` for ``--tensor-parallel-size``."""
    if not arg.startswith("--"):
        return arg
    flag, sep, value = arg.partition("=")
    return flag.replace("_", "-") + sep + value


def parse(argv: list[str]) -> argparse.Namespace:
    argv = [dashed(a) for a in argv]
    parser = argparse.ArgumentParser(prog="vllm")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    serve.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--served-model-name", nargs="+")
    serve.add_argument(
        "--distributed-executor-backend", choices=["ray", "mp", "uni", "external_launcher"]
    )
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--enforce-eager", action="store_true")
    return parser.parse_args(argv)


def ray_gpus() -> int | None:
    """The Ray stand-in's cluster GPU count; None when no head runs here."""
    d = Path(os.environ.get("RAY_STANDIN_DIR") or f"/tmp/ray-standin-{os.getuid()}")
    try:
        head = json.loads((d / "head.json").read_text())
        with socket.create_connection((head["host"], head["port"]), timeout=2) as conn:
            conn.sendall(b"gpus\n")
            return int(conn.makefile("r").readline())
    except (OSError, ValueError, KeyError):
        return None


def check_gpus(args: argparse.Namespace) -> None:
    needed = args.tensor_parallel_size * args.pipeline_parallel_size
    layout = (
        f"tensor_parallel_size {args.tensor_parallel_size} x "
        f"pipeline_parallel_size {args.pipeline_parallel_size} needs {needed} GPUs"
    )
    if args.distributed_executor_backend == "ray":
        started = time.monotonic()
        deadline = started + env_float("STANDIN_RAY_WAIT_S", 1800)
        said = started
        while True:
            have = ray_gpus()
            if have is None:
                time.sleep(env_float("STANDIN_FAIL_S", 0.3))
                fail("--distributed-executor-backend ray, but no Ray cluster runs here")
            if have >= needed:
                say(f"the Ray cluster has {have} GPUs")
                return
            if time.monotonic() > deadline:
                fail(f"{layout}, the Ray cluster has {have}")
            if time.monotonic() - said >= 10:
                said = time.monotonic()
                say(
                    f"Waiting for creating a placement group of {needed} GPUs for "
                    f"{said - started:.0f} seconds; the Ray cluster has {have}"
                )
            time.sleep(0.05)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    have = len([g for g in visible.split(",") if g.strip()])
    if needed > have:
        time.sleep(env_float("STANDIN_FAIL_S", 0.3))
        fail(f"{layout}, CUDA_VISIBLE_DEVICES={visible!r} has {have}")


class State:
    def __init__(self, names: list[str], max_len: int | None) -> None:
        self.names = names
        self.max_len = max_len
        self.running = 0
        self.served = 0
        self.generated = 0
        self.lock = threading.Lock()
        self.delay = env_float("STANDIN_TOKEN_DELAY_S", 0.05)
        wedge = os.environ.get("STANDIN_WEDGE_AFTER_TOKENS")
        self.wedge_after = int(wedge) if wedge else None

    def step(self) -> None:
        """One token's time, counted; past the wedge point it never returns."""
        time.sleep(self.delay)
        with self.lock:
            wedged = self.wedge_after is not None and self.generated >= self.wedge_after
            if not wedged:
                self.generated += 1
        if wedged:
            say(f"wedged after {self.wedge_after} tokens: generating nothing more")
            while True:
                time.sleep(3600)

    def metrics(self) -> bytes:
        with self.lock:
            running, served, generated = self.running, self.served, self.generated
        label = f'{{model_name="{self.names[0]}"}}'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, 0.05 * running)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {float(generated)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{finished_reason="stop",model_name="{self.names[0]}"}} {float(served)}',
        ]
        return ("\n".join(lines) + "\n").encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        say(f"{self.address_string()} {format % args}")

    def reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def json(self, status: int, obj: object) -> None:
        self.reply(status, json.dumps(obj).encode())

    def refused(self) -> bool:
        """vLLM's AuthenticationMiddleware: only paths under /v1 want the key."""
        key = os.environ.get("VLLM_API_KEY")
        if not key or not self.path.startswith("/v1"):
            return False
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return False
        self.rfile.read(int(self.headers.get("Content-Length") or 0))  # keep-alive stays whole
        self.json(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:
        state = self.server.state
        if self.refused():
            return
        if self.path == "/health":
            self.reply(200, b"", "text/plain")
        elif self.path == "/v1/models":
            models = [
                {
                    "id": n,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm",
                    "root": n,
                    "max_model_len": state.max_len,
                }
                for n in state.names
            ]
            self.json(200, {"object": "list", "data": models})
        elif self.path == "/metrics":
            self.reply(200, state.metrics(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self.json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        state = self.server.state
        if self.refused():
            return
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self.json(404, {"detail": "Not Found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self.json(400, error("the body is not JSON", "BadRequestError", 400))
            return
        model = body.get("model") or state.names[0]
        if model not in state.names:
            self.json(404, error(f"The model `{model}` does not exist.", "NotFoundError", 404))
            return
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or len(TOKENS)
        tokens = TOKENS[: max(1, int(limit))]
        finish = "stop" if len(tokens) == len(TOKENS) else "length"
        with state.lock:
            state.running += 1
        try:
            if body.get("stream"):
                self.stream(chat, model, tokens, finish)
            else:
                for _ in tokens:
                    state.step()
                self.json(200, completion(chat, model, tokens, finish, prompt_tokens(body)))
        finally:
            with state.lock:
                state.running -= 1
                state.served += 1

    def stream(self, chat: bool, model: str, tokens: list[str], finish: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        if chat:
            event(json.dumps(chunk(chat, model, {"role": "assistant", "content": ""}, None)))
        for i, token in enumerate(tokens):
            self.server.state.step()
            last = finish if i == len(tokens) - 1 else None
            piece: object = {"content": token} if chat else token
            event(json.dumps(chunk(chat, model, piece, last)))
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def error(message: str, kind: str, code: int) -> dict[str, object]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


def prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"])
    else:
        text = str(body.get("prompt", ""))
    return len(text.split())


def completion(
    chat: bool, model: str, tokens: list[str], finish: str, prompt: int
) -> dict[str, object]:
    text = "".join(tokens)
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": "chatcmpl-standin" if chat else "cmpl-standin",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": len(tokens),
            "total_tokens": prompt + len(tokens),
        },
    }


def chunk(chat: bool, model: str, piece: object, finish: str | None) -> dict[str, object]:
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish}
    choice["delta" if chat else "text"] = piece
    return {
        "id": "chatcmpl-standin" if chat else "cmpl-standin",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
    }


class Server(ThreadingHTTPServer):
    daemon_threads = True
    state: State


def main(argv: list[str]) -> None:
    def on_signal(signum: int, frame: object) -> None:
        say(f"signal {signum}, exiting")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"argv {json.dumps(argv)}")
    say(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")
    args = parse(argv)
    check_gpus(args)
    load = env_float("STANDIN_LOAD_S", 0.5)
    say(f"pretending to load {args.model} for {load:g}s")
    time.sleep(load)
    host = args.host.strip("[]")
    Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        server = Server((host, args.port), Handler)
    except OSError as exc:
        fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror}")
    server.state = State(args.served_model_name or [args.model], args.max_model_len)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"serving {server.state.names} on {args.host}:{args.port}")
    needed = args.tensor_parallel_size * args.pipeline_parallel_size
    while True:
        time.sleep(0.5)
        if args.distributed_executor_backend == "ray":
            have = ray_gpus()
            if have is None or have < needed:
                fail(f"a Ray worker died: the cluster has {have or 0} of {needed} GPUs")


if __name__ == "__main__":
    main(sys.argv[1:])

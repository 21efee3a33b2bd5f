#!/usr/bin/env python3
"""A third engine, for the test that adds one (``tests/engines/test_third_engine.py``).

It is no stand-in for any real engine: it has its own command line, its own
metric names, its own way of giving token ids and its own tokenizer
endpoints, so that llmgw can run it only through what its adapter (defined in
that test) declares. Standard library only.

- ``counting-engine --version`` prints its version; ``counting-engine serve
  --host H --port P --model NAME`` serves. ``--delay-s`` is the time per
  token; with ``--crash-once FILE --crash-after N``, the first stream of any
  engine sharing FILE to reach N tokens ends the process there (``os._exit``,
  the connection cut mid-stream), once: the engine that creates FILE is the one
  that dies.
- ``COUNTING_API_KEY``: when set, every path under ``/v1`` wants ``Authorization:
  Bearer <key>`` (401 without); ``/health``, ``/metrics``, ``/tokenize`` and
  ``/detokenize`` are open.
- Its "model" counts: ids 0-255 are the bytes of UTF-8 text, id 1000 + k is the
  word `` wk``. After a context holding k counting words comes word k, so a
  prompt goes on from where its words stop: a continuation sent the words
  relayed so far is exactly the rest of an unbroken reply. A reply is
  ``max_tokens`` words long (16 unset), finish "length".
- A chat is ``<role>content`` per message, a newline each, then ``<assistant>``.
- ``POST /tokenize`` ``{"text": ...}`` or ``{"messages": [...]}`` answers ``{"ids":
  [...]}``; ``POST /detokenize`` ``{"ids": [...]}`` answers ``{"text": ...}``.
- ``"with_ids": true`` in a request puts ``"ids": [id]`` in each streamed choice.
- ``GET /metrics``: ``counting_running``, ``counting_waiting`` and
  ``counting_generated_total``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VERSION = "1.2.3"
WORD = 1000  # id of word 0


def tokenize(text: str) -> list[int]:
    return list(text.encode())


def detokenize(ids: list[int]) -> str:
    out: list[str] = []
    raw = bytearray()
    for i in ids:
        if i < 256:
            raw.append(i)
            continue
        out.append(raw.decode(errors="replace"))
        raw.clear()
        out.append(f" w{i - WORD}")
    out.append(raw.decode(errors="replace"))
    return "".join(out)


def template(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.running = 0
        self.generated = 0

    def metrics(self) -> bytes:
        with self.lock:
            return (
                "# TYPE counting_running gauge\n"
                f"counting_running {self.running}\n"
                "# TYPE counting_waiting gauge\n"
                "counting_waiting 0\n"
                "# TYPE counting_generated counter\n"
                f"counting_generated_total {self.generated}\n"
            ).encode()

    def token(self, sent: int) -> None:
        """One token made: counted, and the end of the process if it is the one."""
        with self.lock:
            self.generated += 1
        args = self.args
        if args.crash_once and sent == args.crash_after:
            try:
                os.close(os.open(args.crash_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
            print(f"counting engine: crashing after {sent} tokens, as told", flush=True)
            os._exit(3)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, obj: object, ctype: str = "application/json") -> None:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def allowed(self) -> bool:
        key = os.environ.get("COUNTING_API_KEY")
        if not key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("authorization") == f"Bearer {key}":
            return True
        self.reply(401, {"error": {"message": "no key", "type": "auth"}})
        return False

    def do_GET(self) -> None:
        if not self.allowed():
            return
        engine = self.server.engine
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/metrics":
            self.reply(200, engine.metrics(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": engine.args.model}]})
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        if not self.allowed():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path == "/tokenize":
            text = template(body["messages"]) if "messages" in body else body["text"]
            self.reply(200, {"ids": tokenize(text)})
        elif self.path == "/detokenize":
            self.reply(200, {"text": detokenize(body["ids"])})
        elif self.path in ("/v1/chat/completions", "/v1/completions"):
            self.complete(body, chat=self.path == "/v1/chat/completions")
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def complete(self, body: dict[str, Any], chat: bool) -> None:
        engine = self.server.engine
        if chat:
            prompt = tokenize(template(body["messages"]))
        else:
            given = body["prompt"]
            prompt = given if isinstance(given, list) else tokenize(given)
        first = sum(1 for i in prompt if i >= WORD)
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        ids = [WORD + first + k for k in range(n)]
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{time.monotonic_ns()}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", engine.args.model),
        }
        if not body.get("stream"):
            text = detokenize(ids)
            for sent in range(1, n + 1):
                engine.token(sent)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            choice["finish_reason"] = "length"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
            self.reply(200, {**head, "choices": [choice], "usage": usage})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        with engine.lock:
            engine.running += 1
        try:
            if chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                event(json.dumps({**head, "choices": [{**role, "finish_reason": None}]}))
            for sent, i in enumerate(ids, 1):
                time.sleep(engine.args.delay_s)
                piece = detokenize([i])
                c: dict[str, Any] = (
                    {"index": 0, "delta": {"content": piece}}
                    if chat
                    else {"index": 0, "text": piece}
                )
                c["finish_reason"] = "length" if sent == n else None
                if body.get("with_ids"):
                    c["ids"] = [i]
                event(json.dumps({**head, "choices": [c]}))
                engine.token(sent)
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            with engine.lock:
                engine.running -= 1


class Server(ThreadingHTTPServer):
    daemon_threads = True
    engine: Engine


def main(argv: list[str]) -> None:
    if argv[:1] == ["--version"]:
        print(VERSION)
        return
    parser = argparse.ArgumentParser(prog="counting-engine")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--delay-s", type=float, default=0.02)
    parser.add_argument("--crash-once", default="")
    parser.add_argument("--crash-after", type=int, default=0)
    args = parser.parse_args(argv)
    server = Server((args.host, args.port), Handler)
    server.engine = Engine(args)
    print(f"counting engine: serving {args.model} on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])

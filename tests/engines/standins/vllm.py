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
  others (``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``, and the
  sleep endpoints below) are open, and so is every ``OPTIONS``.
- ``VLLM_SERVER_DEV_MODE``: ``1`` with ``--enable-sleep-mode`` serves vLLM's sleep
  mode, as below; without either, its paths are 404, as in vLLM.
- ``STANDIN_SLEEP_S`` (default 0.1), ``STANDIN_WAKE_S`` (default 0.2): how long
  ``POST /sleep`` and ``POST /wake_up`` take to answer.
- ``STANDIN_SLEEP_FAILS`` (unset: never): ``1``: ``POST /sleep`` answers 500 with
  a JSON error and it stays awake (an engine that cannot sleep).

Sleep mode, as vLLM's (``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /sleep`` (query ``level``, 1 or 2, default 1; anything else is a 400)
  answers 200 with an empty body once asleep; ``POST /wake_up`` answers 200 with
  an empty body once awake; ``GET /is_sleeping`` answers ``{"is_sleeping": bool}``.
- Asleep, generation (``/v1/completions``, ``/v1/chat/completions``) answers 503
  with a JSON error saying the model is sleeping; ``/health``, ``/v1/models``,
  ``/tokenize``, ``/detokenize`` and ``/metrics`` answer as awake, its gauges of
  requests running and waiting 0.

Tokens: it has what vLLM offers to resume a broken stream on another replica,
so the gateway's resuming can be tested without a GPU.

- A toy tokenizer: ids 0-255 are single bytes of UTF-8 text, ids 1000-1005 are
  the words of its reply (``TOKENS``). Text is cut left to right, the longest
  word where one matches, else one byte; ids turn back into text byte by byte
  (``errors="replace"``). An id outside that vocabulary is a 400.
- A chat template: each message is ``<|role|>content`` and a newline, then
  ``<|assistant|>`` unless ``add_generation_prompt`` is false (vLLM's default is
  true). Content given as parts is their text, a newline between parts.
- ``POST /tokenize`` (text, or messages through the template) and ``POST
  /detokenize``, with vLLM's bodies and answers, outside ``/v1`` as in vLLM.
- ``/v1/completions`` takes the prompt as text or as a list of token ids.
- Generation follows from the context, deterministic: after word i of the reply
  comes word i + 1; after its last word, ".", the reply is over (finish
  "stop"); after anything else (the end of a prompt) comes its first word. A
  fresh prompt gets the whole reply; a prompt that already ends with the ids of
  "Hello from the" gets " vLLM stand-in." and no more, so a stream resumed with
  the right ids can be told from one resumed with wrong ones. ``max_tokens``
  cuts it (finish "length").
- ``return_token_ids`` (vLLM 0.10.2 and later): every streamed chunk with a
  token carries ``token_ids`` in its choice; the prompt's ids come in the chat
  stream's first chunk as ``prompt_token_ids`` (a completions stream: in the
  first chunk's choice). Unstreamed, the choice has ``token_ids``, and the
  prompt's ids are the chat response's ``prompt_token_ids`` (a completions
  response: its choice's). Without it, none of these keys appear.
- ``usage.prompt_tokens`` counts the prompt's ids; with ``stream_options:
  {"include_usage": true}`` a stream ends with a chunk with no choices and the
  usage, before ``[DONE]``, as vLLM's does.

Prefix caching, as vLLM's automatic prefix caching counts it: prompts are cut into
blocks of 16 ids, each block known by its ids and all before it; a request reuses
its leading blocks that are held (at most all but its last id, which vLLM always
computes), then holds all of its full blocks, the least recently used dropped past
``STANDIN_PREFIX_BLOCKS`` (default 4096). ``--enable-prefix-caching`` (on by
default, as in vLLM V1; ``--no-enable-prefix-caching`` off), the counters
``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (prompt tokens looked
up, and found), ``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.
cached_tokens``) and ``POST /reset_prefix_cache`` (which vLLM serves in its dev
mode) are as vLLM's.
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
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

PREFIX = "vllm stand-in:"
TOKENS = ["Hello", " from", " the", " vLLM", " stand-in", "."]
WORD_BASE = 1000  # id of TOKENS[0]; ids 0-255 are bytes
WORDS = [w.encode() for w in TOKENS]
DEFAULT_MAX_LEN = 2048  # what /tokenize says without --max-model-len


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
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    serve.add_argument("--enable-prompt-tokens-details", action="store_true")
    serve.add_argument("--enable-sleep-mode", action="store_true")
    return parser.parse_args(argv)


BLOCK = 16  # vLLM's default block size, in tokens


class PrefixCache:
    """Blocks of prompt ids held, least recently used first (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` reused; its full blocks are held from now on."""
        keys = [tuple(prompt[:end]) for end in range(BLOCK, len(prompt) + 1, BLOCK)]
        found = 0
        for key in keys:
            if key not in self.blocks:
                break
            found += 1
        cached = min(found * BLOCK, max(0, len(prompt) - 1))
        for key in reversed(keys):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        self.queries += len(prompt)
        self.hits += cached
        return cached


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


class BadRequest(ValueError):
    """A request vLLM would answer 400."""


def tokenize(text: str) -> list[int]:
    """Left to right: the longest word of TOKENS that starts here, else one byte."""
    raw = text.encode()
    ids: list[int] = []
    at = 0
    while at < len(raw):
        best = -1
        for i, word in enumerate(WORDS):
            if raw.startswith(word, at) and (best < 0 or len(word) > len(WORDS[best])):
                best = i
        if best >= 0:
            ids.append(WORD_BASE + best)
            at += len(WORDS[best])
        else:
            ids.append(raw[at])
            at += 1
    return ids


def token_ids(value: object) -> list[int]:
    """A list of ids of the vocabulary, else BadRequest."""
    if not isinstance(value, list):
        raise BadRequest(f"token ids must be a list of integers, got {value!r}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"token ids must be integers, got {t!r}")
        if not (0 <= t < 256 or WORD_BASE <= t < WORD_BASE + len(TOKENS)):
            raise BadRequest(f"token id {t} is out of vocabulary")
    return value


def detokenize(ids: object) -> str:
    """The text of a list of ids; BadRequest for anything else."""
    raw = b"".join(bytes([t]) if t < 256 else WORDS[t - WORD_BASE] for t in token_ids(ids))
    return raw.decode(errors="replace")


def render(messages: object, add_generation_prompt: bool = True) -> str:
    """The chat template: ``<|role|>content`` and a newline each, then ``<|assistant|>``."""
    if not isinstance(messages, list):
        raise BadRequest(f"messages must be a list, got {messages!r}")
    text = ""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"a message needs a role: {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "\n".join(str(p.get("text", "")) for p in parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"a message's content must be text or parts, got {content!r}")
        text += f"<|{m['role']}|>{content}\n"
    return text + "<|assistant|>" if add_generation_prompt else text


def successor(context: list[int]) -> int | None:
    """The next id after ``context``; None: the reply is over."""
    last = context[-1] if context else None
    if last == WORD_BASE + len(TOKENS) - 1:
        return None
    if last is not None and WORD_BASE <= last < WORD_BASE + len(TOKENS) - 1:
        return last + 1
    return WORD_BASE


def generate(prompt: list[int], limit: int | None) -> tuple[list[int], str]:
    """The ids generated after ``prompt``, at most ``limit``, and the finish reason."""
    context = list(prompt)
    out: list[int] = []
    while limit is None or len(out) < limit:
        nxt = successor(context)
        if nxt is None:
            break
        out.append(nxt)
        context.append(nxt)
    return out, "stop" if successor(context) is None else "length"


def max_tokens(body: dict[str, Any]) -> int | None:
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    if limit is None:
        return None
    try:
        if isinstance(limit, bool):
            raise ValueError
        return max(1, int(limit))
    except (TypeError, ValueError):
        raise BadRequest(f"max_tokens must be an integer, got {limit!r}") from None


class State:
    def __init__(
        self,
        names: list[str],
        max_len: int | None,
        caching: bool = True,
        details: bool = False,
        sleep_mode: bool = False,
    ) -> None:
        self.names = names
        self.sleep_mode = sleep_mode  # --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1
        self.asleep = False
        self.max_len = max_len
        self.cache = PrefixCache(int(env_float("STANDIN_PREFIX_BLOCKS", 4096))) if caching else None
        self.details = details  # --enable-prompt-tokens-details
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
            if self.asleep:
                running = 0  # vLLM asleep schedules nothing
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
        if self.cache is not None:
            with self.lock:
                queries, hits = self.cache.queries, self.cache.hits
            lines += [
                "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of "
                "queried tokens.",
                "# TYPE vllm:prefix_cache_queries counter",
                f"vllm:prefix_cache_queries_total{label} {float(queries)}",
                "# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of "
                "cached tokens.",
                "# TYPE vllm:prefix_cache_hits counter",
                f"vllm:prefix_cache_hits_total{label} {float(hits)}",
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
        elif self.path == "/is_sleeping" and state.sleep_mode:
            self.json(200, {"is_sleeping": state.asleep})
        else:
            self.json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        state = self.server.state
        if self.refused():
            return
        if self.path == "/reset_prefix_cache":
            if state.cache is not None:
                with state.lock:
                    state.cache.blocks.clear()
            self.reply(200, b"")
            return
        path = urlsplit(self.path).path
        if path in ("/sleep", "/wake_up") and state.sleep_mode:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path == "/sleep":
                self.sleep()
            else:
                self.wake()
            return
        if self.path not in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            self.json(404, {"detail": "Not Found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self.json(400, error("the body is not JSON", "BadRequestError", 400))
            return
        if not isinstance(body, dict):
            self.json(400, error("the body is not a JSON object", "BadRequestError", 400))
            return
        model = body.get("model") or state.names[0]
        if model not in state.names:
            self.json(404, error(f"The model `{model}` does not exist.", "NotFoundError", 404))
            return
        if state.asleep and self.path.startswith("/v1/"):
            self.json(
                503,
                error(
                    "The model is sleeping: wake it with POST /wake_up",
                    "ServiceUnavailableError",
                    503,
                ),
            )
            return
        try:
            if self.path == "/tokenize":
                self.tokenize(body)
            elif self.path == "/detokenize":
                self.json(200, {"prompt": detokenize(body.get("tokens"))})
            else:
                self.complete(body, model)
        except BadRequest as exc:
            self.json(400, error(str(exc), "BadRequestError", 400))

    def sleep(self) -> None:
        """``POST /sleep?level=N``: 200 once asleep (or 500, ``STANDIN_SLEEP_FAILS``)."""
        level = parse_qs(urlsplit(self.path).query).get("level", ["1"])[-1]
        if level not in ("1", "2"):
            self.json(400, error(f"level must be 1 or 2, got {level!r}", "BadRequestError", 400))
            return
        if os.environ.get("STANDIN_SLEEP_FAILS") == "1":
            say("asked to sleep, and failing to (STANDIN_SLEEP_FAILS)")
            self.json(500, error("CUDA error: sleep failed", "InternalServerError", 500))
            return
        time.sleep(env_float("STANDIN_SLEEP_S", 0.1))
        self.server.state.asleep = True
        say(f"asleep (level {level}): GPU memory freed")
        self.reply(200, b"")

    def wake(self) -> None:
        """``POST /wake_up``: 200 once awake."""
        time.sleep(env_float("STANDIN_WAKE_S", 0.2))
        self.server.state.asleep = False
        say("awake")
        self.reply(200, b"")

    def tokenize(self, body: dict[str, Any]) -> None:
        if "messages" in body:
            text = render(body["messages"], bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise BadRequest("/tokenize wants a prompt (text) or messages")
        ids = tokenize(text)
        max_len = self.server.state.max_len or DEFAULT_MAX_LEN
        self.json(
            200, {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None}
        )

    def complete(self, body: dict[str, Any], model: str) -> None:
        """/v1/completions and /v1/chat/completions: the reply follows from the prompt's ids."""
        state = self.server.state
        chat = self.path == "/v1/chat/completions"
        if chat:
            text = render(body.get("messages", []), bool(body.get("add_generation_prompt", True)))
            prompt = tokenize(text)
        elif isinstance(body.get("prompt"), list):
            prompt = token_ids(body["prompt"])
        elif isinstance(body.get("prompt", ""), str):
            prompt = tokenize(body.get("prompt", ""))
        else:
            raise BadRequest("prompt must be text or a list of token ids")
        ids, finish = generate(prompt, max_tokens(body))
        reply = Reply(chat, model, prompt, bool(body.get("return_token_ids")))
        if state.cache is not None:
            with state.lock:
                cached = state.cache.lookup(prompt)
            if state.details:
                reply.cached = cached
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        with state.lock:
            state.running += 1
        try:
            if body.get("stream"):
                self.stream(reply, ids, finish, usage)
            else:
                for _ in ids:
                    state.step()
                self.json(200, reply.completion(ids, finish))
        finally:
            with state.lock:
                state.running -= 1
                state.served += 1

    def stream(self, reply: Reply, ids: list[int], finish: str, usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        # the prompt's ids go with the first chunk: chat's role chunk, else the first token's
        if reply.chat:
            event(json.dumps(reply.chunk(None, None, first=True)))
        for i, token in enumerate(ids):
            self.server.state.step()
            last = finish if i == len(ids) - 1 else None
            event(json.dumps(reply.chunk(token, last, first=i == 0 and not reply.chat)))
        if not ids:  # nothing to generate: only the finish
            event(json.dumps(reply.chunk(None, finish, first=not reply.chat)))
        if usage:
            event(json.dumps(reply.usage_chunk(len(ids))))
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def error(message: str, kind: str, code: int) -> dict[str, object]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


class Reply:
    """The bodies of one request's answer, in vLLM's shapes."""

    def __init__(self, chat: bool, model: str, prompt: list[int], with_ids: bool) -> None:
        self.chat = chat
        self.model = model
        self.prompt = prompt
        self.with_ids = with_ids  # return_token_ids
        self.cached: int | None = None  # reused from the prefix cache, when told

    def head(self, obj: str) -> dict[str, object]:
        return {
            "id": "chatcmpl-standin" if self.chat else "cmpl-standin",
            "object": obj,
            "created": 0,
            "model": self.model,
        }

    def usage(self, generated: int) -> dict[str, object]:
        n = len(self.prompt)
        usage: dict[str, object] = {
            "prompt_tokens": n,
            "total_tokens": n + generated,
            "completion_tokens": generated,
        }
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    def completion(self, ids: list[int], finish: str) -> dict[str, object]:
        text = detokenize(ids)
        choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self.head("chat.completion" if self.chat else "text_completion")
        if self.with_ids:
            choice["token_ids"] = ids
            # vLLM: the chat response has them at the top, a completion in its choice
            (body if self.chat else choice)["prompt_token_ids"] = self.prompt
        body["choices"] = [choice]
        body["usage"] = self.usage(len(ids))
        return body

    def chunk(self, token: int | None, finish: str | None, first: bool) -> dict[str, object]:
        """A chunk with ``token`` (None: no token; in chat, the first one, the role's)."""
        choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish}
        piece = "" if token is None else detokenize([token])
        if not self.chat:
            choice["text"] = piece
        elif token is None and finish is None:
            choice["delta"] = {"role": "assistant", "content": ""}
        else:
            choice["delta"] = {"content": piece}
        body = self.head("chat.completion.chunk" if self.chat else "text_completion")
        if self.with_ids:
            if token is not None or finish is not None:
                choice["token_ids"] = [] if token is None else [token]
            if first:
                # vLLM: the chat stream's first chunk has them at the top, a
                # completions stream's first chunk in its choice
                (body if self.chat else choice)["prompt_token_ids"] = self.prompt
        body["choices"] = [choice]
        return body

    def usage_chunk(self, generated: int) -> dict[str, object]:
        body = self.head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(generated)
        return body


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
    server.state = State(
        args.served_model_name or [args.model],
        args.max_model_len,
        caching=args.enable_prefix_caching,
        details=args.enable_prompt_tokens_details,
        sleep_mode=args.enable_sleep_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
    )
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

"""A fast stand-in OpenAI-compatible engine for ``tools/bench_router.py``.

One asyncio process (uvloop when importable), an httptools parser, canned
bytes: cheap enough that the proxies in front of it are the bottleneck.

- ``POST /v1/chat/completions`` (and ``/v1/completions``): a canned
  ``chat.completion`` JSON body; with ``"stream": true`` in the body, 16 SSE
  chunks (chunked transfer encoding) then ``data: [DONE]``. The pacing of
  streams is process-wide: ``POST /_bench/pace?ms=10`` sends each chunk
  10 ms after the last (the first one at once); ``ms=0`` sends all at once.
- ``GET /v1/models``, ``GET /metrics``, ``GET /health``.

    python -m tools.bench_router_engine PORT_FILE      # writes the port it bound
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time

import httptools

CHUNKS = 16
MODEL = "tiny"
_pace_s = 0.0


def _completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello " * 8},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
        },
        separators=(",", ":"),
    ).encode()


def _chunk(i: int) -> bytes:
    delta = {"role": "assistant", "content": ""} if i == 0 else {"content": "tok "}
    data = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": "length" if i == CHUNKS - 1 else None,
                }
            ],
        },
        separators=(",", ":"),
    ).encode()
    event = b"data: " + data + b"\n\n"
    if i == CHUNKS - 1:
        event += b"data: [DONE]\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


BODY = _completion()
JSON_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)
)
JSON_RESPONSE = JSON_HEAD + BODY
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
SSE_CHUNKS = [_chunk(i) for i in range(CHUNKS)]
SSE_ALL = SSE_HEAD + b"".join(SSE_CHUNKS) + b"0\r\n\r\n"
MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "x"}]}
).encode()
METRICS = b"# stand-in engine\n"


def _simple(status: bytes, ctype: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )


class Engine(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.queue: list[tuple[bytes, bytes, bytes]] = []  # pipelined requests, in order
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        self.queue.append((method, url, body))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        global _pace_s
        t = self.transport
        while self.queue and t is not None and not t.is_closing():
            method, url, body = self.queue.pop(0)
            path = url.split(b"?", 1)[0]
            if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
                compact = body.replace(b" ", b"")
                if b'"stream":true' in compact:
                    if _pace_s <= 0:
                        t.write(SSE_ALL)
                        continue
                    self.busy = True
                    asyncio.get_running_loop().create_task(self._paced())
                    return
                t.write(JSON_RESPONSE)
            elif path == b"/v1/models":
                t.write(_simple(b"200 OK", b"application/json", MODELS))
            elif path == b"/metrics":
                t.write(_simple(b"200 OK", b"text/plain", METRICS))
            elif path == b"/health":
                t.write(_simple(b"200 OK", b"application/json", b'{"status":"ok"}'))
            elif path == b"/_bench/pace":
                query = url.partition(b"?")[2].decode()
                _pace_s = float(dict(p.split("=", 1) for p in query.split("&") if p)["ms"]) / 1e3
                t.write(_simple(b"200 OK", b"text/plain", b"ok"))
            else:
                t.write(_simple(b"404 Not Found", b"text/plain", b"not found"))

    async def _paced(self) -> None:
        t = self.transport
        assert t is not None
        t.write(SSE_HEAD + SSE_CHUNKS[0])
        for chunk in SSE_CHUNKS[1:]:
            await asyncio.sleep(_pace_s)
            if t.is_closing():
                return
            t.write(chunk)
        t.write(b"0\r\n\r\n")
        self.busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(Engine, sock=sock, backlog=1024)
    await asyncio.Event().wait()


def main(port_file: str) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(sock))
    else:
        uvloop.run(serve(sock))


if __name__ == "__main__":
    main(sys.argv[1])

"""The Python ceiling for ``tools/bench_router.py``: a minimal uvicorn + aiohttp proxy.

A bare ASGI app (no framework) that forwards the request body to one
upstream over a keep-alive aiohttp session and relays the response as it
arrives, chunk by chunk. No auth, no routing, no retries: the least a
Python proxy does, on uvicorn with uvloop and httptools.

    python -m tools.bench_router_proxy PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn

UPSTREAM = sys.argv[2].rstrip("/") if len(sys.argv) > 2 else "http://127.0.0.1:8000"
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}
_session: aiohttp.ClientSession | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _session
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
                _session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if _session is not None:
                    await _session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    assert scope["type"] == "http" and _session is not None
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in _HOP}
    url = UPSTREAM + scope["path"]
    async with _session.request(scope["method"], url, data=body, headers=headers) as r:
        out = [
            (k.lower().encode(), v.encode())
            for k, v in r.headers.items()
            if k.lower().encode() not in _HOP
        ]
        await send({"type": "http.response.start", "status": r.status, "headers": out})
        async for chunk in r.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="on",
    )

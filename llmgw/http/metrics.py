"""``GET /metrics`` for Prometheus, behind its own read-only token or none.

Every daemon's metrics listener is one of these: the server's ``[metrics]``,
an agent's ``[metrics]``, a standalone router's ``metrics_listen``. The token
is Prometheus's own (``token_file``): it can read metrics and nothing else,
never the admin token, which can drain nodes.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw.http.types import Handler, Request, Response

_TEXT = [("content-type", "text/plain")]


def registry_page(registry: CollectorRegistry) -> Callable[[], Awaitable[bytes]]:
    """``metrics_app``'s ``render`` for one registry, as it is at each request."""

    async def render() -> bytes:
        return generate_latest(registry)

    return render


def metrics_app(
    render: Callable[[], Awaitable[bytes]],
    token: str = "",
    sd: Callable[[], bytes] | None = None,
    engine: Callable[[str], Awaitable[bytes | None]] | None = None,
) -> Handler:
    """A handler for ``GET /metrics`` answering ``await render()``; with ``token``,
    only to a request that carries ``Authorization: Bearer <token>``. With ``sd``,
    ``GET /sd`` answers Prometheus's HTTP service discovery (``http_sd_configs``)
    with ``sd()``, behind the same token. With ``engine``, ``GET /engines/ID/metrics``
    answers ``await engine(ID)`` (an agent passing on its engines' pages; None: 404)."""
    expected = f"Bearer {token}".encode()
    paths = ("/metrics", "/sd") if sd is not None else ("/metrics",)

    async def handler(request: Request) -> Response:
        shard = _engine_path(request.path) if engine is not None else None
        if (request.path not in paths and shard is None) or request.method not in (
            "GET",
            "HEAD",
        ):
            return Response(404, _TEXT, f"only {' and '.join(paths)} here\n".encode())
        if token and not hmac.compare_digest(
            (request.headers.get("authorization") or "").encode(), expected
        ):
            return Response(
                401,
                [*_TEXT, ("www-authenticate", 'Bearer realm="metrics"')],
                b"metrics need this listener's token: Authorization: Bearer <token_file's>\n",
            )
        if shard is not None and engine is not None:
            page = await engine(shard)
            if page is None:
                return Response(404, _TEXT, b"no Ready engine of that shard here\n")
            return Response(200, [("content-type", CONTENT_TYPE_LATEST)], page)
        if request.path == "/sd" and sd is not None:
            return Response(200, [("content-type", "application/json")], sd())
        return Response(200, [("content-type", CONTENT_TYPE_LATEST)], await render())

    return handler


def _engine_path(path: str) -> str | None:
    """The shard id in ``/engines/ID/metrics``, else None."""
    parts = path.split("/")
    if len(parts) == 4 and parts[1] == "engines" and parts[3] == "metrics" and parts[2]:
        return parts[2]
    return None

"""``GET /metrics`` for Prometheus, behind its own read-only token or none.

Every daemon's metrics listener is one of these: the server's ``[metrics]``,
an agent's ``[metrics]``, a standalone router's ``metrics_listen``. The token
is Prometheus's own (``token_file``): it can read metrics and nothing else,
never the admin token, which can drain nodes.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from llmgw.http.types import Handler, Request, Response

_TEXT = [("content-type", "text/plain")]


def metrics_app(
    render: Callable[[], Awaitable[bytes]],
    token: str = "",
    sd: Callable[[], bytes] | None = None,
) -> Handler:
    """A handler for ``GET /metrics`` answering ``await render()``; with ``token``,
    only to a request that carries ``Authorization: Bearer <token>``. With ``sd``,
    ``GET /sd`` answers Prometheus's HTTP service discovery (``http_sd_configs``)
    with ``sd()``, behind the same token."""
    expected = f"Bearer {token}".encode()
    paths = ("/metrics", "/sd") if sd is not None else ("/metrics",)

    async def handler(request: Request) -> Response:
        if request.path not in paths or request.method not in ("GET", "HEAD"):
            return Response(404, _TEXT, f"only {' and '.join(paths)} here\n".encode())
        if token and not hmac.compare_digest(
            (request.headers.get("authorization") or "").encode(), expected
        ):
            return Response(
                401,
                [*_TEXT, ("www-authenticate", 'Bearer realm="metrics"')],
                b"metrics need this listener's token: Authorization: Bearer <token_file's>\n",
            )
        if request.path == "/sd" and sd is not None:
            return Response(200, [("content-type", "application/json")], sd())
        return Response(200, [("content-type", CONTENT_TYPE_LATEST)], await render())

    return handler

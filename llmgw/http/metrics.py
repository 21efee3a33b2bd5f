"""``GET /metrics`` for Prometheus, behind its own read-only token or none.

Every daemon's metrics listener is one of these: the server's ``[metrics]``,
an agent's ``[metrics]``, a standalone router's ``metrics_listen``. The token
is Prometheus's own (``token_file``): it can read metrics and nothing else,
never the admin token, which can drain nodes.

Every request is judged by its head (``MetricsApp.admit``, which the HTTP
server calls before it reads any byte of a body): a wrong path, a method
other than GET or HEAD, a missing or wrong token, or a body at all is
answered there, and a body that was coming is never read. A listener that
only serves GET holds nothing for whoever can reach it.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.http.server import HttpServer
from llmgw.http.types import Request, Response, admission

_TEXT = [("content-type", "text/plain")]


def registry_page(registry: CollectorRegistry) -> Callable[[], Awaitable[bytes]]:
    """``metrics_app``'s ``render`` for one registry, as it is at each request."""

    async def render() -> bytes:
        return generate_latest(registry)

    return render


class MetricsApp:
    """The handler (and ``admit``) of a metrics listener; see ``metrics_app``."""

    def __init__(
        self,
        render: Callable[[], Awaitable[bytes]],
        token: str = "",
        sd: Callable[[], bytes] | None = None,
        engine: Callable[[str], Awaitable[bytes | None]] | None = None,
    ) -> None:
        self.render = render
        self.token = token
        self.sd = sd
        self.engine = engine
        self._expected = f"Bearer {token}".encode()
        self._paths = ("/metrics", "/sd") if sd is not None else ("/metrics",)

    def admit(self, request: Request) -> Response | str:
        """Judge a request by its head: an answer, or the shard id of an engine's page
        ("" for the listener's own pages)."""
        shard = _engine_path(request.path) if self.engine is not None else None
        if request.path not in self._paths and shard is None:
            return Response(404, _TEXT, f"only {' and '.join(self._paths)} here\n".encode())
        if request.method not in ("GET", "HEAD"):
            return Response(
                405,
                [*_TEXT, ("allow", "GET, HEAD")],
                f"{request.path} takes GET\n".encode(),
            )
        if self.token:
            if not hmac.compare_digest(
                (request.headers.get("authorization") or "").encode(), self._expected
            ):
                return Response(
                    401,
                    [*_TEXT, ("www-authenticate", 'Bearer realm="metrics"')],
                    b"metrics need this listener's token: Authorization: Bearer <token_file's>\n",
                )
            request.principal = "metrics"
        if _has_body(request):
            return Response(413, _TEXT, b"this listener takes no request body\n")
        return shard or ""

    async def __call__(self, request: Request) -> Response:
        shard = admission(request, self.admit)
        if isinstance(shard, Response):
            return shard
        if shard and self.engine is not None:
            page = await self.engine(shard)
            if page is None:
                return Response(404, _TEXT, b"no Ready engine of that shard here\n")
            return Response(200, [("content-type", CONTENT_TYPE_LATEST)], page)
        if request.path == "/sd" and self.sd is not None:
            return Response(200, [("content-type", "application/json")], self.sd())
        return Response(200, [("content-type", CONTENT_TYPE_LATEST)], await self.render())


def metrics_app(
    render: Callable[[], Awaitable[bytes]],
    token: str = "",
    sd: Callable[[], bytes] | None = None,
    engine: Callable[[str], Awaitable[bytes | None]] | None = None,
) -> MetricsApp:
    """A handler for ``GET /metrics`` answering ``await render()``; with ``token``,
    only to a request that carries ``Authorization: Bearer <token>``. With ``sd``,
    ``GET /sd`` answers Prometheus's HTTP service discovery (``http_sd_configs``)
    with ``sd()``, behind the same token. With ``engine``, ``GET /engines/ID/metrics``
    answers ``await engine(ID)`` (an agent passing on its engines' pages; None: 404).
    Serve it with its ``admit`` (``HttpServer(app, admit=app.admit)``) so that every
    refusal is made from the head, before any body is read."""
    return MetricsApp(render, token, sd, engine)


def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return bool(length and length.strip() != "0") or "transfer-encoding" in request.headers


def _engine_path(path: str) -> str | None:
    """The shard id in ``/engines/ID/metrics``, else None."""
    parts = path.split("/")
    if len(parts) == 4 and parts[1] == "engines" and parts[3] == "metrics" and parts[2]:
        return parts[2]
    return None


class _ListenersCollector(Collector):
    def __init__(self, servers: Mapping[str, HttpServer]) -> None:
        self._servers = servers

    def collect(self) -> Iterable[Metric]:
        connections = GaugeMetricFamily(
            "llmgw_http_connections", "Connections open now", labels=["listener"]
        )
        limit = GaugeMetricFamily(
            "llmgw_http_max_connections",
            "Connections the listener takes (max_connections, as cut to the open-files limit)",
            labels=["listener"],
        )
        bodies = GaugeMetricFamily(
            "llmgw_http_body_bytes",
            "Request body bytes held now (max_bodies_mb, shared per key and per address)",
            labels=["listener"],
        )
        cuts = CounterMetricFamily(
            "llmgw_http_cut",
            "Connections and requests refused or cut so that one client cannot take what"
            " others need, by reason",
            labels=["listener", "reason"],
        )
        for name, server in self._servers.items():
            connections.add_metric([name], server.open_connections)
            limit.add_metric([name], server.limits.max_connections)
            bodies.add_metric([name], server.body_bytes)
            for reason, n in server.cuts().items():
                cuts.add_metric([name, reason], n)
        return [connections, limit, bodies, cuts]


def watch_listeners(registry: CollectorRegistry, servers: Mapping[str, HttpServer]) -> None:
    """Export what each of ``servers`` (by listener name) holds and has cut."""
    registry.register(_ListenersCollector(dict(servers)))

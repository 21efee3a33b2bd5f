"""Routes of the management API.

Everything but ``/healthz`` needs ``Authorization: Bearer <admin token>``,
compared in constant time. The API is plain request/response over the
project's HTTP server; it holds no state of its own and reads the control
plane's under no await.
"""

from __future__ import annotations

import hmac

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmgw.admin.views import GpuViews, node_view
from llmgw.controlplane.fabrics import fleet_status
from llmgw.controlplane.service import ControlPlane
from llmgw.http import Request, Response

_JSON = [("content-type", "application/json")]


def json_response(status: int, body: object) -> Response:
    return Response(status=status, headers=list(_JSON), body=msgspec.json.encode(body))


def error(status: int, message: str) -> Response:
    return json_response(status, {"error": {"message": message, "code": status}})


class AdminApi:
    def __init__(self, control: ControlPlane, token: str) -> None:
        if not token:
            raise ValueError("the admin API needs a token")
        self.control = control
        self._token = token.encode()
        self._gpu_views = GpuViews()
        self._routes = {
            ("GET", "/v1/nodes"): self.nodes,
            ("GET", "/v1/status"): self.status,
            ("GET", "/metrics"): self.metrics,
        }

    async def __call__(self, request: Request) -> Response:
        if request.path == "/healthz":
            return json_response(200, {"status": "ok"})
        route = self._routes.get((request.method, request.path))
        if route is None:
            if any(path == request.path for _, path in self._routes):
                return error(405, f"{request.method} is not allowed on {request.path}")
            return error(404, f"no such endpoint: {request.path}")
        if not self._authorized(request):
            return error(401, "missing or wrong admin token (send Authorization: Bearer <token>)")
        return await route(request)

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization") or ""
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(credential.strip().encode(), self._token)

    async def nodes(self, request: Request) -> Response:
        views = [
            node_view(n, self._gpu_views)
            for n in sorted(self.control.nodes.nodes.values(), key=lambda n: n.node_id)
        ]
        return json_response(200, {"nodes": views})

    async def status(self, request: Request) -> Response:
        return json_response(200, fleet_status(self.control.nodes.nodes.values()))

    async def metrics(self, request: Request) -> Response:
        body = generate_latest(self.control.metrics.registry)
        return Response(status=200, headers=[("content-type", CONTENT_TYPE_LATEST)], body=body)

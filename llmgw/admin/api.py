"""Routes of the management API.

Everything but ``/healthz`` needs ``Authorization: Bearer <admin token>``,
compared in constant time. The API is plain request/response over the
project's HTTP server; it holds no state of its own and reads the control
plane's under no await.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmgw.admin.answers import error, json_body, json_response
from llmgw.admin.reload import NotReloaded, Reloaded, Reloader
from llmgw.admin.tenancy import ArgHandler, Handler, TenancyApi
from llmgw.admin.views import (
    ConsoleInfo,
    FetchingView,
    GpuViews,
    IntentAnswer,
    ModelList,
    ModelView,
    NodeList,
    NodeWeights,
    PrefetchAnswer,
    ReloadAnswer,
    ReplicaList,
    ScaleAnswer,
    SkippedNode,
    WeightsList,
    failure_view,
    node_view,
    placement_view,
    replica_view,
    running_view,
    scaling_view,
)
from llmgw.bench.kept import BenchStore
from llmgw.config.errors import one_line
from llmgw.controlplane.fabrics import CannotPlace, fleet_status
from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.followers import ReportRefused, RouterReports
from llmgw.controlplane.replicas import Replica, ReplicaState
from llmgw.controlplane.routing import RoutingPublisher
from llmgw.controlplane.service import ControlPlane
from llmgw.controlplane.usage import UsageRefused
from llmgw.controlplane.usage import check as check_usage
from llmgw.http import Request, Response, admission
from llmgw.routing import REPORT_PATH, RouterReport, TrafficView
from llmgw.version import describe

log = logging.getLogger("llmgw.admin")

_JSON = [("content-type", "application/json")]


class AdminApi:
    def __init__(
        self,
        control: ControlPlane,
        token: str,
        fleet: FleetManager | None = None,
        routing: RoutingPublisher | None = None,
        traffic: Callable[[float], Mapping[str, TrafficView]] | None = None,
        reload: Callable[[], Awaitable[Reloaded]] | None = None,
        routers: RouterReports | None = None,
        tenancy: TenancyApi | None = None,
        benches: BenchStore | None = None,
    ) -> None:
        """``reload`` reads again what the server can change without a restart (the
        catalog, the API keys); without it a reload is the fleet's catalog alone."""
        if reload is None and fleet is not None:
            reload = Reloader(fleet, None, None)
        if not token:
            raise ValueError("the admin API needs a token")
        self.control = control
        self.fleet = fleet
        self._reload = reload
        if routing is None:
            routing = fleet.routing if fleet is not None else RoutingPublisher()
        self._routing = routing
        if routers is None:
            routers = fleet.routers if fleet is not None else RouterReports()
        self.routers = routers  # what the routers that follow the routing report
        self._traffic = traffic  # the in-process router's view of each replica
        self._token = token.encode()
        self._gpu_views = GpuViews()
        self.benches = benches  # what ``ctl bench`` sent, for the console
        self.console = ConsoleInfo(on=False)  # where the web console listens (``serve``)
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/v1/nodes"): self.nodes,
            ("GET", "/v1/status"): self.status,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/v1/replicas"): self.replicas,
            ("GET", "/v1/models"): self.models,
            ("GET", "/v1/weights"): self.weights,
            ("POST", "/v1/catalog/reload"): self.reload,
            ("GET", "/v1/routing"): self.routing,
            ("POST", REPORT_PATH): self.router_report,
            ("POST", "/v1/bench"): self.bench,
            ("GET", "/v1/console"): self.console_info,
        }
        # /v1/nodes/{node} (POST {"intent": ...}) and /v1/models/{model}/placement (GET)
        self._patterns: list[tuple[str, tuple[str | None, ...], ArgHandler]] = [
            ("POST", ("v1", "nodes", None), self.node_intent),
            ("POST", ("v1", "models", None, "scale"), self.scale),
            ("POST", ("v1", "models", None, "prefetch"), self.prefetch),
            ("GET", ("v1", "models", None, "placement"), self.placement),
        ]
        self._tenancy = tenancy
        if tenancy is not None:  # tenants and their keys (``tenancy``)
            self._routes.update(tenancy.routes())
            self._patterns.extend(tenancy.patterns())

    def admit(self, request: Request) -> Response | bool:
        """Judge a request by its head, before any byte of its body is read: without
        the token every path looks the same (the routes are not listed to whoever
        can reach the listener), and nothing it sends is kept."""
        if request.path == "/healthz":
            return json_response(200, {"status": "ok"})
        if not self._authorized(request):
            return error(401, "missing or wrong admin token (send Authorization: Bearer <token>)")
        request.principal = "admin"
        return True

    async def __call__(self, request: Request) -> Response:
        answer = admission(request, self.admit)
        if isinstance(answer, Response):
            return answer
        route = self._routes.get((request.method, request.path))
        arg = ""
        if route is None:
            route, arg = self._match(request)
        if route is None:
            if any(path == request.path for _, path in self._routes):
                return error(405, f"{request.method} is not allowed on {request.path}")
            return error(404, f"no such endpoint: {request.path}")
        if arg:
            return await route(request, arg)  # type: ignore[call-arg]
        return await route(request)

    def _match(self, request: Request) -> tuple[Any, str]:
        parts = tuple(p for p in request.path.split("/") if p)
        for method, pattern, handler in self._patterns:
            if method != request.method or len(parts) != len(pattern):
                continue
            if all(want is None or want == got for want, got in zip(pattern, parts, strict=True)):
                arg = next(got for want, got in zip(pattern, parts, strict=True) if want is None)
                return handler, arg
        return None, ""

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization") or ""
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(credential.strip().encode(), self._token)

    async def nodes(self, request: Request) -> Response:
        fleet = self.fleet
        shards = Counter(s.node_id for r in fleet.replicas() for s in r.shards) if fleet else {}
        views = []
        for n in sorted(self.control.nodes.nodes.values(), key=lambda n: n.node_id):
            view = node_view(n, self._gpu_views)
            if fleet is not None:
                view.cordoned = fleet.is_cordoned(n.node_id)
                view.draining = fleet.is_draining(n.node_id)
                view.drained = fleet.is_drained(n.node_id)
                view.shards = shards.get(n.node_id, 0)
            views.append(view)
        return json_response(200, NodeList(nodes=views, server_version=describe()))

    def _need_fleet(self) -> FleetManager | Response:
        if self.fleet is None:
            return error(409, "this server runs no control plane (its catalog has no profiles)")
        return self.fleet

    async def replicas(self, request: Request) -> Response:
        fleet = self._need_fleet()
        if isinstance(fleet, Response):
            return fleet
        now = trio.current_time()
        traffic = {} if self._traffic is None else self._traffic(now)
        views = [
            replica_view(r, now, traffic.get(r.replica_id))
            for r in sorted(fleet.replicas(), key=lambda r: (r.model, r.replica_id))
        ]
        return json_response(200, ReplicaList(replicas=views))

    async def models(self, request: Request) -> Response:
        """One row per catalog model: wanted, ready, starting, failed; where; why not."""
        fleet = self._need_fleet()
        if isinstance(fleet, Response):
            return fleet
        wall = time.time()
        by_model: dict[str, list[Replica]] = {}
        for r in fleet.replicas():
            by_model.setdefault(r.model, []).append(r)
        views = []
        unplaceable = fleet.unplaceable()
        weights_missing = fleet.weights_missing()
        for name in sorted(fleet.catalog.models):
            model = fleet.catalog.models[name]
            mine = by_model.get(name, [])
            states = Counter(r.state for r in mine)
            ready = states[ReplicaState.READY]
            starting = states[ReplicaState.PENDING] + states[ReplicaState.STARTING]
            view = ModelView(
                model=name,
                wanted=fleet.scaling.wanted(model),
                ready=ready,
                starting=starting,
                failed=states[ReplicaState.FAILED],
                sleeping=states[ReplicaState.SLEEPING],
                outdated=sum(1 for r in mine if r.outdated and r.state is not ReplicaState.FAILED),
                nodes=sorted({s.node_id for r in mine for s in r.shards}),
                retry_in_s=fleet.crash_loop_wait(name),
                failures=[failure_view(f, wall) for f in fleet.failures.recent(name)],
                scaling=scaling_view(model, fleet.scaling, wall),
                fetching=[
                    FetchingView(replica_id=r.replica_id, node_id=s.node_id, progress=s.fetching)
                    for r in mine
                    for s in r.shards
                    if s.fetching is not None
                ],
            )
            if name in unplaceable:
                view.cannot_place, view.cannot_place_at = unplaceable[name]
            view.weights_missing = name in weights_missing
            views.append(view)
        return json_response(200, ModelList(models=views))

    async def scale(self, request: Request, model: str) -> Response:
        """Pin a ranged model's count (``{"replicas": N}``) or release it (``null``)."""
        fleet = self._need_fleet()
        if isinstance(fleet, Response):
            return fleet
        body = json_body(request, _ScaleBody, 'JSON like {"replicas": 2} (null: release)')
        if isinstance(body, Response):
            return body
        try:
            said = fleet.scale(model, body.replicas)
        except ValueError as exc:
            code = 404 if model not in fleet.catalog.models else 400
            return error(code, str(exc))
        return json_response(200, ScaleAnswer(model=model, pinned=body.replicas, message=said))

    async def weights(self, request: Request) -> Response:
        """What each node holds of weights, and what it is fetching."""
        nodes = [
            NodeWeights(
                node_id=n.node_id,
                state=n.state.value,
                fabric=n.inventory.fabric,
                weights_dir=n.inventory.weights_dir,
                budget_bytes=n.inventory.weights_budget_bytes,
                copies=list(n.inventory.weights),
                fetching=list(n.inventory.fetching),
            )
            for n in sorted(self.control.nodes.nodes.values(), key=lambda n: n.node_id)
        ]
        return json_response(200, WeightsList(nodes=nodes))

    async def prefetch(self, request: Request, model: str) -> Response:
        """Warm nodes with a model's weights (``{"fabric": F, "nodes": [...]}``, both
        optional: every node)."""
        fleet = self._need_fleet()
        if isinstance(fleet, Response):
            return fleet
        body = json_body(request, _PrefetchBody, 'JSON like {"fabric": "ib0"} or {}')
        if isinstance(body, Response):
            return body
        try:
            done = fleet.prefetch(model, fabric=body.fabric, nodes=body.nodes)
        except ValueError as exc:
            code = 404 if model not in fleet.catalog.models else 400
            return error(code, str(exc))
        profile = fleet.catalog.profile(model, done.profile)
        return json_response(
            200,
            PrefetchAnswer(
                model=model,
                profile=done.profile,
                source=profile.source if profile is not None else "",
                nodes=[f.node for f in done.fetches],
                skipped=[SkippedNode(node_id=n, why=why) for n, why in done.skipped],
            ),
        )

    async def node_intent(self, request: Request, node_id: str) -> Response:
        fleet = self._need_fleet()
        if isinstance(fleet, Response):
            return fleet
        body = json_body(request, _IntentBody, 'JSON like {"intent": "drain"}')
        if isinstance(body, Response):
            return body
        if node_id not in self.control.nodes.nodes:
            return error(404, f"no node {node_id!r} has ever registered")
        try:
            what = fleet.set_intent(node_id, body.intent)
        except ValueError as exc:
            return error(400, str(exc))
        answer = IntentAnswer(node_id=node_id, intent=body.intent, message=what)
        if body.intent == "drain":  # how long `ctl drain --wait` waits by default
            answer.drain_bound_s = fleet.reconciler.timing.drain_bound_s()
        return json_response(200, answer)

    async def placement(self, request: Request, model: str) -> Response:
        fleet = self._need_fleet()
        if isinstance(fleet, Response):
            return fleet
        decision = fleet.explain(model)
        if decision is None:
            return error(404, f"no model {model!r} in the catalog")
        running = sorted((r for r in fleet.replicas() if r.model == model), key=_by_id)
        # where a new one would go, and where the existing ones run now
        return json_response(200, placement_view(decision, [running_view(r) for r in running]))

    async def routing(self, request: Request) -> Response:
        """The routing table, as a watch: with ``since=<version>`` and ``wait=<s>`` it
        answers as soon as the table differs from that version, or after the wait."""
        params = parse_qs(request.query)
        since = params.get("since", [""])[0]
        try:
            wait = float(params.get("wait", ["0"])[0])
        except ValueError:
            wait = math.nan
        if not math.isfinite(wait):  # nan would wait forever, inf is not a number of seconds
            return error(400, "wait must be a number of seconds")
        wait = min(max(wait, 0.0), 30.0)
        routing = self._routing
        # a router older than ``RouterReport`` reports with every poll, as parameters of
        # it (taken until the release after this one)
        metrics, router = params.get("metrics", [""])[0], params.get("router", [""])[0]
        if metrics or router:
            said = params.get("wedged", [""])[0]
            report = RouterReport(
                router=router, metrics=metrics, wedged=[r for r in said.split(",") if r]
            )
            try:
                self.routers.take(report, request.client[0], trio.current_time())
            except ReportRefused as exc:
                return error(400, str(exc))
        fleet = self.fleet
        # a router that says it carries (``llmgw.routing.carried``) keeps the routes of
        # nodes not heard from yet by itself, and takes the table at once
        carries = params.get("carry", [""])[0] == "1"
        if since and fleet is not None and routing.snapshot.version != since and not carries:
            # A router that holds a table keeps it while agents come back to a control
            # plane that just started: until they have, its table lacks their replicas,
            # and a router that took it would refuse every request for them.
            left = fleet.settling_s()
            if left > wait:
                return error(503, f"starting: agents come back for another {left:.1f} s")
            if left > 0:
                await trio.sleep(left)
                wait -= left
        if routing.snapshot.version == since:
            with trio.move_on_after(wait):
                await routing.next(since)
        return Response(status=200, headers=list(_JSON), body=routing.body)

    async def router_report(self, request: Request) -> Response:
        """A standalone router's ``RouterReport``: where its metrics are, what it holds
        wedged (``followers``)."""
        report = json_body(request, RouterReport, "a router report, as JSON")
        if isinstance(report, Response):
            return report
        try:
            check_usage(report.usage)
            self.routers.take(report, request.client[0], trio.current_time())
        except (ReportRefused, UsageRefused) as exc:
            return error(400, str(exc))
        if self._tenancy is not None and report.router and report.usage:
            self._tenancy.ledger.take(report.router, report.usage, time.time())
        return Response(status=204, headers=[], body=b"")

    async def reload(self, request: Request) -> Response:
        reload = self._reload
        if reload is None:  # no fleet and no router: nothing to reload
            refused = self._need_fleet()
            assert isinstance(refused, Response)
            return refused
        try:
            what = await reload()
        except NotReloaded as exc:
            log.error("%s", exc)
            return error(400, str(exc))
        except Exception as exc:  # a reload never takes the server down
            log.error("not reloaded, nothing changed: %s", one_line(exc))
            log.debug("the reload failed here", exc_info=True)
            return error(500, f"not reloaded, nothing changed: {one_line(exc)}")
        return json_response(200, ReloadAnswer(message=what.message, warnings=what.warnings))

    async def console_info(self, request: Request) -> Response:
        return json_response(200, self.console)

    async def bench(self, request: Request) -> Response:
        """Keep a run ``ctl bench`` finished, for the console's curves."""
        if self.benches is None:
            return error(409, "this server keeps no bench results (it has no state directory)")
        try:
            run = self.benches.keep(request.body)
        except ValueError as exc:
            return error(400, str(exc))
        except OSError as exc:
            return error(500, f"cannot keep the bench result: {exc.strerror or exc}")
        log.info(
            "kept a bench result of %s (%s, %d levels, capacity %s) for the console",
            run.model,
            run.profile or "?",
            len(run.levels),
            run.capacity if run.capacity is not None else "none",
        )
        return json_response(200, {"message": f"kept for the console's page of {run.model}"})

    async def status(self, request: Request) -> Response:
        """Weights per fabric; with a control plane, also what it cannot place and the
        catalog models whose weights no node holds."""
        status = fleet_status(self.control.nodes.nodes.values())
        fleet = self.fleet
        if fleet is not None:
            status.cannot_place = [
                CannotPlace(model=name, why=why, since=at)
                for name, (why, at) in fleet.unplaceable().items()
            ]
            status.warnings.extend(fleet.weights_missing().values())
            # a range held below its demand while another model's floor waits for room
            status.warnings.extend(
                fleet.scaling.yielding[m] for m in sorted(fleet.scaling.yielding)
            )
        return json_response(200, status)

    async def metrics(self, request: Request) -> Response:
        body = generate_latest(self.control.metrics.registry)
        return Response(status=200, headers=[("content-type", CONTENT_TYPE_LATEST)], body=body)


class _IntentBody(msgspec.Struct):
    intent: str


class _PrefetchBody(msgspec.Struct, forbid_unknown_fields=True):
    fabric: str = ""
    nodes: list[str] = []


class _ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int | None


def _by_id(r: Replica) -> str:
    return r.replica_id

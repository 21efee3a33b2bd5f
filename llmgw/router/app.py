"""The OpenAI-compatible endpoint: authenticate, find the model, hand the request on.

A request is judged first by its head alone (``admit``, which the HTTP
server calls before it keeps any byte of the body): the endpoint, the
method and the API key (hashed keys, each optionally limited to some
models). Everything that needs no body is answered there: a request without
a good key gets its 401 with none of its body read, however much it sends,
so a client without a key cannot make the server hold memory. A key limited
to models none of which the table knows is answered 403 there too, its body
unread: whatever model the body names, it could not be routed. Only then is
the body read (its bytes shared fairly per key and per address, see
``llmgw.http``), and its JSON only for ``model`` and ``stream`` (the body is
forwarded as is), and for what engines are known to choke on (``guards``: JSON
nested too deep, a grammar or schema too deep or too large), which is refused
with a 400 that names the field and the limit. A model the table does not know is 404; one it knows that
the key may not use is 403. A key that has expired is 401, and says when. A
key of a tenant is held to its tenant's limits and its own (``quota``): past
one, 429 with ``Retry-After`` and the limit named, its body unread; within,
the answer carries OpenAI's ``x-ratelimit-*`` headers for a per-minute limit. A
model the key may use and the table knows is routed: ``Proxy`` sends it to a
replica and says what the client gets.

Each request has one ``Record``, opened as its head is admitted and ended
exactly once: at once for an answer from the head, here for a whole reply,
by the relay for a relayed body, here again (status 499) when the client
left before any response. The HTTP server cancels the handler the moment the
client disconnects, or closes the relayed body; either way the upstream
connection is closed at once, so an engine that notices (vLLM; llama-server
while streaming) stops generating for a client that is gone, and the replica
stops counting the request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import trio

from llmgw.http import Request, Response, admission
from llmgw.http.client import UpstreamPool
from llmgw.router import guards
from llmgw.router.balancer import RetryBudget
from llmgw.router.errors import error_body, openai_error
from llmgw.router.hold import Holds
from llmgw.router.keys import ApiKey, KeyRing
from llmgw.router.leases import RETRY_S, WAIT_S, LeaseClient, Unreachable
from llmgw.router.metrics import RouterMetrics
from llmgw.router.proxy import Proxy
from llmgw.router.quota import Quotas, Refusal, Short, Ticket, ratelimit_headers
from llmgw.router.record import Record
from llmgw.router.relay import Relay
from llmgw.router.table import RoutingTable
from llmgw.router.tally import Tally
from llmgw.routing import LeaseAnswer, LeaseExchange

__all__ = ["ROUTES", "RouterApp", "error_body"]

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
# /healthz before the routing table came: not ready
UNHEARD_HEALTH = b'{"status":"starting","why":"no routing table from the control plane yet"}'


T = TypeVar("T")


class RouterApp:
    def __init__(
        self,
        table: RoutingTable,
        keys: KeyRing,
        pool: UpstreamPool | None = None,
        *,
        max_attempts: int = 3,
        metrics: RouterMetrics | None = None,
        queue_timeout_s: float = 0.0,
        access_log: bool = False,
        resume_streams: bool = True,
        limits: guards.Limits = guards.Limits(),  # noqa: B008 (frozen)
        tally: Tally | None = None,
        leases: LeaseClient | None = None,
        holds: Holds | None = None,
    ) -> None:
        self.table = table
        self.limits = limits
        self.keys = keys
        # what tenants' keys may spend here, from leases of the control plane's (none
        # given: no control plane, and a tenant's key past nothing is refused)
        self.leases = leases or LeaseClient(Quotas(), _nowhere, "alone")
        self.quotas = self.leases.quotas
        self.tally = tally or Tally()  # and what they used, for the control plane's ledger
        self.metrics = metrics or RouterMetrics()
        self.access_log = access_log
        self.proxy = Proxy(
            table,
            pool or UpstreamPool(),
            RetryBudget(max_attempts=max_attempts),
            queue_timeout_s,
            resume_streams=resume_streams,
            holds=holds,
        )
        self.metrics.watch(
            lambda: [e for eps in self.table.endpoints.values() for e in eps],
            self.table.rooms.sizes,
        )

    def admit(self, request: Request) -> Response | tuple[Record, ApiKey]:
        """Judge a request by its head (its body is not read yet): an answer, or
        the record and key of a request to read and route."""
        arrived = trio.current_time() if self.access_log else None
        record = Record(request, self.metrics, arrived)
        record.shares = self.proxy.shares
        verdict = self._head(request, record)
        if isinstance(verdict, Response):
            record.respond(verdict.status)
            record.end(trio.current_time())
            return verdict
        return record, verdict

    async def __call__(self, request: Request) -> Response:
        admitted = admission(request, self.admit)
        if isinstance(admitted, Response):
            return admitted
        record, key = admitted
        try:
            response = await self._route(request, record, key)
        except trio.Cancelled:
            record.left(trio.current_time())
            raise
        except Exception:
            if record.ticket is not None:  # the server answers 500; the tenant's count frees
                record.ticket.release(trio.current_time())
            raise
        if record.ticket is not None:
            response.headers.extend(record.ticket.headers())
        record.respond(response.status)
        if not isinstance(response.body, Relay):  # a relay ends the record when it ends
            record.end(trio.current_time())
        return response

    def _head(self, request: Request, record: Record) -> Response | ApiKey:
        """What the head alone decides: an answer, or the key of a request to route."""
        path = request.path
        if not self.table.heard.is_set() and (path in ROUTES or path.startswith("/v1/models")):
            return self._unheard()
        if path in ROUTES:
            if request.method != "POST":
                return openai_error(405, f"{path} takes POST")
            key = self._key(request, record)
            if isinstance(key, Response):
                return key
            if key.models and not any(self.table.known(m) for m in key.models):
                return openai_error(
                    403,
                    f"the API key {key.name!r} may use only models not served here"
                    f" ({', '.join(sorted(key.models))})",
                    code="model_not_allowed",
                )
            return self._admit(key, record)
        if path == "/healthz":
            if not self.table.heard.is_set():  # not ready: a load balancer sends it nothing
                return Response(503, [("content-type", "application/json")], UNHEARD_HEALTH)
            return Response(200, [("content-type", "application/json")], b'{"status":"ok"}')
        if path == "/v1/models" and request.method == "GET":
            key = self._key(request, record)
            if isinstance(key, Response):
                return key
            return self._models(key.models)
        if path.startswith("/v1/models/") and request.method == "GET":
            key = self._key(request, record)
            if isinstance(key, Response):
                return key
            # ids may hold a slash ("org/name"), sent as is or percent-encoded (the
            # server has decoded the path)
            name = path[len("/v1/models/") :]
            if not key.allows(name) and self.table.known(name):
                return self._not_allowed(key, name)
            return self._model(name, key.models)
        return openai_error(404, f"no such endpoint: {request.method} {path}")

    async def _route(self, request: Request, record: Record, key: ApiKey) -> Response:
        """A request with a good key for an endpoint that routes: read the model, send it on."""
        if record.short is not None:  # its head waits on a lease
            got = await self._lease(
                lambda: self.quotas.admit(key, self.table.tenants, trio.current_time()),
                record.short,
            )
            record.short = None
            if isinstance(got, Refusal):
                return self._over(got, key)
            self._admitted(got, key, record)
        body = guards.read(request.body, self.limits)
        if isinstance(body, guards.Refusal):
            self.metrics.refused.labels(body.why).inc()
            return openai_error(400, body.message, code=body.code, param=body.param)
        if not body.model:
            return openai_error(400, "the body names no model", code="missing_model")
        record.model = body.model  # as asked, known or not
        if not self.table.known(body.model):
            return openai_error(
                404, f"the model {body.model!r} does not exist", code="model_not_found"
            )
        if not key.allows(body.model):
            return self._not_allowed(key, body.model)
        ticket = record.ticket
        if ticket is not None and key.tenant:  # a tenant's tokens a minute, a day, a month
            t, size, bound = ticket, len(request.body), body.completion_bound
            over = self.quotas.reserve(t, size, bound, trio.current_time())
            if isinstance(over, Short):  # waits on a lease: no coroutine unless it does
                over = await self._lease(
                    lambda: self.quotas.reserve(t, size, bound, trio.current_time()), over
                )
            if over is not None:
                return self._over(over, key, body.model)
            ticket.tally, ticket.model = self.tally, body.model  # counted at its end
        record.route(trio.current_time())
        return await self.proxy(request, body.stream, record)

    def _key(self, request: Request, record: Record) -> ApiKey | Response:
        """The request's API key, if it holds a good one (the record gets its name);
        else the 401 that says why."""
        key = self.keys.check(request.headers.get("authorization"))
        if key is None:
            return self._unauthorized()
        record.key = key.name
        request.principal = key.name  # the HTTP server shares its budgets per key
        if key.tenant:
            record.tenant = key.tenant
        if key.expired(time.time()):
            assert key.expires is not None
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(key.expires))
            return openai_error(
                401,
                f"the API key {key.name!r} expired at {when}: ask for a new one "
                f"(llmgw ctl key create --tenant {key.tenant or '...'})",
                code="invalid_api_key",
            )
        return key

    def _admit(self, key: ApiKey, record: Record) -> ApiKey | Response:
        """``key`` if its tenant's limits and its own take one more request now (the
        record holds its ticket), else the 429 that names the limit (``quota``)."""
        if not key.tenant:
            return key
        held = self.quotas.admit(key, self.table.tenants, trio.current_time())
        if isinstance(held, Refusal):
            return self._over(held, key)
        if isinstance(held, Short):
            record.short = held  # judged again once an exchange went through (``_route``)
        else:
            self._admitted(held, key, record)
        return key

    def _admitted(self, ticket: Ticket, key: ApiKey, record: Record) -> None:
        self.metrics.tenant_requests.labels(key.tenant).inc()
        record.ticket = ticket

    async def _lease(
        self, judge: Callable[[], T | Refusal | Short], first: Short | None = None
    ) -> T | Refusal:
        """What ``judge`` says once it waits on no lease: each time it does, wait for an
        exchange with the control plane that asks for it, within ``WAIT_S`` in all."""
        deadline = trio.current_time() + WAIT_S
        got = judge() if first is None else first
        while isinstance(got, Short):
            failure = await self.leases.fill(got, deadline)
            if failure:
                return got.refusal(failure)
            got = judge()
            if isinstance(got, Short):
                if trio.current_time() >= deadline:
                    return got.denied() or got.refusal("the control plane did not answer in time")
                if got.waits():  # other routers give back what it needs within a second
                    await trio.sleep(RETRY_S)
        return got

    def _over(self, refusal: Refusal, key: ApiKey, model: str = "") -> Response:
        """A tenant's limit refuses the request: 429, the limit named, when to retry."""
        self.metrics.tenant_refused.labels(key.tenant, refusal.limit, refusal.scope).inc()
        self.tally.refused(key.tenant, model, refusal.limit)
        if refusal.budget:  # OpenAI's word for a quota spent
            r = openai_error(429, refusal.message, "insufficient_quota", code="insufficient_quota")
        else:
            kind = "requests" if refusal.limit in ("rpm", "in_flight") else "tokens"
            r = openai_error(429, refusal.message, kind, code="rate_limit_exceeded")
        r.headers.append(("retry-after", str(max(1, math.ceil(refusal.retry_after_s)))))
        r.headers.extend(ratelimit_headers(refusal))
        return r

    def _not_allowed(self, key: ApiKey, model: str) -> Response:
        """A model that exists, but not for this key: 403 (an unknown one is 404)."""
        return openai_error(
            403,
            f"the API key {key.name!r} may not use the model {model!r}"
            f" (it may use: {', '.join(sorted(key.models))})",
            code="model_not_allowed",
        )

    def _unheard(self) -> Response:
        """503 while the routing table has not come from the control plane yet: the
        models and the tenants' keys are not known, and a good key is not refused."""
        r = openai_error(
            503,
            "this router has not received the routing table from the control plane yet "
            "(it has just started, or cannot reach its admin_url): try again in a second",
            "server_error",
            code="router_starting",
        )
        r.headers.append(("retry-after", "1"))
        return r

    def _unauthorized(self) -> Response:
        return openai_error(
            401,
            "missing or invalid API key (send Authorization: Bearer <key>)",
            code="invalid_api_key",
        )

    def _listed(self, allowed: frozenset[str]) -> list[str]:
        """The models this key may use that have a replica taking requests now, or
        that start one when asked (a range of replicas, ``hold``)."""
        serving = {
            m
            for m, eps in self.table.endpoints.items()
            if any(e.ready and not e.draining for e in eps)
        }
        return sorted(m for m in serving | self.table.scales.keys() if not allowed or m in allowed)

    def _models(self, allowed: frozenset[str]) -> Response:
        data = [_model_object(m) for m in self._listed(allowed)]
        return Response(
            200,
            [("content-type", "application/json")],
            msgspec.json.encode({"object": "list", "data": data}),
        )

    def _model(self, name: str, allowed: frozenset[str]) -> Response:
        if name not in self._listed(allowed):
            return openai_error(404, f"the model {name!r} does not exist", code="model_not_found")
        return Response(
            200, [("content-type", "application/json")], msgspec.json.encode(_model_object(name))
        )


def _model_object(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}


async def _nowhere(ex: LeaseExchange) -> LeaseAnswer:
    raise Unreachable("this router follows no control plane")

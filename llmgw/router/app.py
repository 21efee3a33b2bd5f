"""The OpenAI-compatible endpoint: authenticate, choose a replica, relay the bytes.

Theory of operation
-------------------
A request is authenticated (hashed API keys, each optionally limited to
some models), its JSON read only for ``model`` (the body is forwarded as is),
and a replica chosen by load (``balancer.choose``). The request goes to the
engine over the lean keep-alive pool; until the first byte of a response has
been sent to the client, an upstream fault (connect error, reset, timeout,
502/503/504) is retried on another replica within a per-request cap and a
global budget. After that, the response is relayed as it arrives: a streamed
body chunk by chunk with no buffering, ``data: [DONE]`` and all.

The HTTP server cancels the handler the moment the client disconnects; the
relay's ``finally`` then closes the upstream connection at once, so the
engine stops generating for a client that is gone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
import trio

from llmgw.http import Request, Response
from llmgw.http.client import (
    ConnectFailed,
    UpstreamError,
    UpstreamPool,
    UpstreamReset,
    UpstreamResponse,
    UpstreamTimeout,
)
from llmgw.router.balancer import Admission, Endpoint, RetryBudget, choose
from llmgw.router.breaker import Outcome, classify
from llmgw.router.keys import KeyRing
from llmgw.router.metrics import RouterMetrics
from llmgw.router.table import RoutingTable

log = logging.getLogger("llmgw.router")

QUEUE_POLL_S = 0.05
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}
)


class _Body(msgspec.Struct):
    model: str = ""
    stream: bool = False


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Reply(msgspec.Struct):
    usage: _Usage | None = None


_decoder = msgspec.json.Decoder(_Body)
_reply_decoder = msgspec.json.Decoder(_Reply)


def openai_error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return Response(status, [("content-type", "application/json")], msgspec.json.encode(body))


def error_body(status: int, message: str) -> tuple[str, bytes]:
    """For errors the HTTP server answers itself (413, 400, 408): OpenAI's shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return "application/json", msgspec.json.encode(body)


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
    ) -> None:
        self.table = table
        self.keys = keys
        self.pool = pool or UpstreamPool()
        self.budget = RetryBudget(max_attempts=max_attempts)
        self.metrics = metrics or RouterMetrics()
        self.queue_timeout_s = queue_timeout_s
        self.metrics.watch(lambda: [e for eps in self.table.endpoints.values() for e in eps])

    async def __call__(self, request: Request) -> Response:
        if request.path == "/healthz":
            return Response(200, [("content-type", "application/json")], b'{"status":"ok"}')
        if request.path == "/v1/models" and request.method == "GET":
            key = self.keys.check(request.headers.get("authorization"))
            if key is None:
                return self._unauthorized()
            return self._models(key.models)
        if request.path not in ROUTES:
            return openai_error(404, f"no such endpoint: {request.method} {request.path}")
        if request.method != "POST":
            return openai_error(405, f"{request.path} takes POST")
        key = self.keys.check(request.headers.get("authorization"))
        if key is None:
            return self._unauthorized()
        try:
            body = _decoder.decode(request.body)
        except msgspec.DecodeError as exc:
            return openai_error(400, f"the body is not the JSON this endpoint takes: {exc}")
        if not body.model:
            return openai_error(400, "the body names no model", code="missing_model")
        if not key.allows(body.model) or not self.table.known(body.model):
            return openai_error(
                404, f"the model {body.model!r} does not exist", code="model_not_found"
            )
        started = trio.current_time()
        response, replica = await self._proxy(request, body, started)
        self.metrics.requests.labels(body.model, replica, str(response.status), key.name).inc()
        if isinstance(response.body, bytes):
            self.metrics.latency.labels(body.model).observe(trio.current_time() - started)
        return response

    def _unauthorized(self) -> Response:
        return openai_error(
            401,
            "missing or invalid API key (send Authorization: Bearer <key>)",
            code="invalid_api_key",
        )

    def _models(self, allowed: frozenset[str]) -> Response:
        names = sorted(
            m
            for m, eps in self.table.endpoints.items()
            if any(e.ready and not e.draining for e in eps) and (not allowed or m in allowed)
        )
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "llmgw"} for m in names]
        return Response(
            200,
            [("content-type", "application/json")],
            msgspec.json.encode({"object": "list", "data": data}),
        )

    async def _proxy(self, request: Request, body: _Body, started: float) -> tuple[Response, str]:
        """The response, and which replica gave it ("-": none)."""
        endpoints = self.table.endpoints.get(body.model, [])
        admission = self.table.admission.get(body.model, Admission())
        tried: set[str] = set()
        headers = [
            (k, v)
            for k, v in request.headers
            if k not in _HOP and k != "authorization" and k != "host"
        ]
        now = trio.current_time()
        self.budget.on_request(now)
        last_error = ""
        attempts = 0
        while True:
            now = trio.current_time()
            choice = choose(
                endpoints, now, admission=admission, exclude=frozenset(tried), model=body.model
            )
            ep = choice.endpoint
            if ep is None and choice.shed and trio.current_time() - started < self.queue_timeout_s:
                await trio.sleep(QUEUE_POLL_S)  # queue for a bounded time before shedding
                continue
            if ep is None:
                if choice.shed:
                    self.metrics.sheds.labels(body.model).inc()
                    r = openai_error(
                        429,
                        f"every replica of {body.model} is busy: {choice.reason}",
                        "rate_limit_error",
                    )
                    r.headers.append(("retry-after", str(max(1, round(choice.retry_after_s)))))
                    return r, "-"
                if last_error:
                    return self._upstream_failed(body.model, last_error), "-"
                why = f"no replica of {body.model} can take requests now: {choice.reason}"
                return openai_error(503, why, "server_error"), "-"
            attempts += 1
            tried.add(ep.key)
            host, port = _hostport(ep.url)
            ep.start(now)
            m = self.metrics
            try:
                upstream = await self.pool.request(
                    request.method, host, port, request.path, headers, request.body
                )
            except (ConnectFailed, UpstreamReset, UpstreamTimeout) as exc:
                ep.finish(trio.current_time(), "upstream_fault")
                m.upstream_errors.labels(body.model, ep.key, _kind(exc)).inc()
                last_error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, UpstreamReset) and not exc.before_response:
                    return self._upstream_failed(body.model, last_error), ep.key
                if not self.budget.can_retry(trio.current_time(), attempts=attempts):
                    return self._upstream_failed(body.model, last_error), ep.key
                self.budget.on_retry(trio.current_time())
                m.retries.labels(body.model).inc()
                continue
            except UpstreamError as exc:
                ep.finish(trio.current_time(), "upstream_fault")
                m.upstream_errors.labels(body.model, ep.key, _kind(exc)).inc()
                return self._upstream_failed(body.model, f"{type(exc).__name__}: {exc}"), ep.key
            m.ttft.labels(body.model).observe(trio.current_time() - started)
            outcome = classify(upstream.status, None)
            if upstream.status in (502, 503, 504):
                ep.finish(trio.current_time(), "upstream_fault")
                m.upstream_errors.labels(body.model, ep.key, f"status_{upstream.status}").inc()
                await upstream.aclose()
                last_error = f"replica {ep.key} answered {upstream.status}"
                if self.budget.can_retry(trio.current_time(), attempts=attempts):
                    self.budget.on_retry(trio.current_time())
                    m.retries.labels(body.model).inc()
                    continue
                return self._upstream_failed(body.model, last_error), ep.key
            out_headers = [(k, v) for k, v in upstream.headers if k not in _HOP]
            if not body.stream and upstream.status < 300:
                try:
                    data = await upstream.read()
                except UpstreamError as exc:
                    ep.finish(trio.current_time(), "upstream_fault")
                    m.upstream_errors.labels(body.model, ep.key, _kind(exc)).inc()
                    return self._upstream_failed(body.model, f"{type(exc).__name__}: {exc}"), ep.key
                ep.finish(trio.current_time(), outcome)
                _count_tokens(m, body.model, data)
                return Response(upstream.status, out_headers, data), ep.key
            relay = _relay(upstream, ep, outcome, m, body.model, started)
            return Response(upstream.status, out_headers, relay), ep.key

    def _upstream_failed(self, model: str, why: str) -> Response:
        status = 504 if "Timeout" in why else 502
        log.warning("request for %s failed upstream: %s", model, why)
        return openai_error(
            status, f"the replicas of {model} did not answer: {why}", "server_error"
        )


def _kind(exc: UpstreamError) -> str:
    if isinstance(exc, ConnectFailed):
        return "connect"
    if isinstance(exc, UpstreamTimeout):
        return f"timeout_{exc.phase}"
    if isinstance(exc, UpstreamReset):
        return "reset"
    return "protocol"


def _count_tokens(m: RouterMetrics, model: str, data: bytes) -> None:
    try:
        usage = _reply_decoder.decode(data).usage
    except msgspec.DecodeError:
        return
    if usage is not None and usage.completion_tokens:
        m.tokens.labels(model).observe(usage.completion_tokens)


async def _relay(
    upstream: UpstreamResponse,
    ep: Endpoint,
    outcome: Outcome,
    m: RouterMetrics,
    model: str,
    started: float,
) -> AsyncIterator[bytes]:
    """Pass the body through as it arrives; whatever ends it, the upstream is closed."""
    finished = False
    try:
        async for chunk in upstream.body_iter:
            yield chunk
        finished = True
    finally:
        upstream.body_iter.close()
        ep.finish(trio.current_time(), outcome if finished else None)
        m.latency.labels(model).observe(trio.current_time() - started)


def _hostport(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]:")
    else:
        host, _, port = rest.rpartition(":")
    return host, int(port or 80)

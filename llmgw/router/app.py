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

The HTTP server cancels the handler the moment the client disconnects, or
closes the relayed body; either way the upstream connection is closed at
once, so an engine that notices (vLLM; llama-server while streaming) stops
generating for a client that is gone, and the replica stops counting the
request (``_Lease``). Such a request is counted with status 499.
"""

from __future__ import annotations

import logging
import re

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
from llmgw.router.keys import ApiKey, KeyRing
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
        access_log: bool = False,
    ) -> None:
        self.table = table
        self.keys = keys
        self.pool = pool or UpstreamPool()
        self.budget = RetryBudget(max_attempts=max_attempts)
        self.metrics = metrics or RouterMetrics()
        self.queue_timeout_s = queue_timeout_s
        self.access_log = access_log
        self.metrics.watch(lambda: [e for eps in self.table.endpoints.values() for e in eps])

    async def __call__(self, request: Request) -> Response:
        if not self.access_log:
            return await self._serve(request, None)
        entry = _Access(request, trio.current_time())
        try:
            response = await self._serve(request, entry)
        except trio.Cancelled:
            entry.status, entry.ended = 499, "client left"
            entry.write()
            raise
        entry.status = response.status
        if not isinstance(response.body, _Relay):  # a relay writes it when it ends
            entry.write()
        return response

    async def _serve(self, request: Request, entry: _Access | None) -> Response:
        if request.path == "/healthz":
            return Response(200, [("content-type", "application/json")], b'{"status":"ok"}')
        if request.path == "/v1/models" and request.method == "GET":
            key = self._key(request, entry)
            if key is None:
                return self._unauthorized()
            return self._models(key.models)
        if request.path.startswith("/v1/models/") and request.method == "GET":
            key = self._key(request, entry)
            if key is None:
                return self._unauthorized()
            # ids may hold a slash ("org/name"), sent as is or percent-encoded (the
            # server has decoded the path)
            return self._model(request.path[len("/v1/models/") :], key.models)
        if request.path not in ROUTES:
            return openai_error(404, f"no such endpoint: {request.method} {request.path}")
        if request.method != "POST":
            return openai_error(405, f"{request.path} takes POST")
        key = self._key(request, entry)
        if key is None:
            return self._unauthorized()
        try:
            body = _decoder.decode(request.body)
        except msgspec.DecodeError as exc:
            return openai_error(400, f"the body is not the JSON this endpoint takes: {exc}")
        if not body.model:
            return openai_error(400, "the body names no model", code="missing_model")
        if entry is not None:
            entry.model = body.model[:200]  # as asked, known or not
        if not key.allows(body.model) or not self.table.known(body.model):
            return openai_error(
                404, f"the model {body.model!r} does not exist", code="model_not_found"
            )
        started = trio.current_time()
        try:
            response, replica = await self._proxy(request, body, started, entry)
        except trio.Cancelled:  # the client left before the response began
            self.metrics.requests.labels(body.model, "-", "499", key.name).inc()
            raise
        if entry is not None:
            entry.replica = replica
        self.metrics.requests.labels(body.model, replica, str(response.status), key.name).inc()
        if isinstance(response.body, bytes):
            self.metrics.latency.labels(body.model).observe(trio.current_time() - started)
        return response

    def _key(self, request: Request, entry: _Access | None) -> ApiKey | None:
        """The request's API key, if it holds a good one (the access log gets its name)."""
        key = self.keys.check(request.headers.get("authorization"))
        if key is not None and entry is not None:
            entry.key = key.name
        return key

    def _unauthorized(self) -> Response:
        return openai_error(
            401,
            "missing or invalid API key (send Authorization: Bearer <key>)",
            code="invalid_api_key",
        )

    def _listed(self, allowed: frozenset[str]) -> list[str]:
        """The models this key may use that have a replica taking requests now."""
        return sorted(
            m
            for m, eps in self.table.endpoints.items()
            if any(e.ready and not e.draining for e in eps) and (not allowed or m in allowed)
        )

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

    async def _proxy(
        self, request: Request, body: _Body, started: float, entry: _Access | None
    ) -> tuple[Response, str]:
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
            lease = _Lease(ep, now)
            try:
                result = await self._attempt(
                    request, headers, body, lease, started, attempts, entry
                )
            except BaseException:
                # The client left (or the server is stopping) mid-attempt. The pool
                # has closed the upstream; the replica must not go on counting this
                # request, nor its breaker a probe that will never end.
                lease.finish(None)
                raise
            if isinstance(result, str):  # an upstream fault, to retry elsewhere
                last_error = result
                continue
            return result

    async def _attempt(
        self,
        request: Request,
        headers: list[tuple[str, str]],
        body: _Body,
        lease: _Lease,
        started: float,
        attempts: int,
        entry: _Access | None,
    ) -> tuple[Response, str] | str:
        """One try on one replica: the response and the replica's key, or the
        error to retry on another. The lease is finished here or handed to the
        relay; an exception leaves it open for the caller."""
        ep = lease.endpoint
        m = self.metrics
        host, port = _hostport(ep.url)
        try:
            upstream = await self.pool.request(
                request.method, host, port, request.path, headers, request.body
            )
        except UpstreamError as exc:
            lease.finish("upstream_fault")
            m.upstream_errors.labels(body.model, ep.key, _kind(exc)).inc()
            error = f"{type(exc).__name__}: {exc}"
            retryable = isinstance(exc, ConnectFailed | UpstreamTimeout) or (
                isinstance(exc, UpstreamReset) and exc.before_response
            )
            if not retryable:
                return self._upstream_failed(body.model, error), ep.key
            return self._retry_or_fail(body.model, error, attempts, ep.key)
        m.ttfb.labels(body.model).observe(trio.current_time() - started)
        status = upstream.status
        outcome = classify(status, None)
        if status in (502, 503, 504):
            lease.finish("upstream_fault")
            upstream.body_iter.close()
            m.upstream_errors.labels(body.model, ep.key, f"status_{status}").inc()
            error = f"replica {ep.key} answered {status}"
            return self._retry_or_fail(body.model, error, attempts, ep.key)
        out_headers = [(k, v) for k, v in upstream.headers if k not in _HOP]
        if body.stream or status >= 300:
            relay = _Relay(upstream, lease, outcome, m, body.model, started, body.stream, entry)
            return Response(status, out_headers, relay), ep.key
        try:
            data = await upstream.read()
        except UpstreamError as exc:
            lease.finish("upstream_fault")
            m.upstream_errors.labels(body.model, ep.key, _kind(exc)).inc()
            return self._upstream_failed(body.model, f"{type(exc).__name__}: {exc}"), ep.key
        lease.finish(outcome)
        tokens = _count_tokens(m, body.model, data)
        if entry is not None:
            entry.tokens = tokens
        return Response(status, out_headers, data), ep.key

    def _retry_or_fail(
        self, model: str, error: str, attempts: int, key: str
    ) -> tuple[Response, str] | str:
        """``error`` again, to retry, if this request and the budget allow it."""
        now = trio.current_time()
        if not self.budget.can_retry(now, attempts=attempts):
            return self._upstream_failed(model, error), key
        self.budget.on_retry(now)
        self.metrics.retries.labels(model).inc()
        return error

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


def _model_object(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}


def _count_tokens(m: RouterMetrics, model: str, data: bytes) -> int:
    try:
        usage = _reply_decoder.decode(data).usage
    except msgspec.DecodeError:
        return 0
    if usage is None or not usage.completion_tokens:
        return 0
    m.tokens.labels(model).observe(usage.completion_tokens)
    return usage.completion_tokens


access_log = logging.getLogger("llmgw.router.access")
_ENDED: dict[Outcome | None, str] = {
    "success": "ok",
    "client_error": "ok",
    "upstream_fault": "upstream cut",
    None: "client left",
}


class _Access:
    """One line of the access log (``[router] access_log``), written as the
    request ends: a stream's at its end, with its first-token time and tokens.
    The key appears by its name only."""

    __slots__ = (
        "client",
        "ended",
        "key",
        "method",
        "model",
        "path",
        "replica",
        "started",
        "status",
        "tokens",
        "ttft",
    )

    def __init__(self, request: Request, started: float) -> None:
        host, port = request.client[0], request.client[1]
        self.client = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.method = request.method
        self.path = request.path
        self.started = started
        self.key = self.model = self.replica = "-"
        self.status = 0
        self.ttft: float | None = None
        self.tokens = 0
        self.ended = "ok"

    def write(self) -> None:
        ttft = "-" if self.ttft is None else f"{self.ttft:.3f}s"
        access_log.info(
            "%s %s %s status=%d key=%s model=%s replica=%s time=%.3fs ttft=%s tokens=%d end=%s",
            self.client,
            self.method,
            self.path,
            self.status,
            self.key,
            self.model,
            self.replica,
            trio.current_time() - self.started,
            ttft,
            self.tokens,
            self.ended,
        )


class _Lease:
    """One request on one replica: counted from the start, ended exactly once."""

    __slots__ = ("endpoint", "open")

    def __init__(self, endpoint: Endpoint, now: float) -> None:
        endpoint.start(now)
        self.endpoint = endpoint
        self.open = True

    def finish(self, outcome: Outcome | None) -> None:
        """Tell the replica the request ended (``None``: abandoned, no verdict)."""
        if self.open:
            self.open = False
            self.endpoint.finish(trio.current_time(), outcome)


# Streamed tokens: the usage a stream reports (``stream_options.include_usage``),
# else the events that carry generated text, one token each on llama.cpp and vLLM
# (chat ``content``/``reasoning_content``, completions ``text``; empty ones not).
_STREAM_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_USAGE = b'"completion_tokens"'
_TEXT, _EMPTY_TEXT = b'content":"', b'content":""'  # chat: content, reasoning_content
_COMPLETION_TEXT, _EMPTY_COMPLETION = b'"text":"', b'"text":""'


class _Relay:
    """A response body, passed through chunk by chunk as it arrives.

    However it ends (finished, failed upstream, cancelled, or closed by the
    server before it was ever read), the upstream connection is closed and
    the replica told, once. An async generator could not promise the last:
    one never started runs no ``finally``.

    A streamed (SSE) body is also watched, cheaply, for the time to its first
    event (the first token: an engine sends its head before the prompt is
    even read) and for how many tokens it carried.
    """

    __slots__ = (
        "_entry",
        "_first",
        "_lease",
        "_metrics",
        "_model",
        "_outcome",
        "_started",
        "_stream",
        "_text_events",
        "_upstream",
        "_usage",
    )

    def __init__(
        self,
        upstream: UpstreamResponse,
        lease: _Lease,
        outcome: Outcome,
        metrics: RouterMetrics,
        model: str,
        started: float,
        stream: bool,
        entry: _Access | None,
    ) -> None:
        self._entry = entry
        self._upstream = upstream
        self._lease = lease
        self._outcome = outcome
        self._metrics = metrics
        self._model = model
        self._started = started
        self._stream = stream
        self._first = True
        self._text_events = 0
        self._usage = 0

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._upstream.body_iter.__anext__()
        except StopAsyncIteration:
            self._end(self._outcome)
            raise
        except UpstreamError as exc:
            self._metrics.upstream_errors.labels(
                self._model, self._lease.endpoint.key, _kind(exc)
            ).inc()
            self._end("upstream_fault")
            raise
        except BaseException:
            self._end(None)
            raise
        if self._stream:
            self._watch(chunk)
        return chunk

    def _watch(self, chunk: bytes) -> None:
        # The fewest scans for the common chunk, one token of content: about 0.5 µs.
        if self._first and b"data:" in chunk:
            self._first = False
            ttft = trio.current_time() - self._started
            self._metrics.ttft.labels(self._model).observe(ttft)
            if self._entry is not None:
                self._entry.ttft = ttft
        n = chunk.count(_TEXT)
        if n:
            if _EMPTY_TEXT in chunk:
                n -= chunk.count(_EMPTY_TEXT)
            self._text_events += n
        elif _COMPLETION_TEXT in chunk:
            self._text_events += chunk.count(_COMPLETION_TEXT) - chunk.count(_EMPTY_COMPLETION)
        elif _USAGE in chunk and (found := _STREAM_USAGE.search(chunk)):
            self._usage = int(found[1])  # a usage event carries no text

    async def aclose(self) -> None:
        self._end(None)

    def _end(self, outcome: Outcome | None) -> None:
        if self._lease.open:
            self._upstream.body_iter.close()
            self._lease.finish(outcome)
            m = self._metrics
            m.latency.labels(self._model).observe(trio.current_time() - self._started)
            tokens = self._usage or self._text_events
            if outcome == "success" and self._stream and tokens:
                m.tokens.labels(self._model).observe(tokens)
            if (entry := self._entry) is not None:
                entry.tokens = tokens
                entry.ended = _ENDED[outcome]
                entry.write()


def _hostport(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]:")
    else:
        host, _, port = rest.rpartition(":")
    return host, int(port or 80)

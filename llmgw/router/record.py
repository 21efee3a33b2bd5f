"""One request's record: what the router's metrics and its access log say about it.

Theory of operation
-------------------
``RouterApp`` opens a ``Record`` as a request arrives and everything that
happens to the request is noted on it: the key's name once it is checked,
the model asked for, when it was routed, each attempt's first byte and
fault, a retry or a shed, the status and replica of the response, the first
token and the tokens of a reply. Each note that is a metric feeds it there
and then, so what Prometheus shows is as current as before.

The record ends exactly once: for a whole reply as the handler returns it;
for a relayed body when the relay ends, however it ends; for a client that
left before any response, with status 499. Its end observes the request's
latency and tokens and writes the access log line (``[router] access_log``),
so both always describe the same request the same way.

Only requests that were routed (a known model the key may use) count in
``llmgw_router_requests`` and the histograms; every request gets an access
log line, with the key by its name only. What the client wrote (the path,
decoded; the model) is escaped (``llmgw.http.printable``): a ``%0a`` in a
path or a newline in a model cannot start a forged line, nor a space a
forged field.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from llmgw.addr import join_hostport
from llmgw.engines.base import Timings, prompt_reuse, reply_timings, reported_prompt
from llmgw.http import Request, printable
from llmgw.router.affinity import Pick
from llmgw.router.breaker import Outcome
from llmgw.router.fair import Shares
from llmgw.router.metrics import RouterMetrics
from llmgw.router.poison import Crashes
from llmgw.router.prefix import PromptKey, Reading
from llmgw.router.quota import Short, Ticket, prompt_estimate

if TYPE_CHECKING:
    from llmgw.router.balancer import Endpoint

access_log = logging.getLogger("llmgw.router.access")

# "resumed": a stream that went on from another replica when its own failed, and ended well
Ended = Literal["ok", "resumed", "upstream cut", "client left"]
# A relayed body's end, by the outcome the replica's breaker was told.
ENDED: dict[Outcome | None, Ended] = {
    "success": "ok",
    "client_error": "ok",
    "upstream_fault": "upstream cut",
    None: "client left",
}


class Record:
    """One request, from its arrival to its end (see the module docstring)."""

    __slots__ = (
        "arrived",
        "cached",
        "charged",
        "crashes",
        "done",
        "estimate",
        "held",
        "key",
        "metrics",
        "model",
        "prompt_tokens",
        "prompt_wait",
        "queued",
        "replica",
        "request",
        "routed",
        "sent",
        "shares",
        "short",
        "slot",
        "started",
        "status",
        "tenant",
        "ticket",
        "tokens",
        "ttft",
    )

    def __init__(self, request: Request, metrics: RouterMetrics, arrived: float | None) -> None:
        """``arrived``: when the request arrived, for the access log; None: no log line."""
        self.request = request
        self.metrics = metrics
        self.arrived = arrived
        self.key = "-"  # the API key's name, once checked
        self.tenant = "-"  # the tenant the key belongs to ("-": none)
        self.ticket: Ticket | None = None  # what it holds of its tenant's limits (``quota``)
        self.short: Short | None = None  # what it waits on of them, judged by its head
        self.model = "-"  # as asked, known or not
        self.replica = "-"  # the replica whose answer the client gets
        self.sent: list[str] = []  # the replicas it was sent to, in order
        self.queued = 0.0  # seconds it waited for room on the model's replicas
        # seconds it waited for a slot holding its prompt to come free (``computing``)
        self.prompt_wait = 0.0
        self.held = False  # it waited for a replica of its model to start (``hold``)
        self.routed = ""  # why affinity sent it where it first went (``Pick.route``)
        self.slot: int | None = None  # the engine's slot it was last sent to (``slotmap``)
        self.shares: Shares | None = None  # where what it used counts for its turn (``fair``)
        self.charged = 0  # what it counted there when first sent (its prompt, estimated)
        self.started: float | None = None  # when it was routed; None: it was not
        self.status = 0
        self.ttft: float | None = None
        self.tokens = 0
        self.done = False
        self.crashes: Crashes | None = None  # the engine deaths it was in flight at
        # what the engine said it reused of the prompt, and the prompt's tokens (None:
        # it did not say)
        self.cached: int | None = None
        self.prompt_tokens = 0
        # the replica last sent the request, the prompt's key and the blocks its index
        # said it held: what the engine's word is checked against, and its pace learns from
        self.estimate: tuple[Endpoint, PromptKey, int] | None = None

    def died(self, replica: str, *, answered: bool, alone: bool) -> bool:
        """``replica``'s engine died with the request in flight on it (see
        ``llmgw.router.poison``); True: the request is poison."""
        if self.crashes is None:
            self.crashes = Crashes()
        return self.crashes.died(replica, answered=answered, alone=alone)

    def sent_to(self, replica: str, now: float) -> None:
        """It is sent to ``replica`` (first, or again after a failure): the first time,
        its prompt as estimated counts for its owner's turn (``fair``)."""
        self.sent.append(replica)
        if self.shares is not None and not self.charged:
            self.charged = prompt_estimate(len(self.request.body))
            self.shares.charge(self.owner, self.charged, now)

    @property
    def owner(self) -> str:
        """Whose turn it is in a full model's queue: its tenant, or its key's own name."""
        return self.tenant if self.tenant != "-" else f"key:{self.key}"

    @property
    def suspect(self) -> bool:
        """Found suspect at an engine's death (``llmgw.router.poison``)."""
        return self.crashes is not None and self.crashes.suspect_at is not None

    @property
    def poison(self) -> bool:
        return self.crashes is not None and self.crashes.poison

    def route(self, now: float) -> None:
        """The model is known and the key may use it: from now on the request counts."""
        self.started = now

    def first_byte(self, now: float) -> None:
        """An attempt got its response head."""
        assert self.started is not None
        self.metrics.ttfb.labels(self.model).observe(now - self.started)

    def waited(self, replica: str, seconds: float, *, idle: bool) -> None:
        """It waited ``seconds`` for a copy on ``replica`` of the prompt it shares with
        requests in flight there to come free (``idle``: one did; else it went on to
        compute another)."""
        self.prompt_wait += seconds
        outcome = "freed" if idle else "gave_up"
        self.metrics.prompt_waits.labels(self.model, replica, outcome).inc()
        self.metrics.prompt_wait_seconds.labels(self.model).observe(seconds)

    def pinned(self, replica: str, slot: int | None, outcome: str) -> None:
        """It was sent to ``slot`` of ``replica``'s engine, for ``outcome``
        (``slotmap.OUTCOMES``)."""
        self.slot = slot
        self.metrics.slot_pins.labels(self.model, replica, outcome).inc()

    def upstream_error(self, replica: str, kind: str) -> None:
        """An attempt failed at the replica (``kind``: the metric's label)."""
        self.metrics.upstream_errors.labels(self.model, replica, kind).inc()

    def retry(self) -> None:
        """A failed attempt is to be tried again on another replica."""
        self.metrics.retries.labels(self.model).inc()

    def shed(self) -> None:
        """Every replica was above its admission thresholds: the answer is a 429."""
        self.metrics.sheds.labels(self.model).inc()

    def affinity(self, ep: Endpoint, key: PromptKey, pick: Pick, *, first: bool) -> None:
        """The request goes to ``ep`` as affinity chose (``pick``), its prompt recorded
        in that replica's index; ``first``: its first attempt (a retry's choice, among
        the replicas it has not tried, is not counted again)."""
        if first:
            self.routed = pick.route
            preferred = pick.preferred
            outcome = "overruled" if pick.overruled else "kept"
            self.metrics.affinity.labels(self.model, preferred.key, outcome).inc()
            preferred.prefix.preferred += 1
            if pick.overruled:
                preferred.prefix.overruled += 1
        self.estimate = (ep, key, pick.held)

    def reply_says(self, data: bytes) -> None:
        """Note what a reply (or a stream's event) says of the prompt: what the engine
        reused of it, else at least how many tokens it was (a usage without details)."""
        found = prompt_reuse(data)
        if found is not None:
            self.reused(*found, reply_timings(data))
        elif not self.prompt_tokens and (prompt := reported_prompt(data)):
            self.prompt_tokens = prompt

    def reused(self, cached: int, prompt: int, timings: Timings | None = None) -> None:
        """The engine said it reused ``cached`` of the prompt's ``prompt`` tokens (and
        what that took: llama.cpp's ``timings``, which its replica's pace learns from)."""
        self.cached, self.prompt_tokens = cached, prompt
        replica = self.replica
        m = self.metrics
        m.prompt_tokens.labels(self.model, replica).inc(prompt)
        m.cached_tokens.labels(self.model, replica).inc(cached)
        estimate = self.estimate
        if estimate is None or estimate[0].key != replica:
            return
        ep, key, held = estimate
        index = ep.prefix
        evicted = index.evicted
        tokens = index.observe(held, len(key.blocks), Reading(cached, prompt), key.size)
        m.estimated_tokens.labels(self.model, replica).inc(tokens)
        if index.evicted != evicted:
            m.evicted.labels(self.model, replica).inc()
        if timings is not None:
            ep.pace.observe(timings, prompt, key.size)

    def resumed(self, gap: float) -> None:
        """A broken stream went on from another replica; the client waited ``gap``."""
        self.metrics.resumed.labels(self.model).inc()
        self.metrics.resume_gap.labels(self.model).observe(gap)

    def not_resumed(self, why: str) -> None:
        """A broken stream ended with an error event (``why``: the metric's label)."""
        self.metrics.not_resumed.labels(self.model, why).inc()

    def respond(self, status: int) -> None:
        """The response's status is decided (its head is about to go)."""
        self.status = status
        if self.started is not None:
            self.metrics.requests.labels(self.model, self.replica, str(status), self.key).inc()

    def first_token(self, now: float) -> None:
        """A stream's first event was relayed."""
        assert self.started is not None
        self.ttft = now - self.started
        self.metrics.ttft.labels(self.model).observe(self.ttft)

    def end(self, now: float, ended: Ended = "ok") -> None:
        """The response is over (``tokens`` set, if it had any). Once; later calls do nothing."""
        if self.done:
            return
        self.done = True
        if self.ticket is not None:  # what it used replaces what it reserved
            self.ticket.settle(self.prompt_tokens, self.tokens, now)
            self.ticket.release(now)
        if self.shares is not None and self.charged:  # what it used, for what was counted
            self.shares.charge(self.owner, self.prompt_tokens + self.tokens - self.charged, now)
        if self.started is not None:
            m = self.metrics
            m.latency.labels(self.model).observe(now - self.started)
            # tokens of an answer that completed as a success only
            if self.tokens and ended in ("ok", "resumed") and self.status < 400:
                m.tokens.labels(self.model).observe(self.tokens)
            if self.queued:
                m.queue_wait.labels(self.model).observe(self.queued)
            if self.held:
                m.held.labels(self.model).observe(self.queued)
        if self.arrived is not None:
            self._write(now, ended)

    def left(self, now: float) -> None:
        """The client left before any response: counted as 499, with no latency."""
        if self.done:
            return
        self.done = True
        if self.ticket is not None:  # left before any answer: the prompt as estimated
            self.ticket.settle(0, 0, now)
            self.ticket.release(now)
        self.replica = "-"
        self.respond(499)
        if self.arrived is not None:
            self._write(now, "client left")

    def _write(self, now: float, ended: Ended) -> None:
        assert self.arrived is not None
        request = self.request
        client = join_hostport(*request.client)
        ttft = "-" if self.ttft is None else f"{self.ttft:.3f}s"
        cached = "-" if self.cached is None else f"{self.cached}/{self.prompt_tokens}"
        # where it went, when that is not only the replica that answered: a request
        # that failed over, or ended with no replica's answer
        sent = "" if self.sent in ([], [self.replica]) else f" sent={','.join(self.sent)}"
        if self.queued:  # it waited for room (the queue) before it was sent
            sent += f" queued={self.queued:.3f}s"
        if self.held:  # ... for a replica of its model to start
            sent += " held=yes"
        if self.prompt_wait:  # ... for a slot holding its prompt to come free
            sent += f" waited={self.prompt_wait:.3f}s"
        if self.routed:  # why affinity chose where it first went
            sent += f" route={self.routed}"
        if self.slot is not None:  # the slot of its engine the router chose for it
            sent += f" slot={self.slot}"
        access_log.info(
            "%s %s %s status=%d key=%s tenant=%s model=%s replica=%s time=%.3fs ttft=%s "
            "tokens=%d cached=%s end=%s%s",
            client,
            request.method,
            printable(request.path, field=True),
            self.status,
            self.key,
            self.tenant,
            printable(self.model[:200], field=True),
            self.replica,
            now - self.arrived,
            ttft,
            self.tokens,
            cached,
            ended,
            sent,
        )

"""The router's Prometheus metrics (served with the rest on the admin listener).

Labels are bounded: models and replicas come from the catalog and the fleet,
key *names* from the config (never the keys), statuses are HTTP codes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.router.balancer import Endpoint
from llmgw.router.breaker import BreakerState

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
_SIGNALS = ("waiting", "running", "kv_usage", "slots", "progress", "cache_hits", "cache_queries")


class _EndpointsCollector(Collector):
    def __init__(
        self,
        endpoints: Callable[[], Iterable[Endpoint]],
        queued: Callable[[], Iterable[tuple[str, int]]],
    ) -> None:
        self._endpoints = endpoints
        self._queued = queued

    def collect(self) -> Iterable[Metric]:
        queued = GaugeMetricFamily(
            "llmgw_router_queued",
            "Requests waiting in this router for room on the model's replicas (the queue: "
            "router.queue_timeout_s), served by their tenants' recent tokens",
            labels=["model"],
        )
        for model, waiting in self._queued():
            queued.add_metric([model], waiting)
        yield queued
        breaker = GaugeMetricFamily(
            "llmgw_router_breaker_open",
            "1 when the replica's circuit breaker is open, 0.5 half-open, 0 closed",
            labels=["model", "replica"],
        )
        in_flight = GaugeMetricFamily(
            "llmgw_router_in_flight",
            "Requests this router has in flight",
            labels=["model", "replica"],
        )
        wedged = GaugeMetricFamily(
            "llmgw_router_wedged",
            "1 while the replica has work and its progress counter is flat "
            "(router.wedged_after_s), or nothing is heard from it at all "
            "(router.silent_after_s): its breaker is held open",
            labels=["model", "replica"],
        )
        load = GaugeMetricFamily(
            "llmgw_router_load",
            "The load signals the router sees per replica (engine gauges as last scraped; "
            "cache_hits and cache_queries: the engine's own counts of prompt tokens reused "
            "from its cache and looked up, since it started)",
            labels=["model", "replica", "signal"],
        )
        blocks = GaugeMetricFamily(
            "llmgw_router_prefix_index_blocks",
            "Blocks of prompt (512 bytes each) the router remembers sending to the replica",
            labels=["model", "replica"],
        )
        placed = GaugeMetricFamily(
            "llmgw_router_new_conversations",
            "New conversations this router placed on the replica, of about the model's last "
            "32 (decayed; each first turn counted by the share of its prompt the replica "
            "computes, so that another user of a system prompt it holds counts its question; "
            "only while it is the only router and places them evenly)",
            labels=["model", "replica"],
        )
        pace = GaugeMetricFamily(
            "llmgw_router_pace",
            "How fast the replica works, as its engine's replies say (llama.cpp's timings; "
            "moving averages): prefill_seconds_per_token, slot_seconds (a request's time "
            "in its slot), bytes_per_token (of the prompt as the router reads it). A turn "
            "waits for its replica's slot while that is shorter than computing what it "
            "holds again elsewhere",
            labels=["model", "replica", "measure"],
        )
        held = 0
        for ep in self._endpoints():
            state = ep.breaker.state
            value = (
                1.0
                if state is BreakerState.OPEN
                else 0.5
                if state is BreakerState.HALF_OPEN
                else 0.0
            )
            breaker.add_metric([ep.model, ep.key], value)
            in_flight.add_metric([ep.model, ep.key], ep.in_flight)
            wedged.add_metric([ep.model, ep.key], 1.0 if ep.wedged else 0.0)
            blocks.add_metric([ep.model, ep.key], len(ep.prefix))
            placed.add_metric([ep.model, ep.key], ep.prefix.placed)
            if ep.pace.known:
                p = ep.pace
                pace.add_metric([ep.model, ep.key, "prefill_seconds_per_token"], p.prefill_ms / 1e3)
                pace.add_metric([ep.model, ep.key, "slot_seconds"], p.slot_s)
                pace.add_metric([ep.model, ep.key, "bytes_per_token"], p.bytes_per_token)
            held += ep.prefix.bytes
            if ep.load is not None:
                for name in _SIGNALS:
                    v = getattr(ep.load, name)
                    if v is not None:
                        load.add_metric([ep.model, ep.key, name], v)
        yield breaker
        yield in_flight
        yield wedged
        yield load
        yield blocks
        yield placed
        yield pace
        yield GaugeMetricFamily(
            "llmgw_router_prefix_index_bytes",
            "Memory the router's prefix indexes take, about (bounded: 60 MiB at most)",
            value=held,
        )


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by model, replica, status and key name",
            ["model", "replica", "status", "key"],
            registry=r,
        )
        self.latency = Histogram(
            "llmgw_router_request_seconds",
            "Whole request time",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttfb = Histogram(
            "llmgw_router_time_to_first_byte_seconds",
            "From the request to the engine's response head (sent before the first "
            "token when streaming)",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "llmgw_router_time_to_first_token_seconds",
            "Streamed responses: from the request to the first event relayed",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Histogram(
            "llmgw_router_completion_tokens",
            "Completion tokens per successful response: its usage, or for a stream "
            "without one, the events that carried text",
            ["model"],
            buckets=_TOKENS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "llmgw_router_upstream_errors",
            "Upstream faults, by replica and kind",
            ["model", "replica", "kind"],
            registry=r,
        )
        self.refused = Counter(
            "llmgw_router_refused",
            "Requests refused with 400 before any engine saw them, by why: json (not "
            "JSON), json_depth, grammar_depth, grammar_size, schema_size (router.max_*)",
            ["why"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "llmgw_router_tenant_requests",
            "Requests of tenants' keys admitted within their limits, by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_refused = Counter(
            "llmgw_router_tenant_refused",
            "Requests of tenants' keys refused with 429 at a limit, by tenant and limit "
            "(rpm, in_flight), and whether the tenant's or the key's own",
            ["tenant", "limit", "scope"],
            registry=r,
        )
        self.poisoned = Counter(
            "llmgw_router_poisoned",
            "Requests taken for their own fault and sent to no other replica, by how: "
            "crashed (in flight at two engines' deaths), remembered (a body that did so "
            "lately, refused at once), gateway or timeout (the same failure on two replicas)",
            ["model", "how"],
            registry=r,
        )
        self.retries = Counter(
            "llmgw_router_retries", "Requests retried on another replica", ["model"], registry=r
        )
        self.sheds = Counter(
            "llmgw_router_sheds",
            "Requests shed with 429 (every replica above its thresholds)",
            ["model"],
            registry=r,
        )
        self.resumed = Counter(
            "llmgw_router_streams_resumed",
            "Streams whose replica failed mid-way, carried on from another replica",
            ["model"],
            registry=r,
        )
        self.resume_gap = Histogram(
            "llmgw_router_stream_resume_gap_seconds",
            "Resumed streams: from the last event relayed before the break to the first "
            "after it (the stall the client saw)",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.not_resumed = Counter(
            "llmgw_router_streams_not_resumed",
            "Streams whose replica failed mid-way and that ended with an error event, by why",
            ["model", "why"],
            registry=r,
        )

        self.affinity = Counter(
            "llmgw_router_affinity",
            "Requests whose prompt preferred the replica (the one holding the most of it, "
            "or its first by rendezvous), by whether it took them (kept) or was past its "
            "load bound and another did (overruled)",
            ["model", "replica", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "llmgw_router_prompt_tokens",
            "Prompt tokens of the replies that said what they reused from the engine's "
            "cache, by the replica that answered",
            ["model", "replica"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "llmgw_router_prompt_tokens_cached",
            "Of those, the tokens the engine said it reused from its cache",
            ["model", "replica"],
            registry=r,
        )
        self.estimated_tokens = Counter(
            "llmgw_router_prompt_tokens_estimated",
            "Of those, the tokens the router estimated the replica held before it sent them",
            ["model", "replica"],
            registry=r,
        )
        self.evicted = Counter(
            "llmgw_router_prefix_evicted",
            "Replies that reused much less of the prompt than the router estimated the "
            "replica held: it had evicted it (the router then remembers less of it)",
            ["model", "replica"],
            registry=r,
        )
        self.prompt_waits = Counter(
            "llmgw_router_prompt_waits",
            "Requests that waited for a slot of the replica holding the prompt they share "
            "with requests in flight there to come free (another slot would compute it "
            "again), by whether one did (freed) or the wait would have cost more than "
            "computing it again (gave_up)",
            ["model", "replica", "outcome"],
            registry=r,
        )
        self.slot_pins = Counter(
            "llmgw_router_slot_pins",
            "Requests this router sent to a llama.cpp replica whose slots it chooses (it is "
            "the fleet's only router), by where: the idle slot holding their prompt (idle), "
            "the busy one, which the engine waits for (waits), another, idle one, computing "
            "the prompt again as waiting would cost more (again), one for a prompt no slot "
            "holds (new), or the engine's first slot to free, every slot busy and none "
            "waited for in the router (first)",
            ["model", "replica", "outcome"],
            registry=r,
        )
        self.prompt_wait_seconds = Histogram(
            "llmgw_router_prompt_wait_seconds",
            "Time a request waited for a slot holding the prompt it shares with requests "
            "in flight on its replica to come free, of those that waited",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )

        self.queue_wait = Histogram(
            "llmgw_router_queue_seconds",
            "Time a request waited in this router for room on the model's replicas, of "
            "those that waited",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.held = Histogram(
            "llmgw_router_held_seconds",
            "Time a request was held in this router for a replica of its model (a range of "
            "replicas with none started) to start, of those held, however they ended",
            ["model"],
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
            registry=r,
        )
        self.panic = Gauge(
            "llmgw_router_panic",
            "1 while every replica of the model is refused by its breaker and requests "
            "go to the least bad one anyway (panic)",
            ["model"],
            registry=r,
        )
        self.panic_routed = Counter(
            "llmgw_router_panic_routed",
            "Requests sent to a replica its breaker refused, in panic",
            ["model"],
            registry=r,
        )

    def forget(self, replicas: Iterable[str]) -> None:
        """Replicas that left the routing table: their series go too (a fleet that
        replaces replicas for months would otherwise keep every one it ever had)."""
        for replica in replicas:
            for counter in (
                self.requests,
                self.upstream_errors,
                self.affinity,
                self.prompt_tokens,
                self.cached_tokens,
                self.estimated_tokens,
                self.evicted,
                self.prompt_waits,
                self.slot_pins,
            ):
                counter.remove_by_labels({"replica": replica})

    def watch(
        self,
        endpoints: Callable[[], Iterable[Endpoint]],
        queued: Callable[[], Iterable[tuple[str, int]]] = tuple,
    ) -> None:
        """Read the replicas' series from ``endpoints``, and each model's queue length
        from ``queued`` ((model, requests waiting) pairs), at every scrape."""
        self.registry.register(_EndpointsCollector(endpoints, queued))

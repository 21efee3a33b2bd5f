"""The agent's Prometheus metrics, served on a local port when configured.

Off by default; with ``[metrics] listen = "127.0.0.1:9464"`` a node can be
scraped like any exporter. Labels are bounded (shard states, event kinds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SHARD_STATES = ("starting", "ready", "draining", "stopping", "sleeping")


class _ShardsCollector(Collector):
    def __init__(self, states: Callable[[], Iterable[str]]) -> None:
        self._states = states

    def collect(self) -> Iterable[Metric]:
        counts = dict.fromkeys(SHARD_STATES, 0)
        for state in self._states():
            counts[state] = counts.get(state, 0) + 1
        family = GaugeMetricFamily("llmgw_agent_shards", "Shards by state", labels=["state"])
        for state, n in counts.items():
            family.add_metric([state], n)
        yield family


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.events = Counter(
            "llmgw_agent_engine_events",
            "Engine lifecycle events: launched, restarted, adopted, killed (unidentified), "
            "killed_after_grace (SIGKILL once a stop grace was over)",
            ["event"],
            registry=r,
        )
        self.reconnects = Counter(
            "llmgw_agent_stream_reconnects",
            "Stream connection attempts after the first",
            registry=r,
        )
        self.fetched_bytes = Counter(
            "llmgw_agent_weights_fetched_bytes",
            "Bytes of weights fetched, by where they came from: hub, url, peer",
            ["source"],
            registry=r,
        )
        self.fetch_failures = Counter(
            "llmgw_agent_weights_fetch_failures",
            "Fetches of weights that failed: no_room, corrupt, stalled, source (the source "
            "refused or could not be asked)",
            ["reason"],
            registry=r,
        )
        self.discovery = Histogram(
            "llmgw_agent_discovery_duration_seconds",
            "How long one discovery pass took",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )

    def watch_shards(self, states: Callable[[], Iterable[str]]) -> None:
        self.registry.register(_ShardsCollector(states))

    def event(self, name: str) -> None:
        self.events.labels(name).inc()

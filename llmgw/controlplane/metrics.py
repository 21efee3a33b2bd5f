"""Prometheus metrics of the control plane, on a registry of its own.

A registry per server (not the library's global one) keeps test servers in
one process apart. Label values are bounded: states, message types and
refusal reasons, never request ids; node ids only on the failure and kill
counters (a node appears there once one of its engines failed, or once it
killed a process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.controlplane.leases import LeaseBank
from llmgw.controlplane.nodes import NodeState

if TYPE_CHECKING:
    from llmgw.controlplane.scaling import Scaling


class _NodesCollector(Collector):
    def __init__(self, counts: Callable[[], dict[NodeState, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("llmgw_nodes", "Nodes by liveness state", labels=["state"])
        for state, n in self._counts().items():
            family.add_metric([state.value], n)
        yield family


class _LeasesCollector(Collector):
    def __init__(self, bank: LeaseBank, wall: Callable[[], float]) -> None:
        self._bank = bank
        self._wall = wall

    def collect(self) -> Iterable[Metric]:
        bank, stats = self._bank, self._bank.stats
        yield CounterMetricFamily(
            "llmgw_leases_exchanges",
            "Lease exchanges with routers (each router's every second or so while it "
            "serves a tenant's keys, and when a request waits on a limit)",
            value=stats.exchanges,
        )
        granted = CounterMetricFamily(
            "llmgw_leases_granted_units",
            "Units of tenants' limits granted to routers (requests, tokens, slots), by "
            "kind of limit",
            labels=["kind"],
        )
        for kind, units in sorted(stats.granted.items()):
            granted.add_metric([kind], units)
        yield granted
        denied = CounterMetricFamily(
            "llmgw_leases_denied",
            "Asks for a waiting request denied, by kind of limit and why: limit (the "
            "limit is spent: the request is refused) or held_elsewhere (other routers "
            "hold it unspent and give it back, or for a budget requests in flight "
            "reserved it and give back what they do not use; the request asks again)",
            labels=["kind", "why"],
        )
        for (kind, why), n in sorted(stats.denied.items()):
            denied.add_metric([kind, why], n)
        yield denied
        yield GaugeMetricFamily(
            "llmgw_leases_contended",
            "Tenants' limits a request waits on while other routers hold them unspent",
            value=bank.contended(self._wall()),
        )
        yield GaugeMetricFamily(
            "llmgw_leases_routers",
            "Routers that exchanged leases within the last 30 s",
            value=bank.routers(),
        )


class _ReplicasCollector(Collector):
    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "llmgw_replicas", "Replicas by model and state", labels=["model", "state"]
        )
        for (model, state), n in sorted(self._counts().items()):
            family.add_metric([model, state], n)
        yield family


class _ModelProblemsCollector(Collector):
    def __init__(self, problems: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._problems = problems

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "llmgw_model_problems",
            "1 for each catalog model and what keeps it from running as wanted now: "
            "placement's reason while it cannot be placed, weights while no node holds them",
            labels=["model", "reason"],
        )
        for (model, reason), n in sorted(self._problems().items()):
            family.add_metric([model, reason], n)
        yield family


class _ScalingCollector(Collector):
    def __init__(self, scaling: Scaling) -> None:
        self._scaling = scaling

    def collect(self) -> Iterable[Metric]:
        desired = GaugeMetricFamily(
            "llmgw_model_replicas_desired",
            "Replicas a model with a range should run now, as demand (or a pin) says",
            labels=["model"],
        )
        load = GaugeMetricFamily(
            "llmgw_model_load",
            "A ranged model's requests at every router, as the last pass read them: in "
            "flight at its replicas, or waiting (queued, or held with no replica)",
            labels=["model", "kind"],
        )
        events = CounterMetricFamily(
            "llmgw_model_scale_events",
            "Changes of a ranged model's count, by reason: up, down, idle (to zero), "
            "held (from zero, a request waiting), pinned",
            labels=["model", "reason"],
        )
        for model, demand in sorted(self._scaling.demands().items()):
            desired.add_metric([model], demand.count)
            last = demand.last
            if last is not None:
                load.add_metric([model, "in_flight"], last.in_flight)
                load.add_metric([model, "waiting"], last.waiting)
        for (model, reason), n in sorted(self._scaling.events.items()):
            events.add_metric([model, reason], n)
        yield desired
        yield load
        yield events


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.connects = Counter(
            "llmgw_agent_stream_connects", "Agent streams registered", registry=r
        )
        self.refusals = Counter(
            "llmgw_agent_stream_refusals",
            "Agent streams refused or closed for a protocol fault, by reason",
            ["reason"],
            registry=r,
        )
        self.messages = Counter(
            "llmgw_agent_messages", "Messages received from agents, by type", ["type"], registry=r
        )
        self.commands = Counter(
            "llmgw_commands_dispatched", "Commands sent to agents, by type", ["type"], registry=r
        )
        self.heartbeat_delay = Histogram(
            "llmgw_heartbeat_delay_seconds",
            "From the agent sending a heartbeat to the control plane processing it "
            "(agent wall clock against ours: meaningful only with synchronised clocks)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "llmgw_reconcile_pass_seconds",
            "How long one reconcile pass (placement included) took",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.placement_failures = Counter(
            "llmgw_placement_failures",
            "Passes in which a model below its count could not be placed, by model and reason",
            ["model", "reason"],
            registry=r,
        )
        self.replica_failures = Counter(
            "llmgw_replica_failures",
            "Engine shards that failed (exited, crashed), by model and node",
            ["model", "node"],
            registry=r,
        )
        self.replica_start_seconds = Histogram(
            "llmgw_replica_start_seconds",
            "From placing a replica to its engine answering Ready, by model and profile",
            ["model", "profile"],
            buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200),
            registry=r,
        )
        self.replica_wake_seconds = Histogram(
            "llmgw_replica_wake_seconds",
            "From waking a sleeping replica to its engine answering Ready, by model and profile",
            ["model", "profile"],
            buckets=(0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
        self.agent_kills = Counter(
            "llmgw_agent_kills",
            "Processes agents killed, by node and kind: stray (held an engine port or a "
            "GPU that no shard describes), stop_timeout (SIGKILL after a stop's grace), other",
            ["node", "reason_kind"],
            registry=r,
        )
        self.report_conflicts = Counter(
            "llmgw_report_conflicts",
            "Shards a node reported that are another node's (refused), by the node whose "
            "claim lost",
            ["node"],
            registry=r,
        )
        self.liveness_changes = Counter(
            "llmgw_node_state_changes",
            "Node liveness transitions, by new state",
            ["state"],
            registry=r,
        )

    def watch_replicas(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.registry.register(_ReplicasCollector(counts))

    def watch_model_problems(self, problems: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.registry.register(_ModelProblemsCollector(problems))

    def watch_scaling(self, scaling: Scaling) -> None:
        self.registry.register(_ScalingCollector(scaling))

    def watch_nodes(self, counts: Callable[[], dict[NodeState, int]]) -> None:
        self.registry.register(_NodesCollector(counts))

    def watch_leases(self, bank: LeaseBank, wall: Callable[[], float]) -> None:
        """The lease bank's series, read at each scrape (``wall``: the time now)."""
        self.registry.register(_LeasesCollector(bank, wall))

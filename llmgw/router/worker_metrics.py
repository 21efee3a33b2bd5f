"""One metrics page for a standalone router's worker processes.

``llmgw router --workers N`` runs N processes on one port, each with its own
counters, histograms and view of the replicas (in flight, breaker, gauges).
The first process serves ``metrics_listen``. On each scrape it takes its own
registry and asks every other worker for its page: each serves its registry
on a loopback port of its own, which it writes to the run directory the first
process made (``worker-<i>.port``). It renders them all as one page, every
sample labelled with its ``worker`` (0 is the first process), so that
``sum without (worker) (...)`` gives the router as a whole.

A worker that does not answer within a second is left out of that page, and
``llmgw_router_worker_up{worker}`` says so (0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import httpx
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmgw.files import write_atomic

log = logging.getLogger("llmgw.router")

ASK_TIMEOUT_S = 1.0


def relabel(families: Iterable[Metric], worker: str, into: dict[str, Metric]) -> None:
    """Add ``families`` to ``into``, one family per name, each sample with ``worker``."""
    for family in families:
        merged = into.get(family.name)
        if merged is None:
            merged = into[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
        for sample in family.samples:
            merged.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


async def page(own: CollectorRegistry, run_dir: Path) -> bytes:
    """This process's metrics and every other worker's, as one exposition."""
    pages: dict[str, str | None] = {}

    async def ask(client: httpx.AsyncClient, worker: str, port: int | None) -> None:
        try:
            if port is None:
                raise ValueError("its port file does not hold a port")
            reply = await client.get(f"http://127.0.0.1:{port}/metrics")
            reply.raise_for_status()
            pages[worker] = reply.text
        except (ValueError, httpx.HTTPError) as exc:
            log.warning("router worker %s gave no metrics: %s", worker, exc)
            pages[worker] = None

    async with (
        httpx.AsyncClient(timeout=ASK_TIMEOUT_S, trust_env=False) as client,
        trio.open_nursery() as nursery,
    ):
        for worker, port in published(run_dir).items():
            nursery.start_soon(ask, client, worker, port)

    merged: dict[str, Metric] = {}
    relabel(own.collect(), "0", merged)
    up = GaugeMetricFamily(
        "llmgw_router_worker_up",
        "1 when the worker's metrics are on this page, 0 when it did not answer",
        labels=["worker"],
    )
    up.add_metric(["0"], 1.0)
    for worker in sorted(pages, key=int):
        text = pages[worker]
        if text is not None:
            try:
                relabel(text_string_to_metric_families(text), worker, merged)
            except ValueError as exc:
                log.warning("router worker %s sent metrics that do not parse: %s", worker, exc)
                text = None
        up.add_metric([worker], 0.0 if text is None else 1.0)
    merged[up.name] = up
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(merged.values())))
    return generate_latest(registry)


def published(run_dir: Path) -> dict[str, int | None]:
    """Worker -> the port it published (None: unreadable). Small files: read at once."""
    ports: dict[str, int | None] = {}
    for port_file in run_dir.glob("worker-*.port"):
        try:
            ports[port_file.stem.removeprefix("worker-")] = int(port_file.read_text())
        except (OSError, ValueError):
            ports[port_file.stem.removeprefix("worker-")] = None
    return ports


def publish_port(run_dir: Path, worker: int, port: int) -> None:
    """Tell the first process where this worker's metrics are (atomically)."""
    write_atomic(run_dir / f"worker-{worker}.port", str(port).encode())

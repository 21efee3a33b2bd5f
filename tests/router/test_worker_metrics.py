"""One metrics page for a standalone router's workers: relabelled, merged, and
honest about a worker that does not answer."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.http import HttpServer
from llmgw.http.metrics import metrics_app
from llmgw.router import worker_metrics


def registry_with(requests: int) -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("llmgw_router_requests", "Requests", ["model"], registry=r).labels("m").inc(requests)
    return r


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port held bound and never listening: connecting is refused, and nothing
    else can take the port while the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


async def test_workers_pages_merge_with_a_worker_label(
    nursery: trio.Nursery, tmp_path: Path, closed_port: int
) -> None:
    other = registry_with(5)

    async def render() -> bytes:
        return generate_latest(other)

    listeners = await nursery.start(HttpServer(metrics_app(render)).serve_tcp, "127.0.0.1", 0)
    worker_metrics.publish_port(tmp_path, 1, listeners[0].socket.getsockname()[1])
    worker_metrics.publish_port(tmp_path, 2, closed_port)  # a worker that is gone
    (tmp_path / "worker-3.port").write_text("not a port")
    with trio.fail_after(5):
        text = (await worker_metrics.page(registry_with(2), tmp_path)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {
        s.labels["worker"]: s.value
        for s in families["llmgw_router_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests == {"0": 2.0, "1": 5.0}
    up = {s.labels["worker"]: s.value for s in families["llmgw_router_worker_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0, "3": 0.0}
    assert text.count("# TYPE llmgw_router_requests_total counter") == 1  # one family

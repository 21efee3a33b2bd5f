"""Reading an engine's load over HTTP: its Prometheus metrics, and where its metrics
lack KV usage, the adapter's ``usage_path`` beside them (llama.cpp's ``/slots``).

The router reads it to weigh and admit; ``ctl bench`` reads it to report what the
engine said while a level ran. One reading serves both, so both see the same
numbers.
"""

from __future__ import annotations

import attrs
import httpx
import trio

from llmgw.engines.base import EngineAdapter, LoadSignals


async def read_load(
    client: httpx.AsyncClient,
    base_url: str,
    adapter: EngineAdapter,
    headers: dict[str, str],
) -> LoadSignals | None:
    """The engine at ``base_url`` (no trailing slash, no /v1): None when its metrics
    do not answer 200; KV usage and slots left as the metrics say when ``usage_path``
    does not answer."""
    usage: list[LoadSignals | None] = [None]

    async def read_usage(path: str) -> None:
        try:
            r = await client.get(base_url + path, headers=headers)
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            usage[0] = adapter.parse_usage(r.content)

    async with trio.open_nursery() as nursery:
        if adapter.usage_path is not None:
            nursery.start_soon(read_usage, adapter.usage_path)
        try:
            r = await client.get(base_url + "/metrics", headers=headers)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        signals = adapter.parse_metrics(r.text)
    more = usage[0]
    if more is not None:
        signals = attrs.evolve(signals, kv_usage=more.kv_usage, slots=more.slots)
    return signals

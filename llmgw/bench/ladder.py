"""The concurrency ladder: raise the concurrency step by step until the SLO breaks.

At each level, ``concurrency`` clients each send one streamed chat completion
after another for ``duration_s``; requests started before the end finish. Time
to first token (TTFT) is from sending to the first chunk with text;
inter-token latency (ITL) is the gap between chunks with text after that (an
engine streams one token per chunk); end-to-end (E2E) is to the last byte.

The last level that met the SLO is the capacity. Peak throughput comes long
after latency has become unusable, so throughput alone overstates what the
hardware can serve; the ladder stops at the first level that breaks the SLO.

While a level runs, the engine's load is sampled four times a second, with the
engine's key, as the router reads it (``llmgw.engines.load``): queue depth and
requests running from its ``/metrics``, KV usage from there (vLLM) or from its
``/slots`` (llama.cpp). What the engine said while it still met the SLO is what
admission should treat as healthy.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx
import msgspec
import trio

from llmgw.bench.prompts import PromptMaker
from llmgw.engines import adapters
from llmgw.engines.load import read_load

SAMPLE_S = 0.25
_DURATION = re.compile(r"^([0-9.]+)\s*(ms|s)?$")
SLO_KEYS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "e2e_p50", "e2e_p95", "error_rate")


class SloError(ValueError):
    pass


@attrs.frozen
class Slo:
    """Limits on a level's figures: seconds for latencies, a fraction for errors."""

    limits: dict[str, float]

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft_p95=2s,itl_p95=100ms`` (and ``e2e_p95``, ``..._p50``, ``error_rate=1%``).
        Any error breaks it unless ``error_rate`` says how many may."""
        limits: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in SLO_KEYS:
                raise SloError(
                    f"--slo {part!r}: give KEY=VALUE with KEY one of {', '.join(SLO_KEYS)}"
                    " (e.g. ttft_p95=2s,itl_p95=100ms)"
                )
            limits[key] = _fraction(value, part) if key == "error_rate" else _seconds(value, part)
        if not limits:
            raise SloError("--slo is empty: e.g. --slo ttft_p95=2s,itl_p95=100ms")
        return cls(limits)

    def broken(self, level: Level) -> list[str]:
        """What of the SLO this level broke, in words; empty: it met it."""
        out = []
        rate = level.errors / level.requests if level.requests else 1.0
        allowed = self.limits.get("error_rate", 0.0)
        if rate > allowed:
            out.append(f"errors {level.errors}/{level.requests} > {allowed:.1%}")
        for key, limit in self.limits.items():
            if key == "error_rate":
                continue
            value = getattr(level, key)
            if value is None or value > limit:
                shown = "none" if value is None else _ms(value)
                out.append(f"{key} {shown} > {_ms(limit)}")
        return out

    def __str__(self) -> str:
        return ",".join(
            f"{k}={v:.1%}" if k == "error_rate" else f"{k}={_ms(v)}" for k, v in self.limits.items()
        )


def _seconds(value: str, part: str) -> float:
    m = _DURATION.match(value.strip())
    if m is None:
        raise SloError(f"--slo {part!r}: a time is like 2s, 100ms or 0.5")
    n = float(m.group(1))
    return n / 1000 if m.group(2) == "ms" else n


def _fraction(value: str, part: str) -> float:
    v = value.strip()
    try:
        n = float(v[:-1]) / 100 if v.endswith("%") else float(v)
    except ValueError:
        raise SloError(f"--slo {part!r}: an error rate is like 1% or 0.01") from None
    if not 0 <= n <= 1:
        raise SloError(f"--slo {part!r}: an error rate is between 0% and 100%")
    return n


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


class Level(msgspec.Struct, kw_only=True):
    """One rung of the ladder, as measured."""

    concurrency: int
    requests: int = 0
    errors: int = 0
    duration_s: float = 0.0
    rps: float = 0.0  # completed requests per second
    output_tps: float = 0.0  # output tokens per second
    input_tokens: float = 0.0  # mean prompt tokens per request (the engine's count)
    output_tokens: float = 0.0  # mean completion tokens per request
    # mean prompt tokens the engine took from its prompt cache, where it says
    # (llama.cpp's timings.cache_n, vLLM's usage.prompt_tokens_details.cached_tokens)
    cached_tokens: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    itl_p50: float | None = None
    itl_p95: float | None = None
    e2e_p50: float | None = None
    e2e_p95: float | None = None
    # what the engine(s) said while it ran: queue depth (llama.cpp: deferred requests),
    # requests running (llama.cpp: busy slots), KV-cache usage (0..1)
    waiting_max: float | None = None
    waiting_mean: float | None = None
    running_max: float | None = None
    slots: float | None = None  # requests the engine(s) run at once, where they say (llama.cpp)
    kv_max: float | None = None
    kv_mean: float | None = None
    met_slo: bool = False
    broke: list[str] = []
    error_examples: list[str] = []


@attrs.frozen
class Scrape:
    """Where an engine is, and how to read its load."""

    url: str  # its base URL (no /v1)
    engine: str  # its adapter's name
    key: str = ""


@attrs.define
class _Samples:
    waiting: list[float] = attrs.Factory(list)
    running: list[float] = attrs.Factory(list)
    kv: list[float] = attrs.Factory(list)
    slots: list[float] = attrs.Factory(list)


@attrs.define
class _Tally:
    ttft: list[float] = attrs.Factory(list)
    itl: list[float] = attrs.Factory(list)
    e2e: list[float] = attrs.Factory(list)
    input_tokens: int = 0
    output_tokens: int = 0
    cached: list[int] = attrs.Factory(list)
    done: int = 0
    errors: int = 0
    examples: list[str] = attrs.Factory(list)

    def error(self, why: str) -> None:
        self.errors += 1
        if why not in self.examples and len(self.examples) < 3:
            self.examples.append(why)


Progress = Callable[[int, float, int, int], None]  # concurrency, elapsed, done, errors


@attrs.define
class Ladder:
    """What to aim at and how hard; ``run`` climbs it."""

    base_url: str  # .../v1
    model: str
    api_key: str
    prompts: PromptMaker
    slo: Slo
    levels: Sequence[int]
    duration_s: float = 30.0
    # a level runs past duration_s until this many requests ended (at most ten times as
    # long, or a minute more): the p95 of a handful of requests is their slowest
    min_requests: int = 0
    request_timeout_s: float = 120.0
    ignore_eos: bool = True  # every reply runs to its max_tokens: the same work each time
    scrapes: Sequence[Scrape] = ()
    progress: Progress | None = None
    on_level: Callable[[Level], None] | None = None  # each level, as it ends

    async def run(self) -> list[Level]:
        out: list[Level] = []
        limits = httpx.Limits(max_connections=max(self.levels) + 8)
        async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as client:
            for concurrency in self.levels:
                level = await self._level(client, concurrency)
                out.append(level)
                if self.on_level is not None:
                    self.on_level(level)
                if not level.met_slo:
                    break
        return out

    async def _level(self, client: httpx.AsyncClient, concurrency: int) -> Level:
        tally, samples = _Tally(), _Samples()
        start = trio.current_time()
        deadline = start + self.duration_s
        async with trio.open_nursery() as nursery:
            stop_sampling = trio.CancelScope()
            nursery.start_soon(
                self._sample, client, samples, stop_sampling, concurrency, start, tally
            )
            async with trio.open_nursery() as users:
                for _ in range(concurrency):
                    users.start_soon(self._user, client, deadline, tally)
            stop_sampling.cancel()
        elapsed = max(trio.current_time() - start, 1e-9)
        level = Level(
            concurrency=concurrency,
            requests=tally.done + tally.errors,
            errors=tally.errors,
            duration_s=round(elapsed, 3),
            rps=tally.done / elapsed,
            output_tps=tally.output_tokens / elapsed,
            input_tokens=tally.input_tokens / tally.done if tally.done else 0.0,
            output_tokens=tally.output_tokens / tally.done if tally.done else 0.0,
            cached_tokens=_mean([float(c) for c in tally.cached]),
            ttft_p50=percentile(tally.ttft, 50),
            ttft_p95=percentile(tally.ttft, 95),
            itl_p50=percentile(tally.itl, 50),
            itl_p95=percentile(tally.itl, 95),
            e2e_p50=percentile(tally.e2e, 50),
            e2e_p95=percentile(tally.e2e, 95),
            waiting_max=max(samples.waiting, default=None),
            waiting_mean=_mean(samples.waiting),
            running_max=max(samples.running, default=None),
            slots=max(samples.slots, default=None),
            kv_max=max(samples.kv, default=None),
            kv_mean=_mean(samples.kv),
            error_examples=tally.examples,
        )
        level.broke = self.slo.broken(level)
        level.met_slo = not level.broke
        return level

    async def _user(self, client: httpx.AsyncClient, deadline: float, tally: _Tally) -> None:
        last = deadline + max(9 * self.duration_s, 60.0)
        while trio.current_time() < deadline or (
            tally.done + tally.errors < self.min_requests and trio.current_time() < last
        ):
            prompt, max_tokens = self.prompts.next()
            await self._request(client, prompt, max_tokens, tally)

    async def _request(
        self, client: httpx.AsyncClient, prompt: str, max_tokens: int, tally: _Tally
    ) -> None:
        body: dict[str, object] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        sent = time.perf_counter()
        with trio.move_on_after(self.request_timeout_s) as bound:
            await self._stream(client, body, headers, sent, tally)
        if bound.cancelled_caught:
            tally.error(f"no whole answer within {self.request_timeout_s:g} s")

    async def _stream(
        self,
        client: httpx.AsyncClient,
        body: dict[str, object],
        headers: dict[str, str],
        sent: float,
        tally: _Tally,
    ) -> None:
        first: float | None = None
        last = sent
        gaps: list[float] = []
        chunks = 0
        usage: dict[str, Any] = {}
        cached: int | None = None
        try:
            async with client.stream(
                "POST", self.base_url + "/chat/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    tally.error(f"HTTP {response.status_code}: {_message(text)}")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"]
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            cached = int(details["cached_tokens"])
                    timings = event.get("timings")
                    if isinstance(timings, dict) and timings.get("cache_n") is not None:
                        cached = int(timings["cache_n"])
                    choices = event.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        chunks += 1
        except (httpx.HTTPError, ValueError) as exc:
            tally.error(f"{type(exc).__name__}: {exc}"[:200])
            return
        if first is None:
            tally.error("the stream carried no text")
            return
        tally.done += 1
        tally.ttft.append(first - sent)
        tally.itl.extend(gaps)
        tally.e2e.append(time.perf_counter() - sent)
        tally.input_tokens += int(usage.get("prompt_tokens", 0))
        tally.output_tokens += int(usage.get("completion_tokens", chunks))
        if cached is not None:
            tally.cached.append(cached)

    async def _sample(
        self,
        client: httpx.AsyncClient,
        samples: _Samples,
        scope: trio.CancelScope,
        concurrency: int,
        start: float,
        tally: _Tally,
    ) -> None:
        with scope:
            while True:
                await self._scrape(client, samples)
                if self.progress is not None:
                    self.progress(
                        concurrency, trio.current_time() - start, tally.done, tally.errors
                    )
                await trio.sleep(SAMPLE_S)

    async def _scrape(self, client: httpx.AsyncClient, samples: _Samples) -> None:
        waiting: list[float] = []
        running: list[float] = []
        kv: list[float] = []
        slots: list[float] = []
        for scrape in self.scrapes:
            adapter = adapters().get(scrape.engine)
            if adapter is None:
                continue
            headers = {"authorization": f"Bearer {scrape.key}"} if scrape.key else {}
            signals = None
            with trio.move_on_after(2.0):
                signals = await read_load(client, scrape.url, adapter, headers)
            if signals is None:
                continue
            if signals.waiting is not None:
                waiting.append(signals.waiting)
            if signals.running is not None:
                running.append(signals.running)
            if signals.slots is not None:
                slots.append(signals.slots)
            if signals.kv_usage is not None:
                kv.append(signals.kv_usage)
        # over the replicas aimed at: queues and running requests add up, KV is the fullest
        if waiting:
            samples.waiting.append(sum(waiting))
        if running:
            samples.running.append(sum(running))
        if slots:
            samples.slots.append(sum(slots))
        if kv:
            samples.kv.append(max(kv))


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (nearest rank); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict):
            return str(error.get("message", ""))[:160]
        return str(error)[:160]
    except (ValueError, AttributeError):
        return text.strip()[:160]


def default_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to ``max_concurrency`` (and it, if it is no power of two)."""
    levels = []
    c = 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    levels.append(max_concurrency)
    return levels

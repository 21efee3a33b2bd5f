"""The last hour of traffic per model, from the routers' own counters.

Every ``STEP_S`` the control plane reads each router's counts since it started (the
in-process router's metrics, the standalone routers' last reports) and keeps what
grew: requests, 5xx errors, completion tokens, and the time-to-first-token
histogram, summed over routers, one point per step, an hour of them. A router that
restarted (its counts went down) counts from zero again. No Prometheus needed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import attrs
import msgspec

from llmgw.routing import ModelCounters

STEP_S = 10.0
MAX_MODELS = 1000  # models kept; past it, a new one waits until one is quiet for the span


@attrs.define
class _Point:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: dict[float, int] = attrs.Factory(dict)  # bound -> count at or below it, this step
    ttft_p95_s: float | None = None  # of ``ttft``, worked out once when the step is kept


class ModelSeries(msgspec.Struct, kw_only=True):
    requests: list[int]  # answered within each step
    errors: list[int]  # 5xx within each step
    ttft_p95_s: list[float | None]  # None: no streamed response within the step
    tokens_per_s: list[float]


class TrafficView(msgspec.Struct, kw_only=True):
    """``GET /api/traffic``: one value per step, oldest first, the last at ``end``."""

    step_s: float
    end: float  # wall clock of the last point
    points: int
    models: dict[str, ModelSeries]


def p95(buckets: Mapping[float, int]) -> float | None:
    """The 95th percentile of a step's cumulative buckets, interpolated in its bucket
    (as Prometheus' histogram_quantile does); the top bound when past it."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = 0.95 * total
    below, low = 0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            inside = count - below
            share = (rank - below) / inside if inside > 0 else 1.0
            return low + (bound - low) * share
        below, low = count, bound
    return bounds[-1]


class TrafficHistory:
    def __init__(self, step_s: float = STEP_S, span_s: float = 3600.0) -> None:
        self.step_s = step_s
        self.points = max(1, round(span_s / step_s))
        self._last: dict[tuple[str, str], ModelCounters] = {}  # (router, model) -> as read
        self._series: dict[str, deque[_Point | None]] = {}
        self._end = 0.0
        self._read = False  # a first reading was taken

    def sample(self, routers: Mapping[str, Mapping[str, ModelCounters]], wall: float) -> None:
        """One step: what grew at every router since the last reading."""
        step: dict[str, _Point] = {}
        seen: dict[tuple[str, str], ModelCounters] = {}
        for router, models in routers.items():
            for model, now in models.items():
                seen[(router, model)] = now
                before = self._last.get((router, model))
                if before is None or now.requests < before.requests:
                    before = ModelCounters()  # first seen, or restarted: all of it is new
                    if not self._read:
                        continue  # the first reading of all: a start, not this step's traffic
                grew = step.setdefault(model, _Point())
                grew.requests += now.requests - before.requests
                grew.errors += max(0, now.errors - before.errors)
                grew.tokens += max(0, now.tokens - before.tokens)
                old = dict(zip(before.ttft_le, before.ttft_counts, strict=False))
                for le, count in zip(now.ttft_le, now.ttft_counts, strict=False):
                    grew.ttft[le] = grew.ttft.get(le, 0) + max(0, count - old.get(le, 0))
        self._last = seen
        self._read = True
        self._end = wall
        for model in step.keys() | self._series.keys():
            series = self._series.get(model)
            if series is None:
                if len(self._series) >= MAX_MODELS:
                    continue
                series = self._series[model] = deque([None] * self.points, maxlen=self.points)
            point = step.get(model)
            if point is not None and point.requests:
                point.ttft_p95_s, point.ttft = _rounded(p95(point.ttft)), {}
                series.append(point)
            else:
                series.append(None)
        for model in [m for m, s in self._series.items() if not any(s)]:
            del self._series[model]  # nothing for an hour

    def moved(self) -> bool:
        """Whether the last step had any traffic."""
        return any(series[-1] is not None for series in self._series.values())

    def view(self) -> TrafficView:
        models: dict[str, ModelSeries] = {}
        for model, series in sorted(self._series.items()):
            models[model] = ModelSeries(
                requests=[p.requests if p else 0 for p in series],
                errors=[p.errors if p else 0 for p in series],
                ttft_p95_s=[p.ttft_p95_s if p else None for p in series],
                tokens_per_s=[round(p.tokens / self.step_s, 2) if p else 0.0 for p in series],
            )
        return TrafficView(step_s=self.step_s, end=self._end, points=self.points, models=models)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def sources(
    in_process: Callable[[], dict[str, ModelCounters]] | None,
    standalone: Callable[[], dict[str, dict[str, ModelCounters]]],
) -> Callable[[], dict[str, dict[str, ModelCounters]]]:
    """Every router's counts, the in-process one's under "in-process"."""

    def read() -> dict[str, dict[str, ModelCounters]]:
        found = dict(standalone())
        if in_process is not None:
            found["in-process"] = in_process()
        return found

    return read

"""The console's traffic history: what grew at each router per step, summed; a router
that restarted counts from zero; the p95 interpolated as Prometheus does."""

from __future__ import annotations

import pytest

from llmgw.console.traffic import TrafficHistory, p95
from llmgw.controlplane.followers import ReportRefused, RouterReports
from llmgw.routing import ModelCounters, RouterReport

LE = [0.1, 0.5, 1.0]


def counts(
    requests: int, errors: int = 0, tokens: int = 0, ttft: list[int] | None = None
) -> ModelCounters:
    return ModelCounters(
        requests=requests, errors=errors, tokens=tokens, ttft_le=LE, ttft_counts=ttft or [0, 0, 0]
    )


def test_each_step_keeps_what_grew_at_every_router_summed() -> None:
    h = TrafficHistory(step_s=10, span_s=60)
    h.sample({"a": {"m": counts(100, 5, 1000)}}, 0)  # a start: what came before is not counted
    h.sample({"a": {"m": counts(110, 6, 1200, [5, 10, 10])}, "b": {"m": counts(4, 0, 40)}}, 10)
    view = h.view()
    s = view.models["m"]
    assert len(s.requests) == 6 and view.end == 10
    assert s.requests[-1] == 14 and s.errors[-1] == 1  # 10 at a, all 4 of b (new)
    assert s.tokens_per_s[-1] == pytest.approx(24.0)  # (200 + 40) / 10 s
    # 10 streamed: 5 under 0.1 s, 5 in (0.1, 0.5]: the 9.5th is 90 % into that bucket
    assert s.ttft_p95_s[-1] == pytest.approx(0.1 + 0.4 * 0.9)
    h.sample({"a": {"m": counts(3)}, "b": {"m": counts(4, 0, 40)}}, 20)  # a restarted
    assert h.view().models["m"].requests[-1] == 3
    h.sample({"a": {"m": counts(3)}, "b": {"m": counts(4, 0, 40)}}, 30)  # nothing new
    assert h.view().models["m"].requests[-1] == 0 and not h.moved()
    assert h.view().models["m"].ttft_p95_s[-1] is None


def test_a_model_quiet_for_the_whole_span_is_dropped() -> None:
    h = TrafficHistory(step_s=10, span_s=30)
    h.sample({}, 0)
    h.sample({"a": {"m": counts(1)}}, 10)
    assert "m" in h.view().models and h.moved()
    for t in (20, 30, 40):
        h.sample({"a": {"m": counts(1)}}, t)
    assert h.view().models == {}


def test_p95_of_empty_or_past_the_top() -> None:
    assert p95({}) is None and p95({0.1: 0, 1.0: 0}) is None
    assert p95({0.1: 0, 1.0: 0, 5.0: 0}) is None
    assert p95({0.1: 10}) == pytest.approx(0.095)


def test_a_routers_report_of_its_traffic_is_bounded() -> None:
    reports = RouterReports()
    good = RouterReport(router="r1", traffic={"m": counts(3, 1, 9, [1, 2, 3])})
    reports.take(good, "127.0.0.1", 0)
    assert reports.traffic(1)["r1"]["m"].requests == 3
    bad = RouterReport(
        router="r1", traffic={"m": ModelCounters(requests=1, ttft_le=[0.1], ttft_counts=[])}
    )
    with pytest.raises(ReportRefused, match="as many ttft_counts as ttft_le"):
        reports.take(bad, "127.0.0.1", 2)
    with pytest.raises(ReportRefused, match="not below 0"):
        reports.take(RouterReport(router="r1", traffic={"m": counts(-1)}), "127.0.0.1", 2)
    assert reports.traffic(1000) == {}  # not heard from lately: forgotten

"""A request's record: it ends once, and its metrics and its log line say the same."""

from __future__ import annotations

import logging

import pytest

from llmgw.http import Request
from llmgw.http.types import Headers
from llmgw.router.metrics import RouterMetrics
from llmgw.router.record import Record


def request(host: str = "10.0.0.9") -> Request:
    return Request("POST", "/v1/chat/completions", "", Headers([]), b"{}", (host, 4242), "1.1")


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.router.access"]


def count(m: RouterMetrics, status: str, replica: str = "r1") -> float:
    return float(m.requests.labels("m", replica, status, "k")._value.get())


def latencies(m: RouterMetrics) -> float:
    return float(m.latency.labels("m")._sum.get())


def routed(m: RouterMetrics, arrived: float | None = 10.0) -> Record:
    record = Record(request(), m, arrived)
    record.key, record.model = "k", "m"
    record.route(10.5)
    return record


def test_a_record_ends_once_with_one_line_and_one_latency(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.access")
    m = RouterMetrics()
    record = routed(m)
    record.replica = "r1"
    record.respond(200)
    record.first_token(11.0)
    record.tokens = 7
    record.end(12.5)
    record.end(13.0, "upstream cut")  # a second end, however it comes, is ignored
    record.left(14.0)
    assert lines(caplog) == [
        "10.0.0.9:4242 POST /v1/chat/completions status=200 key=k tenant=- model=m replica=r1 "
        "time=2.500s ttft=0.500s tokens=7 cached=- end=ok"
    ]
    assert count(m, "200") == 1
    assert latencies(m) == 2.0
    assert m.ttft.labels("m")._sum.get() == 0.5
    assert m.tokens.labels("m")._sum.get() == 7


@pytest.mark.parametrize(
    ("status", "ended"), [(200, "upstream cut"), (200, "client left"), (400, "ok")]
)
def test_tokens_count_only_for_a_success_that_completed(status: int, ended: str) -> None:
    m = RouterMetrics()
    record = routed(m, arrived=None)
    record.respond(status)
    record.tokens = 5
    record.end(12.0, ended)  # type: ignore[arg-type]
    assert m.tokens.labels("m")._sum.get() == 0
    assert latencies(m) == 1.5  # latency all the same


def test_a_client_that_left_before_a_response_is_a_499_without_latency(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.access")
    m = RouterMetrics()
    record = routed(m)
    record.replica = "r1"  # an attempt was under way
    record.sent.append("r1")
    record.left(11.0)
    record.end(12.0)
    assert count(m, "499", replica="-") == 1
    assert latencies(m) == 0
    [line] = lines(caplog)
    assert (
        "status=499 key=k tenant=- model=m replica=- time=1.000s ttft=- tokens=0 cached=- "
        "end=client left sent=r1" in line  # where it waited
    )


def test_a_request_that_failed_over_names_every_replica_it_was_sent_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.access")
    record = routed(RouterMetrics())
    record.sent += ["r1", "r2"]
    record.replica = "r2"
    record.respond(200)
    record.end(11.0)
    alone = routed(RouterMetrics())
    alone.sent.append("r1")
    alone.replica = "r1"
    alone.respond(200)
    alone.end(11.0)
    failed_over, answered = lines(caplog)
    assert "replica=r2" in failed_over and failed_over.endswith("end=ok sent=r1,r2")
    assert answered.endswith("end=ok")  # only where it was answered: nothing more


def test_a_request_never_routed_is_logged_but_not_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.access")
    m = RouterMetrics()
    record = Record(request("::1"), m, 1.0)
    record.model = "x" * 300  # as asked, however long
    record.respond(404)
    record.end(1.25)
    [line] = lines(caplog)
    assert line.startswith("[::1]:4242 POST /v1/chat/completions status=404 key=- tenant=- model=x")
    assert f"model={'x' * 200} replica=-" in line
    [requests] = m.requests.collect()
    [latency] = m.latency.collect()
    assert requests.samples == [] and latency.samples == []


def test_without_an_access_log_nothing_is_written(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.access")
    m = RouterMetrics()
    record = routed(m, arrived=None)
    record.replica = "r1"
    record.respond(200)
    record.end(11.0)
    assert lines(caplog) == []
    assert count(m, "200") == 1

"""What an attempt comes to: every answer and every failure the pool raises, started or not."""

from __future__ import annotations

import pytest

from llmgw.http.client import (
    ConnectFailed,
    ConnectTimeout,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
)
from llmgw.router import attempt
from llmgw.router.breaker import classify
from llmgw.router.verdict import Failure, Verdict, verdict


def relayed(status: int, outcome: str) -> Verdict:
    return Verdict(outcome, retry=False, status=status, relayed=True)  # type: ignore[arg-type]


RETRIED_502 = Verdict("upstream_fault", retry=True, status=502, relayed=False)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (100, relayed(100, "success")),
        (200, relayed(200, "success")),
        (204, relayed(204, "success")),
        (301, relayed(301, "success")),
        (304, relayed(304, "success")),
        (400, relayed(400, "client_error")),
        (401, relayed(401, "client_error")),
        (404, relayed(404, "client_error")),
        (408, relayed(408, "client_error")),
        (413, relayed(413, "client_error")),
        (422, relayed(422, "client_error")),
        (499, relayed(499, "client_error")),
        # the replica is overloaded: counted against it, but relayed, not retried
        (429, relayed(429, "upstream_fault")),
        # an engine's internal error: counted against it, but relayed, not retried
        (500, relayed(500, "upstream_fault")),
        (501, relayed(501, "client_error")),
        (502, RETRIED_502),
        (503, RETRIED_502),
        (504, RETRIED_502),
        (505, relayed(505, "client_error")),
        (507, relayed(507, "upstream_fault")),
        (599, relayed(599, "upstream_fault")),
        (600, relayed(600, "upstream_fault")),  # beyond the table: judged all the same
    ],
)
@pytest.mark.parametrize("started", [False, True])
def test_an_answer(status: int, started: bool, expected: Verdict) -> None:
    # an answer is the start of a response: ``started`` does not change its verdict
    assert verdict(status, started=started) == expected


def test_every_status_agrees_with_the_breaker_and_allocates_nothing() -> None:
    for status in range(100, 600):
        v = verdict(status)
        if status in (502, 503, 504):
            assert v == RETRIED_502
        else:
            assert v == relayed(status, classify(status))
        assert verdict(status) is v  # made once, at import


def failed(retry: bool, status: int) -> Verdict:
    return Verdict("upstream_fault", retry=retry, status=status, relayed=False)


# (exception the pool raises, its Failure, its metric kind, its verdict before the
# response started, its verdict once the body was being read)
POOL_FAILURES: list[tuple[UpstreamError, Failure, str, Verdict, Verdict]] = [
    (
        ConnectFailed("e:1: connect failed: [Errno 111] Connection refused"),
        Failure.CONNECT,
        "connect",
        failed(True, 502),
        failed(False, 502),
    ),
    (
        ConnectFailed("e:1: the pool is closed"),
        Failure.CONNECT,
        "connect",
        failed(True, 502),
        failed(False, 502),
    ),
    (
        ConnectTimeout("e:1: connect timed out", "connect"),
        Failure.TIMEOUT,
        "connect",
        failed(True, 504),
        failed(False, 504),
    ),
    (
        UpstreamTimeout("e:1: sending the request timed out", "send"),
        Failure.TIMEOUT,
        "timeout_send",
        failed(True, 504),
        failed(False, 504),
    ),
    (
        UpstreamTimeout("e:1: no response head in time", "head"),
        Failure.TIMEOUT,
        "timeout_head",
        failed(True, 504),
        failed(False, 504),
    ),
    (
        UpstreamTimeout("e:1: no body bytes in time", "body"),
        Failure.TIMEOUT,
        "timeout_body",
        failed(True, 504),
        failed(False, 504),
    ),
    (
        UpstreamReset("e:1: send failed: [Errno 32] Broken pipe", "send", True),
        Failure.UNANSWERED,
        "reset",
        failed(True, 502),
        failed(False, 502),
    ),
    (
        UpstreamReset("e:1: connection closed without a response", "head", True),
        Failure.UNANSWERED,
        "reset",
        failed(True, 502),
        failed(False, 502),
    ),
    (
        UpstreamReset("e:1: connection closed mid-head", "head", False),
        Failure.RESET,
        "reset",
        failed(False, 502),
        failed(False, 502),
    ),
    (
        UpstreamReset("e:1: the pool was closed", "head", False),
        Failure.RESET,
        "reset",
        failed(False, 502),
        failed(False, 502),
    ),
    (
        UpstreamReset("e:1: connection closed mid-body", "body", False),
        Failure.RESET,
        "reset",
        failed(False, 502),
        failed(False, 502),
    ),
    (
        UpstreamProtocolError("e:1: response head too large", "head"),
        Failure.PROTOCOL,
        "protocol",
        failed(False, 502),
        failed(False, 502),
    ),
    (
        UpstreamProtocolError("e:1: invalid chunk size", "body"),
        Failure.PROTOCOL,
        "protocol",
        failed(False, 502),
        failed(False, 502),
    ),
    (
        UpstreamError("e:1: ?", "head"),
        Failure.PROTOCOL,
        "protocol",
        failed(False, 502),
        failed(False, 502),
    ),
]


@pytest.mark.parametrize(
    ("exc", "named", "kind", "before", "after"),
    POOL_FAILURES,
    ids=[f"{type(row[0]).__name__}-{row[0].phase}-{row[1].value}" for row in POOL_FAILURES],
)
def test_a_failure_of_the_pool(
    exc: UpstreamError, named: Failure, kind: str, before: Verdict, after: Verdict
) -> None:
    assert attempt.failure(exc) is named
    assert attempt.kind(exc) == kind
    assert verdict(attempt.failure(exc), started=False) == before
    assert verdict(attempt.failure(exc), started=True) == after


def test_every_failure_is_the_replicas_and_none_is_retried_once_started() -> None:
    for f in Failure:
        for started in (False, True):
            v = verdict(f, started=started)
            assert v.outcome == "upstream_fault" and not v.relayed
            assert v.status == (504 if f is Failure.TIMEOUT else 502)
            if started:
                assert not v.retry
    assert {f for f in Failure if verdict(f).retry} == {
        Failure.CONNECT,
        Failure.TIMEOUT,
        Failure.UNANSWERED,
    }

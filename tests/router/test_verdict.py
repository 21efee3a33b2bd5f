"""What an attempt comes to: every answer and every failure the pool raises, started or not."""

from __future__ import annotations

import pytest

from llmgw.http.upstream_errors import (
    ConnectFailed,
    ConnectTimeout,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
)
from llmgw.router import attempt
from llmgw.router.breaker import classify
from llmgw.router.verdict import Failure, Suspect, Verdict, poisoned, verdict


def relayed(status: int, outcome: str) -> Verdict:
    return Verdict(outcome, retry=False, status=status, relayed=True)  # type: ignore[arg-type]


RETRIED_502 = Verdict(
    "upstream_fault", retry=True, status=502, relayed=False, suspect=Suspect.GATEWAY
)


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
        # the engine's own answers, whatever their status: about the request, not
        # the replica (llama.cpp's 500 to an image part); relayed, not retried
        (429, relayed(429, "client_error")),
        (500, relayed(500, "client_error")),
        (501, relayed(501, "client_error")),
        (502, RETRIED_502),
        (503, RETRIED_502),
        (504, RETRIED_502),
        (505, relayed(505, "client_error")),
        (507, relayed(507, "client_error")),
        (599, relayed(599, "client_error")),
        (600, relayed(600, "client_error")),  # beyond the table: judged all the same
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
            assert v.outcome != "upstream_fault"  # an engine's answer never opens a breaker
        assert verdict(status) is v  # made once, at import


def failed(
    retry: bool, status: int, suspect: Suspect | None = None, *, failover: bool = False
) -> Verdict:
    return Verdict(
        "upstream_fault",
        retry=retry,
        status=status,
        relayed=False,
        suspect=suspect,
        failover=failover,
    )


# (exception the pool raises, its Failure, its metric kind, its verdict before the
# response started, its verdict once the body was being read)
POOL_FAILURES: list[tuple[UpstreamError, Failure, str, Verdict, Verdict]] = [
    (
        ConnectFailed("e:1: connect failed: [Errno 111] Connection refused"),
        Failure.CONNECT,
        "connect",
        failed(True, 502, failover=True),
        failed(False, 502),
    ),
    (
        ConnectFailed("e:1: the pool is closed"),
        Failure.CONNECT,
        "connect",
        failed(True, 502, failover=True),
        failed(False, 502),
    ),
    (
        ConnectTimeout("e:1: connect timed out", "connect"),
        Failure.CONNECT_TIMEOUT,
        "connect",
        failed(True, 504),
        failed(False, 504),
    ),
    (
        UpstreamTimeout("e:1: sending the request timed out", "send"),
        Failure.TIMEOUT,
        "timeout_send",
        failed(True, 504, Suspect.TIMEOUT),
        failed(True, 504, Suspect.TIMEOUT),
    ),
    (
        UpstreamTimeout("e:1: no response head in time", "head"),
        Failure.TIMEOUT,
        "timeout_head",
        failed(True, 504, Suspect.TIMEOUT),
        failed(True, 504, Suspect.TIMEOUT),
    ),
    (
        UpstreamTimeout("e:1: no body bytes in time", "body"),
        Failure.TIMEOUT,
        "timeout_body",
        failed(True, 504, Suspect.TIMEOUT),
        failed(True, 504, Suspect.TIMEOUT),
    ),
    (
        UpstreamReset("e:1: send failed: [Errno 32] Broken pipe", "send", True),
        Failure.UNANSWERED,
        "reset",
        failed(True, 502, Suspect.CLOSED, failover=True),
        failed(False, 502),
    ),
    (
        UpstreamReset("e:1: connection closed without a response", "head", True),
        Failure.UNANSWERED,
        "reset",
        failed(True, 502, Suspect.CLOSED, failover=True),
        failed(False, 502),
    ),
    (
        UpstreamReset("e:1: connection closed mid-head", "head", False),
        Failure.RESET,
        "reset",
        failed(False, 502),
        failed(True, 502, Suspect.CLOSED),
    ),
    (
        UpstreamReset("e:1: the pool was closed", "head", False),
        Failure.RESET,
        "reset",
        failed(False, 502),
        failed(True, 502, Suspect.CLOSED),
    ),
    (
        UpstreamReset("e:1: connection closed mid-body", "body", False),
        Failure.RESET,
        "reset",
        failed(False, 502),
        failed(True, 502, Suspect.CLOSED),
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


def test_every_failure_is_the_replicas_and_a_broken_body_is_retried_whole() -> None:
    for f in Failure:
        for started in (False, True):
            v = verdict(f, started=started)
            assert v.outcome == "upstream_fault" and not v.relayed
            timeout = f in (Failure.TIMEOUT, Failure.CONNECT_TIMEOUT, Failure.WEDGED)
            assert v.status == (504 if timeout else 502)
    # a body that broke or stalled: asked again, whole, elsewhere; a garbled one is not
    assert {f for f in Failure if verdict(f, started=True).retry} == {
        Failure.TIMEOUT,
        Failure.RESET,
        Failure.WEDGED,
    }
    assert {f for f in Failure if verdict(f).retry} == {
        Failure.CONNECT,
        Failure.CONNECT_TIMEOUT,
        Failure.TIMEOUT,
        Failure.UNANSWERED,
        Failure.WEDGED,
    }


def test_a_retry_off_a_gone_or_wedged_replica_is_failover_and_no_other() -> None:
    """Failover (a retry that spends no retry budget): the replica refused the
    connection or closed it before any byte of an answer, or the router cut it as
    wedged. A connect timeout is not (the replica may be there, too busy to accept),
    nor a fault once the response started, nor any answer."""
    for f in Failure:
        for started in (False, True):
            v = verdict(f, started=started)
            assert not v.failover or v.retry  # failover is a kind of retry
    assert {f for f in Failure if verdict(f).failover} == {
        Failure.CONNECT,
        Failure.UNANSWERED,
        Failure.WEDGED,
    }
    assert {f for f in Failure if verdict(f, started=True).failover} == {Failure.WEDGED}
    assert not any(verdict(status).failover for status in range(100, 600))
    # a cut of a wedged replica is otherwise a timeout: poison when the next times out
    wedged = verdict(Failure.WEDGED)
    assert (wedged.status, wedged.suspect) == (504, Suspect.TIMEOUT)
    assert poisoned(wedged, verdict(Failure.TIMEOUT))


def test_only_a_retried_fault_is_suspect_and_a_failure_to_connect_never() -> None:
    for f in Failure:
        for started in (False, True):
            v = verdict(f, started=started)
            nothing_sent = f in (Failure.CONNECT, Failure.CONNECT_TIMEOUT)
            assert (v.suspect is not None) == (v.retry and not nothing_sent)


@pytest.mark.parametrize(
    ("first", "then", "poison"),
    [
        (503, 502, True),  # 502-504 are one way of failing
        (504, 504, True),
        (503, Failure.TIMEOUT, False),
        (Failure.TIMEOUT, Failure.TIMEOUT, True),
        # an engine's death: judged by who was in flight (llmgw.router.poison)
        (Failure.UNANSWERED, Failure.UNANSWERED, False),
        (Failure.UNANSWERED, Failure.TIMEOUT, False),
        (Failure.TIMEOUT, 200, False),  # another replica answered: the first one's fault
        (Failure.TIMEOUT, 500, False),
        (Failure.CONNECT, Failure.CONNECT, False),  # nothing was sent: never the request's
        (Failure.TIMEOUT, Failure.CONNECT, False),
        (Failure.CONNECT_TIMEOUT, Failure.CONNECT_TIMEOUT, False),
        (Failure.TIMEOUT, Failure.CONNECT_TIMEOUT, False),
        (500, 500, False),  # answers are not faults at all
    ],
)
def test_poison_is_the_same_suspect_fault_twice(
    first: int | Failure, then: int | Failure, poison: bool
) -> None:
    assert poisoned(verdict(first), verdict(then)) is poison

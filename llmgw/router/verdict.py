"""What one attempt on a replica comes to: the breaker's outcome, a retry, the client's status.

An attempt ends in an *answer* (the status of the response head the engine
sent) or a *failure* (the exchange broke: no connection, a timeout, a reset,
a response that is not HTTP), either before the response started or while
its body was being read (``started``). ``verdict`` maps that to three
things, and nothing else in the router decides any of them:

- ``outcome``: what the replica's breaker is told (``breaker.classify`` for
  an answer; a failure is always the replica's);
- ``retry``: whether the request may go to another replica (still within
  the per-request attempt cap and the retry budget);
- ``status``: what the client is answered if it gets this attempt's result:
  the engine's own status when its answer is relayed (``relayed``), else 502,
  or 504 when the replica ran out of time.

=========================================  ==============  =====  ===========
the attempt ended in                       outcome         retry  client gets
=========================================  ==============  =====  ===========
1xx, 2xx, 3xx                              success         no     as sent
4xx but 429; 501; 505                      client_error    no     as sent
429; 500; 506 and up                       upstream_fault  no     as sent
502, 503, 504                              upstream_fault  yes    502
no connection (refused, unreachable)       upstream_fault  yes    502
a timeout (connect, send, head)            upstream_fault  yes    504
a reset before any byte of the response    upstream_fault  yes    502
a reset mid-head; not HTTP                 upstream_fault  no     502
any failure once the body was being read   upstream_fault  no     504 for a
                                                                  timeout, else
                                                                  502
=========================================  ==============  =====  ===========

Only 502, 503 and 504 are taken for the replica having no answer at all
(its proxy or its server said so) and sent elsewhere. A 429 or a 500 counts
against the replica, so one that refuses or fails everything leaves
rotation, but is relayed as the engine sent it: the client gets the engine's
own words (a 429's Retry-After, a 500's message), and a request that makes
engines fail is not multiplied across the fleet.

A failure before the response is retried when no byte of an answer came:
nothing was sent, or nothing came back before the connection broke or the
wait ran out. Once part of a head or body has arrived, a second
replica's answer cannot be put in its place.

Pure: no I/O and no trio. The shell names a failure with ``Failure``
(``attempt.failure`` translates the upstream pool's exceptions).
"""

from __future__ import annotations

from enum import Enum

import attrs

from llmgw.router.breaker import Outcome, classify


class Failure(Enum):
    """How an exchange with a replica broke, in the words the verdict needs."""

    CONNECT = "connect"  # no connection was made: nothing was sent
    TIMEOUT = "timeout"  # a bounded wait ran out (connecting included)
    UNANSWERED = "unanswered"  # the connection closed before any byte of a response
    RESET = "reset"  # the connection closed after part of the response
    PROTOCOL = "protocol"  # the response is not valid HTTP, or exceeds a limit


@attrs.frozen
class Verdict:
    """What an attempt comes to; see the module docstring for the table."""

    outcome: Outcome  # what the replica's breaker is told
    retry: bool  # whether another replica may be tried
    status: int  # what the client is answered, if this attempt answers it
    relayed: bool  # the engine's answer goes to the client as it is


_BAD_GATEWAY = 502
_GATEWAY_TIMEOUT = 504
_NO_ANSWER = frozenset((502, 503, 504))
# Before the response started: retried only when the engine cannot have answered.
_RETRIED_FAILURES = frozenset((Failure.CONNECT, Failure.TIMEOUT, Failure.UNANSWERED))


def _judge_status(status: int) -> Verdict:
    if status in _NO_ANSWER:
        return Verdict("upstream_fault", retry=True, status=_BAD_GATEWAY, relayed=False)
    return Verdict(classify(status), retry=False, status=status, relayed=True)


def _judge_failure(failure: Failure, started: bool) -> Verdict:
    status = _GATEWAY_TIMEOUT if failure is Failure.TIMEOUT else _BAD_GATEWAY
    retry = not started and failure in _RETRIED_FAILURES
    return Verdict("upstream_fault", retry=retry, status=status, relayed=False)


# Every verdict made once: judging an answer on the hot path allocates nothing.
_BY_STATUS = {status: _judge_status(status) for status in range(100, 600)}
_BY_FAILURE = {
    (failure, started): _judge_failure(failure, started)
    for failure in Failure
    for started in (False, True)
}


def verdict(ended: int | Failure, *, started: bool = False) -> Verdict:
    """The verdict on an attempt that ``ended`` in this status or this failure.

    ``started``: the failure came while the response's body was being read
    (its head had arrived). An answer is the start of a response, so
    ``started`` qualifies failures only.
    """
    if isinstance(ended, Failure):
        return _BY_FAILURE[ended, started]
    found = _BY_STATUS.get(ended)
    return found if found is not None else _judge_status(ended)

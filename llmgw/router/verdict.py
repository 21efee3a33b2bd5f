"""What one attempt on a replica comes to: the breaker's outcome, a retry, the client's status.

An attempt ends in an *answer* (the status of the response head the engine
sent) or a *failure* (the exchange broke: no connection, a timeout, a reset,
a response that is not HTTP, or the router cut it because its replica was
found wedged), either before the response started or while its body was
being read (``started``). ``verdict`` maps that to what the replica's breaker
is told, whether the request may go elsewhere and at what cost, and what the
client gets, and nothing else in the router decides any of them:

- ``outcome``: what the replica's breaker is told (``breaker.classify`` for
  an answer);
- ``suspect``: set when the fault may be the request's own doing rather
  than the replica's; the breaker is then told only once the request's next
  attempt has shown which (see *Poison* below);
- ``retry``: whether the request may go to another replica (still within
  the per-request attempt cap and the retry budget);
- ``failover``: the replica is gone or held wedged, so the request put no
  load on it and moving it elsewhere adds none: its retry spends nothing of
  the router's retry budget (``RetryBudget.can_retry``), only one of the
  request's ``max_attempts`` (see *Failover* below);
- ``status``: what the client is answered if it gets this attempt's result:
  the engine's own status when its answer is relayed (``relayed``), else 502,
  or 504 when the replica ran out of time.

=========================================  ==============  =======  =====  ========  ===========
the attempt ended in                       outcome         suspect  retry  failover  client gets
=========================================  ==============  =======  =====  ========  ===========
1xx, 2xx, 3xx                              success         -        no     -         as sent
any other answer but 502-504 (4xx, 429,    client_error    -        no     -         as sent
500, 501, 505 and up)
502, 503, 504                              upstream_fault  gateway  yes    no        502
no connection (refused, unreachable)       upstream_fault  -        yes    yes       502
no connection in time                      upstream_fault  -        yes    no        504
a timeout (send, head)                     upstream_fault  timeout  yes    no        504
a reset before any byte of the response    upstream_fault  closed   yes    yes       502
a reset mid-head; not HTTP                 upstream_fault  -        no     -         502
cut: its replica was found wedged          upstream_fault  timeout  yes    yes       504
a timeout once the body was being read     upstream_fault  timeout  yes    no        504
a reset once the body was being read       upstream_fault  closed   yes    no        502
not HTTP once the body was being read      upstream_fault  -        no     -         502
=========================================  ==============  =======  =====  ========  ===========

An engine's own answer never counts against its replica, whatever its
status. The engine is up and speaking HTTP, and what it said is about this
request: llama.cpp answers 500 to an ``image_url`` part it cannot read, so
counting 500s let one client open the breaker of a model's only replica and
keep the model down for everybody. The answer is relayed as the engine sent
it (a 429's Retry-After, a 500's message) and not retried: a request that
makes engines fail is not multiplied across the fleet. A replica that is
broken and still answers (vLLM's dead engine loop answers 500 to all) is
taken out by its failing health check, which makes it not Ready, not by its
answers.

502, 503 and 504 are taken for the replica having no answer at all: an
engine still loading or out of capacity says 503, a proxy in front of a dead
engine says 502 or 504. That is evidence about the replica, so they count
against it, but they are suspect, like the failures a request could cause
(a prompt that runs past the head timeout, a request that crashes the
engine): they are retried elsewhere, and the client never gets an engine's
502-504 body, only the router's own 502.

Poison: a suspect fault is counted against its replica only once the
request's next attempt, on another replica, ends some other way (an answer,
a connect error, another kind of fault), or when no other attempt is made.
When the next attempt fails the same way (the same ``suspect``), the request
is poison: it gets its error at once, no further attempt is made, and
neither replica's breaker counts it (``poisoned``). A connection closed
(``closed``) is an engine's death, shared by every request in flight on it:
whether this request caused it is judged by ``llmgw.router.poison`` (in flight
at two engines' deaths, suspect at the first), not by two alike. A connect error, or a
connect timeout, is never suspect: nothing was sent, so the request cannot
have caused it.

A failure before the response is retried when no byte of an answer came:
nothing was sent, or nothing came back before the connection broke or the
wait ran out. Once part of a head has arrived it is not. A body that breaks
(a reset, a killed engine, a stall) is retried: nothing of a whole reply has
reached the client yet, so it is asked again, whole, of another replica; and
a stream is carried on from another replica where it broke (``resume``), so
the verdict only says what the breaker is told. An attempt the router cut
because its replica was found wedged (``Failure.WEDGED``, whether or not its
head had come) is judged as a timeout, and retried.

Failover: a retry spends the router's retry budget, which bounds how much a
brown-out multiplies the load on replicas that fail because they are busy.
A replica that refused the connection, closed it before a byte of an answer
or was found wedged did no work for the request, so moving it elsewhere adds
no load: only ``max_attempts`` bounds that retry. Otherwise one engine dying
with many requests waiting for their first byte would spend the budget at
once and fail the rest. A connect timeout is not failover: the replica may be
there and too busy to accept.

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
    CONNECT_TIMEOUT = "connect_timeout"  # no connection in time: nothing was sent
    TIMEOUT = "timeout"  # a bounded wait ran out once connected
    UNANSWERED = "unanswered"  # the connection closed before any byte of a response
    RESET = "reset"  # the connection closed after part of the response
    PROTOCOL = "protocol"  # the response is not valid HTTP, or exceeds a limit
    WEDGED = "wedged"  # the router cut it: its replica was found wedged


class Suspect(Enum):
    """How a fault that the request itself may have caused showed; two alike are poison."""

    GATEWAY = "gateway"  # an answer of 502, 503 or 504
    TIMEOUT = "timeout"  # no response in time
    CLOSED = "closed"  # the connection closed before the response ended


@attrs.frozen
class Verdict:
    """What an attempt comes to; see the module docstring for the table."""

    outcome: Outcome  # what the replica's breaker is told
    retry: bool  # whether another replica may be tried
    status: int  # what the client is answered, if this attempt answers it
    relayed: bool  # the engine's answer goes to the client as it is
    # the fault may be the request's: counted once the next attempt shows whose
    suspect: Suspect | None = None
    # the replica is gone or wedged: a retry spends no retry budget
    failover: bool = False


_BAD_GATEWAY = 502
_GATEWAY_TIMEOUT = 504
_NO_ANSWER = frozenset((502, 503, 504))
# Before the response started: retried only when the engine cannot have answered.
_RETRIED_FAILURES = frozenset(
    (
        Failure.CONNECT,
        Failure.CONNECT_TIMEOUT,
        Failure.TIMEOUT,
        Failure.UNANSWERED,
        Failure.WEDGED,
    )
)
_TIMEOUTS = frozenset((Failure.CONNECT_TIMEOUT, Failure.TIMEOUT, Failure.WEDGED))
# Before the response started: the replica is gone (nothing connected, or the connection
# closed before any byte of an answer); whenever it came, a cut of a wedged replica.
_GONE = frozenset((Failure.CONNECT, Failure.UNANSWERED))


_SUSPECT_FAILURES = {
    Failure.TIMEOUT: Suspect.TIMEOUT,
    Failure.UNANSWERED: Suspect.CLOSED,
    Failure.RESET: Suspect.CLOSED,
    Failure.WEDGED: Suspect.TIMEOUT,  # as a timeout: it answered nothing in time
}


def _judge_status(status: int) -> Verdict:
    if status in _NO_ANSWER:
        return Verdict(
            "upstream_fault",
            retry=True,
            status=_BAD_GATEWAY,
            relayed=False,
            suspect=Suspect.GATEWAY,
        )
    return Verdict(classify(status), retry=False, status=status, relayed=True)


# Once the body was being read: retried when the exchange broke, not when it was garbled.
_RETRIED_MIDWAY = frozenset((Failure.TIMEOUT, Failure.RESET, Failure.WEDGED))


def _judge_failure(failure: Failure, started: bool) -> Verdict:
    status = _GATEWAY_TIMEOUT if failure in _TIMEOUTS else _BAD_GATEWAY
    retry = failure in (_RETRIED_MIDWAY if started else _RETRIED_FAILURES)
    # Only a retried fault can be checked against another replica's.
    suspect = _SUSPECT_FAILURES.get(failure) if retry else None
    failover = failure is Failure.WEDGED or (not started and failure in _GONE)
    return Verdict(
        "upstream_fault",
        retry=retry,
        status=status,
        relayed=False,
        suspect=suspect,
        failover=failover,
    )


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


def poisoned(first: Verdict, then: Verdict) -> bool:
    """Whether a request whose attempt ended in ``first`` and whose next, on
    another replica, ended in ``then`` failed the same way twice: the
    request's fault, counted against neither replica. A closed connection is
    an engine's death, which other requests in flight share: who caused it is
    judged by ``llmgw.router.poison``, not here."""
    return (
        first.suspect is not None
        and first.suspect is not Suspect.CLOSED
        and then.suspect is first.suspect
    )

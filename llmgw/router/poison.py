"""Requests that crash engines: suspect at one engine's death, poison at a second's.

Theory of operation
-------------------
An engine that dies (a crash, a kill) closes the connection of every request
in flight on it, and the router moves each elsewhere: the innocent ones must
go on, as when an operator or the OOM killer kills an engine. But a request
can be what kills it: llama-server dies of a grammar nested 20,000 deep as its
slot starts, and moved to another replica such a request kills that one too,
and the next; the openai client retries a 502 twice, so one request took down
four replicas (``guards`` refuses the inputs known to do it; this is for the
ones not known yet).

Who is suspect when an engine dies (``Crashes.died``): a request that had no
byte of its answer yet (the engines measured die on a poison input as its work
starts, before they answer), and a request that was alone on the replica (it
was the only thing the engine was doing). A request that was being answered
beside others is not: it had been running, and something else killed the
engine. A suspect request that is in flight when a second engine dies, on
another replica, is poison: it is not sent to a third, the client gets a 400
that says it crashed two engines (a 4xx, which the openai client does not
retry), one line is logged, ``llmgw_router_poisoned{how="crashed"}`` counts
it, and the same body is refused at once for ``REMEMBER_S`` (``Remembered``)
so that a client sending it again kills nothing. An innocent request whose
engine was killed by something else is moved once and goes on; at most two
engines die per poison request.

Which of two suspects killed the second engine cannot be told when both were on
it: a good request waiting beside the poison one on the first engine is as
suspect as it, and moved to the same replica it is found poison too, and its
body refused (measured: a good client's plain "hi" refused for ten minutes). So
suspects are kept apart: a suspect is sent to a replica where no other suspect
is in flight (``balancer.choose``'s ``apart``, counted in ``Endpoint.suspects``
by its ``Lease``), and where every replica holds one it waits for one to clear,
up to ``APART_S``, before it shares.

A stream carried on from another replica (``resume``) keeps its suspicion: its
continuation dying too makes it poison, and it ends with an error event that
says so. What a replica found wedged (stopped, hung) cuts was at no death: its
engine lives, and the wedge is judged by the timeout rule (``verdict``).

Pure but for the responses and the log lines at the bottom: no I/O, no trio.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from llmgw.http import Response
from llmgw.router.errors import openai_error
from llmgw.router.verdict import Failure

if TYPE_CHECKING:
    from llmgw.router.record import Record

log = logging.getLogger("llmgw.router")

# failures that are an engine's death: the connection closed before or during its answer
DEATHS = frozenset((Failure.UNANSWERED, Failure.RESET))
REMEMBER_S = 600.0  # a body that crashed two engines is refused at once for this long
REMEMBER_MOST = 1024  # bodies remembered at once (the oldest is forgotten first)
APART_S = 10.0  # the longest a suspect waits for a replica no other suspect is on


class Crashes:
    """The engine deaths one request was in flight at."""

    __slots__ = ("last", "poison", "suspect_at")

    def __init__(self) -> None:
        self.suspect_at: str | None = None  # the replica at whose death it became suspect
        self.last = ""  # the replica whose engine died under it last
        self.poison = False  # in flight at another engine's death after it became suspect

    def died(self, replica: str, *, answered: bool, alone: bool) -> bool:
        """Note that ``replica``'s engine died with this request in flight on it
        (``answered``: a byte of its answer had arrived; ``alone``: nothing else was
        in flight there). True: the request is poison."""
        self.last = replica
        if self.suspect_at is None:
            if not answered or alone:
                self.suspect_at = replica
        elif replica != self.suspect_at:
            self.poison = True
        return self.poison


class Remembered:
    """Bodies of poison requests, refused at once for ``ttl_s``; bounded in count."""

    __slots__ = ("_bodies", "most", "ttl_s")

    def __init__(self, ttl_s: float = REMEMBER_S, most: int = REMEMBER_MOST) -> None:
        self.ttl_s = ttl_s
        self.most = most
        self._bodies: OrderedDict[bytes, float] = OrderedDict()  # digest: when

    def __bool__(self) -> bool:
        return bool(self._bodies)

    def add(self, body: bytes, now: float) -> None:
        digest = _digest(body)
        self._bodies.pop(digest, None)
        self._bodies[digest] = now
        while len(self._bodies) > self.most:
            self._bodies.popitem(last=False)

    def since(self, body: bytes, now: float) -> float | None:
        """When ``body`` was found poison, if that was less than ``ttl_s`` ago."""
        while self._bodies:  # forget what has expired, oldest first
            digest, when = next(iter(self._bodies.items()))
            if now - when < self.ttl_s:
                break
            del self._bodies[digest]
        return self._bodies.get(_digest(body))


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


# ---------------------------------------------------------------------------- the shell's


class Watch:
    """What the proxy asks of this module: a body to refuse at once, a poison
    request's answer (its one log line, its metric, its body remembered)."""

    __slots__ = ("remembered",)

    def __init__(self) -> None:
        self.remembered = Remembered()

    def refuse(self, body: bytes, record: Record, now: float) -> Response | None:
        """The answer to a body found poison lately; None: route it."""
        if not self.remembered:
            return None  # nothing to hash it against
        when = self.remembered.since(body, now)
        if when is None:
            return None
        record.metrics.poisoned.labels(record.model, "remembered").inc()
        return openai_error(
            400,
            f"this request crashed two engines of {record.model} {now - when:.0f} s ago "
            f"and is refused for {REMEMBER_S:g} s from then: it is not sent to an engine",
            code="request_crashed_engines",
        )

    def crashed(self, body: bytes, record: Record, why: str, now: float) -> str:
        """A request found poison (``record.crashes``): remembered, counted, logged;
        returns the words its client gets."""
        crashes = record.crashes
        assert crashes is not None
        self.remembered.add(body, now)
        record.metrics.poisoned.labels(record.model, "crashed").inc()
        log.warning(
            "request for %s was in flight on replicas %s and %s as their engines died "
            "(%s): taken for what kills them; not sent to another replica, and the same "
            "body is refused for %g s",
            record.model,
            crashes.suspect_at,
            crashes.last,
            why,
            REMEMBER_S,
        )
        return (
            f"the request was in flight on two replicas of {record.model} whose engines "
            f"died ({why}): it is taken for what crashed them and is not sent to another; "
            f"the same request is refused for {REMEMBER_S:g} s"
        )

    def answer(self, body: bytes, record: Record, why: str, now: float) -> Response:
        """``crashed``, as a whole answer: a 400 (the openai client retries no 4xx)."""
        words = self.crashed(body, record, why, now)
        return openai_error(400, words, code="request_crashed_engines")

"""One attempt on one replica: its lease on the replica, and its failures in words.

The upstream pool raises its own exceptions (``llmgw.http.upstream_errors``); the
verdict, which is pure, takes a ``Failure`` instead, and the metrics a
``kind`` label. Both translations are here, next to each other, so that the
proxy and the relay name a failure the same way.
"""

from __future__ import annotations

from llmgw.http.upstream_errors import (
    ConnectFailed,
    ConnectTimeout,
    UpstreamError,
    UpstreamReset,
    UpstreamTimeout,
)
from llmgw.router.balancer import Endpoint
from llmgw.router.breaker import Outcome
from llmgw.router.computing import Entry
from llmgw.router.room import Room
from llmgw.router.slotmap import Pin
from llmgw.router.verdict import Failure


def failure(exc: UpstreamError) -> Failure:
    """The verdict's name for the pool's exception."""
    if isinstance(exc, ConnectTimeout):
        return Failure.CONNECT_TIMEOUT
    if isinstance(exc, UpstreamTimeout):
        return Failure.TIMEOUT
    if isinstance(exc, ConnectFailed):
        return Failure.CONNECT
    if isinstance(exc, UpstreamReset):
        return Failure.UNANSWERED if exc.before_response else Failure.RESET
    return Failure.PROTOCOL


def kind(exc: UpstreamError) -> str:
    """The ``kind`` label of ``llmgw_router_upstream_errors`` for the pool's exception."""
    if isinstance(exc, ConnectFailed):  # ConnectTimeout included
        return "connect"
    if isinstance(exc, UpstreamTimeout):
        return f"timeout_{exc.phase}"
    if isinstance(exc, UpstreamReset):
        return "reset"
    return "protocol"


class Lease:
    """One request on one replica: counted from the start, ended exactly once; its end
    wakes the requests queued in its model's ``room`` (``llmgw.router.room``)."""

    __slots__ = ("endpoint", "entry", "open", "pin", "room", "seq", "sole", "suspect")

    def __init__(
        self, endpoint: Endpoint, now: float, room: Room, *, suspect: bool = False
    ) -> None:
        endpoint.start(now)
        # the prompt it holds there, which others may wait for a copy of
        # (``llmgw.router.computing``): ended with it
        self.entry: Entry | None = None
        # the engine's slot it was sent to (``llmgw.router.slotmap``): ended with it
        self.pin: Pin | None = None
        self.suspect = suspect  # counted in ``endpoint.suspects`` while open
        endpoint.suspects += suspect
        self.endpoint = endpoint
        self.room = room
        self.open = True
        self.seq = endpoint.sent
        self.sole = endpoint.in_flight == 1  # nothing else in flight there as it started

    def alone(self) -> bool:
        """Nothing else was in flight on the replica from this request's start on."""
        return self.sole and self.endpoint.sent == self.seq

    def finish(self, now: float, outcome: Outcome | None) -> None:
        """Tell the replica the request ended (``None``: abandoned, no verdict)."""
        if self.open:
            self.open = False
            self.endpoint.suspects -= self.suspect
            self.endpoint.finish(now, outcome)
            self.room.wake()
            if self.entry is not None:
                self.entry.end()
            if self.pin is not None:
                self.pin.end()

    def first_token(self, now: float) -> None:
        """Its stream's first token came: its prompt is computed."""
        if self.entry is not None:
            self.entry.first_token(now)


def hostport(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]:")
    else:
        host, _, port = rest.rpartition(":")
    return host, int(port or 80)

"""What an exchange with an upstream can fail with, and where it failed.

Every failure of ``UpstreamPool`` (``client.py``) is an ``UpstreamError``
whose ``phase`` says how far the exchange got, because that decides what the
caller may do next (``router/verdict.py`` maps each to a retry or not):

- "connect": no connection was made and nothing was sent (``ConnectFailed``,
  ``ConnectTimeout``), so the request may go anywhere else;
- "send": writing the request; on a fresh connection the upstream saw at most
  part of it;
- "head": waiting for or reading the response head. A reset before any byte
  of the response (``UpstreamReset.before_response``) means the client can
  still be answered from elsewhere, though the upstream may have seen the
  request;
- "body": reading the response body; the client may already have part of it.

The kinds cut across the phases: ``UpstreamTimeout`` (a ``ClientLimits``
bound ran out), ``UpstreamReset`` (the upstream closed or reset the
connection, or the pool was closed under the exchange) and
``UpstreamProtocolError`` (not HTTP/1.x, or over a limit).
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["connect", "send", "head", "body"]


class UpstreamError(Exception):
    """An exchange with an upstream failed; ``phase`` says where.

    "connect": nothing was sent. "send": writing the request. "head": waiting
    for or reading the response head. "body": reading the response body."""

    def __init__(self, message: str, phase: Phase) -> None:
        super().__init__(message)
        self.phase: Phase = phase


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing was sent, always safe to retry elsewhere."""

    def __init__(self, message: str, phase: Phase = "connect") -> None:
        super().__init__(message, phase)


class UpstreamTimeout(UpstreamError):
    """A wait bounded by ``ClientLimits`` ran out; ``phase`` says which."""


class ConnectTimeout(ConnectFailed, UpstreamTimeout):
    """Connecting timed out: both a ``ConnectFailed`` and an ``UpstreamTimeout``."""


class UpstreamReset(UpstreamError):
    """The upstream closed or reset the connection.

    ``before_response``: no byte of the response had arrived, so the client
    can still be answered by retrying elsewhere (the upstream may have seen
    the request, though, unless ``phase`` is "send" on a fresh connection)."""

    def __init__(self, message: str, phase: Phase, before_response: bool) -> None:
        super().__init__(message, phase)
        self.before_response = before_response


class UpstreamProtocolError(UpstreamError):
    """The upstream's response is not valid HTTP/1.x, or exceeds a limit."""

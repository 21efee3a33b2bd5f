"""Composition roots: each daemon wired from its parts; only the CLI imports these.

``server`` (``llmgw server``: control plane, admin API, in-process router),
``agent`` (``llmgw agent``) and ``router`` (``llmgw router``, standalone).
They sit at the top of the layers: they import the domain packages, and no
domain package imports them.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llmgw.addr import join_hostport

T = TypeVar("T")

# What an operator does about each way a bind fails.
_BIND_PROBLEMS = {
    errno.EADDRINUSE: "address already in use; stop what holds it or choose another port",
    errno.EADDRNOTAVAIL: (
        "no interface of this machine has that address; use one of its addresses,"
        " or 0.0.0.0 for all of them"
    ),
    errno.EACCES: (
        "permission denied: a port below 1024 needs root or CAP_NET_BIND_SERVICE;"
        " choose a port above 1023"
    ),
}


class ListenError(Exception):
    """A listener could not be opened; one line naming the address, its key and what to do."""


def listen_problem(key: str, host: str, port: int, exc: OSError) -> str:
    """``cannot listen on HOST:PORT (KEY): what went wrong; what to do``."""
    where = join_hostport(host or "*", port)
    if isinstance(exc, socket.gaierror):
        problem = (
            f"cannot resolve {host!r}: {exc.strerror or exc};"
            " write an address, or a name this machine resolves"
        )
    else:
        problem = _BIND_PROBLEMS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()
    return f"cannot listen on {where} ({key}): {problem}"


async def open_listeners(key: str, host: str, port: int, start: Callable[[], Awaitable[T]]) -> T:
    """Open a daemon's listener with ``start``; a bind that fails is a :class:`ListenError`.

    ``start`` is typically ``nursery.start(server.serve_tcp, host, port)``: an
    error raised before the server started comes out of it as itself, or in a
    group when the server opens its sockets inside a nursery of its own.
    """
    try:
        return await start()
    except (OSError, BaseExceptionGroup) as exc:
        found = _first_os_error(exc)
        if found is None:
            raise
        raise ListenError(listen_problem(key, host, port, found)) from None


def _first_os_error(exc: BaseException) -> OSError | None:
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _first_os_error(inner)) is not None:
                return found
    return None

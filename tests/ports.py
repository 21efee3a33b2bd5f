"""Ports for servers that must be told theirs before they start.

A server of ours listens on port 0 and says what it bound. An engine, a
stand-in, or a fleet whose agents must know the control plane's port before
it starts cannot, so it gets a port from this process's own slice of
10000-19999: below the kernel's ephemeral range (32768 and up), so no outgoing
connection can take it between the check here and the server's bind, and
apart from the slices of other test processes and from the engine port
ranges the suite gives agents (20000 and up). Binding port 0, closing, and
handing the number on is what this replaces: any connect() may be given that
port in between.
"""

from __future__ import annotations

import itertools
import os
import socket

_SLICE = 50
_BASE = 10000 + (os.getpid() % 200) * _SLICE
_turn = itertools.count()


def own_port() -> int:
    """A port of this process's slice that nothing listens on now; successive
    calls give different ports, so a test can take several before starting any."""
    for _ in range(_SLICE):
        port = _BASE + next(_turn) % _SLICE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"every port in {_BASE}-{_BASE + _SLICE - 1} is taken")

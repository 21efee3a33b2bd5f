from __future__ import annotations

import pytest
import trio

from .helpers import StartServer, server_starter


@pytest.fixture
def start_server(nursery: trio.Nursery) -> StartServer:
    """`await start_server(handler, limits=...)` -> (server, port); stopped with the test."""
    return server_starter(nursery)

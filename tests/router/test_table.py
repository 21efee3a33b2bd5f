"""The routing snapshot that the in-process table and every watcher share."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.router.table import FleetRouting


async def test_the_snapshot_is_built_once_per_max_age_however_many_ask(
    autojump_clock: trio.testing.MockClock,
) -> None:
    routing = FleetRouting(None, max_age_s=0.25)
    first = routing()
    assert all(routing() is first for _ in range(5))  # the table and four watchers
    await trio.sleep(0.3)
    second = routing()
    assert second is not first
    assert second.version == first.version  # nothing changed: same table, new build

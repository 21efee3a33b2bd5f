"""Health of engines that are ready: a check on an interval, and a verdict on a threshold.

Until an engine is ready, the supervisor polls its health endpoint for the
startup timeout. Once it is ready nothing else would notice an engine that
hangs (stopped, deadlocked, swapped out): its process runs, so no exit is
seen, and requests to it simply stall. ``watch`` keeps asking the health
endpoint of a ready engine every ``interval_s``, each check bounded by
``timeout_s``; after ``unhealthy_after`` checks in a row without a good
answer the engine is unhealthy, and at the first good answer after that it
is healthy again. Each change is handed to ``on_change`` once, as it
happens: the supervisor logs it and reports it to the control plane, which
routes nothing to an unhealthy engine until it recovers.

An unhealthy engine is not a lifecycle phase: the shard stays ready (its
process runs and may answer again), and stopping or replacing it is the
control plane's decision, not the agent's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio


@attrs.frozen
class HealthSettings:
    interval_s: float = 2.0  # between checks of a ready engine
    unhealthy_after: int = 3  # checks in a row without a good answer
    timeout_s: float = 2.0  # each check, at most

    @classmethod
    def every(cls, interval_s: float, unhealthy_after: int) -> HealthSettings:
        """A check never outlasts the interval, so checks do not pile up."""
        return cls(interval_s, max(1, unhealthy_after), min(interval_s, 2.0))


async def watch(
    check: Callable[[], Awaitable[bool]],
    still_watched: Callable[[], bool],
    settings: HealthSettings,
    on_change: Callable[[bool, str], None],
) -> None:
    """Check until ``still_watched`` says no; ``on_change(healthy, why)`` on each change."""
    failures, healthy = 0, True
    while True:
        await trio.sleep(settings.interval_s)
        if not still_watched():
            return
        ok = False
        with trio.move_on_after(settings.timeout_s):
            ok = await check()
        if not still_watched():
            return
        if ok:
            failures = 0
            if not healthy:
                healthy = True
                on_change(True, "answers its health check again")
            continue
        failures += 1
        if healthy and failures >= settings.unhealthy_after:
            healthy = False
            on_change(
                False,
                f"no answer to {failures} health checks in a row "
                f"({settings.interval_s:g} s apart, {settings.timeout_s:g} s each)",
            )

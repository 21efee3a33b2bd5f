"""A warning logged at most once per interval, with a count of the ones held back.

What a hostile client makes the server do (refused connections, cut bodies,
cut readers) can happen thousands of times a second: the operator reads one
line per interval that names the latest case and counts the rest.
"""

from __future__ import annotations

import logging

import trio

logger = logging.getLogger("llmgw.http")

WARN_INTERVAL_S = 10.0


class Throttled:
    """``warn`` logs ``message % args`` at most once per ``WARN_INTERVAL_S``; ``count``
    is every call (a metric's counter)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.last = -WARN_INTERVAL_S
        self.suppressed = 0
        self.count = 0

    def warn(self, *args: object) -> None:
        self.count += 1
        now = trio.current_time()
        if now - self.last < WARN_INTERVAL_S:
            self.suppressed += 1
            return
        logger.warning(self.message + " (%d more since last report)", *args, self.suppressed)
        self.last = now
        self.suppressed = 0

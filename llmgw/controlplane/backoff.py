"""Crash-loop backoff: a model whose new replicas keep failing is retried ever later.

Theory of operation
-------------------
A model is *watched* from its first placement attempt until one of its
replicas becomes Ready. Each replica of it that fails before it served (a
crash on start, a startup timeout) and each placement that finds no room
doubles the wait before the next attempt, from ``base_s`` up to ``cap_s``; a
replica becoming Ready forgets it all. A replica that fails while it served
retries at once: that is not a loop.

While a model is watched a spread of it is not looked for (something of it
is coming or failing already), and while its replicas keep failing
(``looping``) a spread of it in progress is called off: the replacement
would fail the same way, and the serving replica stays.

This module is pure: ``now`` comes in with every call.
"""

from __future__ import annotations

import attrs


@attrs.define
class _Attempts:
    failures: int = 0
    next_attempt: float = 0.0


class CrashLoops:
    """Per model: failures since one of its replicas last became Ready, and the next try."""

    def __init__(self, base_s: float, cap_s: float) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._models: dict[str, _Attempts] = {}

    def may_try(self, model: str, now: float) -> bool:
        """Whether placing the model may be tried now; it is watched from here on."""
        return now >= self._models.setdefault(model, _Attempts()).next_attempt

    def failed(self, model: str, now: float) -> None:
        """A replica failed before it served, or placement found no room: wait longer."""
        a = self._models.setdefault(model, _Attempts())
        a.failures += 1
        a.next_attempt = now + min(self.cap_s, self.base_s * 2 ** (a.failures - 1))

    def served(self, model: str) -> None:
        """A replica became Ready: the loop, if any, is over."""
        self._models.pop(model, None)

    def watched(self, model: str) -> bool:
        """Placed or failed since a replica of it last became Ready."""
        return model in self._models

    def looping(self, model: str) -> bool:
        """A replica of it failed (or could not be placed) since one last became Ready."""
        a = self._models.get(model)
        return a is not None and a.failures > 0

    def wait_s(self, model: str, now: float) -> float | None:
        """Seconds until the next try at a model whose replicas keep failing, if waiting."""
        a = self._models.get(model)
        if a is None or a.failures == 0:
            return None
        left = a.next_attempt - now
        return left if left > 0 else None

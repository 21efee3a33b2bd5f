"""Requests held for a model with no replica, until one starts; and each model's load,
for the control plane's scaling.

Theory of operation
-------------------
A model with a range of replicas (the routing snapshot's ``ModelRouting.scales``)
may have none: it drained to zero after its idle time, or its first replica is
still starting. A request for it then is not refused: the router holds it
(``Proxy``) in the model's ``Room``, the same queue a full model's requests wait
in, and tells the control plane at once (``notify``: the in-process router
wakes the fleet's pass, a standalone router sends its report now), which
starts a replica (``llmgw.controlplane.scaling``). The table's change that
lists the replica Ready wakes every waiter, and the held requests go to it in
their turn.

Bounded twice: at most ``max_held`` requests per model wait (more: 503 at
once), each for at most ``hold_s`` from its arrival (the router's request
timeouts count from when it is sent); past it, 503 with ``Retry-After`` saying
how long a start takes (the control plane's measured ``start_s``), never a 429,
which would blame the client for the fleet's state.

``loads``: each ranged model's requests at this router now, in flight at its
replicas (the router's own counts) and waiting in its room (queued for room, or
held), and how many arrived since the last reading (a request shorter than the
time between readings is use all the same: the model is not idle), which the
control plane sums over routers and feeds to the scaling rule. A standalone
router reports at once when the first request arrives after a reading
(``arrivals``), then every ``report.LOAD_S`` while there is any.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from llmgw.http.types import Response
from llmgw.router.balancer import Endpoint
from llmgw.router.errors import openai_error
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelLoad

log = logging.getLogger("llmgw.router")

HOLD_S = 120.0  # the longest a request waits for a replica to start
MAX_HELD = 1000  # requests held at once per model


class Holds:
    """This router's held requests, and what it tells the control plane."""

    def __init__(
        self,
        table: RoutingTable,
        *,
        hold_s: float = HOLD_S,
        max_held: int = MAX_HELD,
        notify: Callable[[str], None] = lambda model: None,
        arrivals: Callable[[], None] = lambda: None,
    ) -> None:
        self.table = table
        self.hold_s = hold_s
        self.max_held = max_held
        self.notify = notify  # a request is held for this model: the control plane is told
        self._held: dict[str, int] = {}  # model -> requests held now
        # the first request since the last reading: a reader that reads on change hears
        # (a standalone router's report), so that use is not missed between reports
        self.arrivals = arrivals
        self._arrived: dict[str, int] = {}  # model -> requests since the last reading

    def arrived(self, model: str) -> None:
        """A request for ``model`` arrived (counted for models that scale only)."""
        if model in self.table.scales:
            if not self._arrived:
                self.arrivals()
            self._arrived[model] = self._arrived.get(model, 0) + 1

    def until(self, model: str, endpoints: list[Endpoint], started: float) -> float | None:
        """Until when a request of ``model`` that arrived at ``started`` is held now: the
        model scales and none of its replicas can serve; None: not held."""
        if model not in self.table.scales or any(ep.ready and not ep.draining for ep in endpoints):
            return None
        return started + self.hold_s

    def full(self, model: str) -> bool:
        return self._held.get(model, 0) >= self.max_held

    def begin(self, model: str, *, first: bool) -> None:
        """A request of ``model`` waits (again) for a replica; ``first``: it was not held
        before (the control plane is told at once)."""
        n = self._held[model] = self._held.get(model, 0) + 1
        if first:
            if n == 1:
                log.info("holding requests for %s until a replica of it starts", model)
            self.notify(model)

    def end(self, model: str) -> None:
        n = self._held.get(model, 0) - 1
        if n > 0:
            self._held[model] = n
        else:
            self._held.pop(model, None)

    def held(self, model: str) -> int:
        return self._held.get(model, 0)

    def refusal(self, model: str, held_s: float) -> Response:
        """503 for a request held past its bound (or one the hold has no room for)."""
        start_s = self.table.scales.get(model, 0.0)
        if held_s > 0:
            took = f"{held_s:.1f}" if held_s < 10 else f"{held_s:.0f}"
            why = f"held {took} s and no replica of {model} started"
        else:
            why = f"{self.held(model)} requests are already held for {model}, which has no replica"
        then = (
            f"a start takes about {start_s:.0f} s: try again then" if start_s else "try again soon"
        )
        r = openai_error(503, f"{why}; {then}", "server_error", code="starting")
        r.headers.append(("retry-after", str(max(1, math.ceil(start_s or 1)))))
        return r

    def loads(self) -> dict[str, ModelLoad]:
        """Each ranged model's requests here now (``ModelLoad``); its arrivals count
        from here on (one reader: the fleet's pass, or the router's reports)."""
        out = {}
        arrived, self._arrived = self._arrived, {}
        for model in self.table.scales:
            in_flight = sum(ep.in_flight for ep in self.table.endpoints.get(model, ()))
            waiting = len(self.table.rooms(model))
            came = arrived.get(model, 0)
            if in_flight or waiting or came:
                out[model] = ModelLoad(in_flight=in_flight, waiting=waiting, arrived=came)
        return out

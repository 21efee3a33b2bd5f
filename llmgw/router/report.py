"""A standalone router's report to the control plane, apart from following its routing.

Theory of operation
-------------------
The control plane lists a router's metrics listener for its service discovery,
and fails a replica that routers hold wedged (work in flight, no progress) for
long enough. Both come from the router's ``routing.RouterReport``, which
``Reporter`` posts to ``routing.REPORT_PATH``: at once when it starts, when its
metrics listener is open, when what its table holds wedged changes (the table
judges after every scrape), within ``USAGE_S`` when what tenants' keys used
through it has grown (``tally``: counts since it started, which the control
plane's usage ledger turns into what grew), and otherwise every ``every_s``,
well within the time after which the control plane forgets a router it has not
heard from.
Each report says everything again, under the router's own id (each worker of a
router reports for its own table).

While the control plane cannot be reached, reports are tried again within
``RETRY_CAP_S``, so a restarted one hears them within seconds; the routing
watch says in its own words that the control plane is away. A control plane
older than the report answers 404: the reporter then hands its report to the
routing watch as query parameters of each poll (``query``), as routers before
it did, and keeps trying the report on its timer for when the control plane
is upgraded.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import httpx
import msgspec
import trio

from llmgw.router.tally import Tally
from llmgw.routing import REPORT_PATH, ModelCounters, ModelLoad, RouterReport

log = logging.getLogger("llmgw.router")

REPORT_S = 20.0  # the control plane forgets a router not heard from for 75 s
USAGE_S = 5.0  # what tenants used, and requests answered, reach the control plane this soon
LOAD_S = 2.0  # while a model that scales has requests here, reported this often
GAP_S = 0.25  # two reports are at least this far apart, however much news comes
RETRY_CAP_S = 2.0


class Reporter:
    def __init__(self, admin_url: str, token: str, *, every_s: float = REPORT_S) -> None:
        self.url = admin_url.rstrip("/") + REPORT_PATH
        self.every_s = every_s
        self.router_id = secrets.token_hex(6)
        self.metrics_address = ""  # where this router serves its metrics ("": nowhere)
        self.older = False  # the control plane takes no report: it rides on the polls
        self._wedged: frozenset[str] = frozenset()
        self._headers = {"authorization": f"Bearer {token}"}
        self._changed = trio.Event()
        self._refused = False
        self._loaded = False  # the last report said a load
        self._last = -GAP_S  # when the last report began
        self.tally = Tally()  # what tenants' keys used here (the router app's)
        # each ranged model's requests here now (``hold.Holds.loads``)
        self.load: Callable[[], dict[str, ModelLoad]] = dict
        # what it believes each replica of a ranged model holds (``RoutingTable.cached``)
        self.cached: Callable[[], dict[str, int]] = dict
        # each model's requests here since it started (``counters.model_counters``)
        self.traffic: Callable[[], dict[str, ModelCounters]] = dict

    def report(self) -> RouterReport:
        return RouterReport(
            router=self.router_id,
            metrics=self.metrics_address,
            wedged=sorted(self._wedged),
            usage=self.tally.rows(),
            load=self.load(),
            cached=self.cached(),
            traffic=self.traffic(),
        )

    def serves_metrics(self, address: str) -> None:
        """Its metrics listener is open at ``address`` ("host:port")."""
        self.metrics_address = address
        self._changed.set()

    def wedged(self, replica_ids: frozenset[str]) -> None:
        """What the table holds wedged now (``RoutingTable.on_wedged``)."""
        if replica_ids != self._wedged:
            self._wedged = replica_ids
            self._changed.set()

    def held(self) -> None:
        """A request is held for a model with no replica: the control plane hears now."""
        self._changed.set()

    def arrived(self) -> None:
        """Requests for a model that scales arrive again after a reading: heard now when
        this router has reported no load lately (then every ``LOAD_S`` while it has)."""
        if not self._loaded:
            self._changed.set()

    def query(self) -> dict[str, str]:
        """The report as query parameters of a routing poll, for a control plane older
        than the report; none for one that takes it."""
        if not self.older:
            return {}
        report = self.report()
        said = {"router": report.router, "wedged": ",".join(report.wedged)}
        return said | ({"metrics": report.metrics} if report.metrics else {})

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            task_status.started()
            delay = 0.5
            while True:
                # news that comes while a report is sent waits for the next, not less
                # than GAP_S after it: a busy router's news is not one report a request
                await trio.sleep_until(self._last + GAP_S)
                self._last = trio.current_time()
                self._changed = trio.Event()
                counted = self.tally.changes
                report = self.report()
                answered = _answered(report.traffic)
                sent = await self._send(client, report)
                delay = 0.5 if sent else min(delay * 2, RETRY_CAP_S)
                # a load is told again soon, and so is its end (an empty one after it)
                every = LOAD_S if report.load or self._loaded else self.every_s
                self._loaded = bool(report.load)
                until = trio.current_time() + (every if sent else delay)
                while not self._changed.is_set() and trio.current_time() < until:
                    # tenants' usage is news too, told at most every USAGE_S
                    if sent and (
                        self.tally.changes != counted or _answered(self.traffic()) != answered
                    ):
                        until = min(until, trio.current_time() + USAGE_S)
                    with trio.move_on_at(min(until, trio.current_time() + USAGE_S)):
                        await self._changed.wait()

    async def _send(self, client: httpx.AsyncClient, report: RouterReport) -> bool:
        """One report; False when the control plane could not be reached."""
        try:
            r = await client.post(
                self.url, content=msgspec.json.encode(report), headers=self._headers
            )
        except httpx.HTTPError:
            return False
        older = r.status_code in (404, 405)
        if older != self.older:
            self.older = older
            log.info(
                "the control plane takes no router report (it is older than this router): "
                "this router reports with its routing polls instead"
                if older
                else "the control plane takes router reports: this router posts its own"
            )
        log.debug("router %s reported to the control plane: %s", self.router_id, r.status_code)
        refused = r.status_code >= 400 and not older
        if refused and not self._refused:  # said once, until a report is taken again
            log.warning("the control plane refused this router's report: %s", r.text[:300])
        self._refused = refused
        return True


def _answered(traffic: dict[str, ModelCounters]) -> int:
    return sum(c.requests for c in traffic.values())

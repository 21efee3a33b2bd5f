"""The routers that follow the routing, as their reports say: where their metrics are,
what they hold wedged, their load and what they believe replicas hold cached.

Theory of operation
-------------------
Following the routing (``RoutingPublisher``, ``GET /v1/routing``) and
reporting to the control plane are two things, kept apart: a standalone
router posts a ``routing.RouterReport`` to ``routing.REPORT_PATH`` on a
timer of its own and at once when what it holds wedged changes. Its metrics
listener is listed by the service discovery (``/sd``), and the replicas it
holds wedged (work in flight, no progress) are failed by the reconciler once
routers have said so for the wedged grace. The router inside ``llmgw server``
says what it holds wedged here too, in process.

Every report says everything again, so what a router said lasts until it says
otherwise or is not heard from for ``FOLLOWER_TTL_S``: a router that went away
takes its word with it. Both tables are bounded (``MAX_FOLLOWERS``); an entry
never seen before waits for room. A report is checked whole before any of it
is taken: a bad one changes nothing.

Routers older than the report said the same as query parameters of their
routing poll; the admin API turns those into a report, for one release.
"""

from __future__ import annotations

import re
from typing import TypeVar

from llmgw.addr import join_hostport
from llmgw.config import ConfigError, parse_hostport
from llmgw.routing import ModelCounters, ModelLoad, RouterReport, summed

_T = TypeVar("_T", dict[str, ModelLoad], frozenset[str], dict[str, int], dict[str, ModelCounters])
ROUTER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
REPLICA_ID = re.compile(r"[A-Za-z0-9._:/-]{1,200}")
MAX_WEDGED = 1000
MAX_LOADS = 10_000  # models a report may say the load of
MAX_CACHED = 10_000  # replicas a report may say the cache of
MAX_BUCKETS = 64  # bounds of a time-to-first-token histogram in a report
LOAD_TTL_S = 10.0  # a router's load counts this long after it said it (it says it every 2 s)
_WILDCARDS = ("0.0.0.0", "::", "")


class ReportRefused(ValueError):
    """A router's report that is not well formed, in words for its 400."""


class RouterReports:
    """What the routers heard from lately said."""

    # a router reports at least this often (and an older one asks for the routing at
    # least this often); one not heard from for this long is no longer listed
    FOLLOWER_TTL_S = 75.0
    MAX_FOLLOWERS = 1000

    def __init__(self) -> None:
        # standalone routers' metrics listeners ("host:port") -> when last heard from
        self._followers: dict[str, float] = {}
        # each router's (its own id's) wedged replicas, and when it last said so
        self._wedged: dict[str, tuple[frozenset[str], float]] = {}
        # each router's load per model (``scaling``), and when it said it
        self._loads: dict[str, tuple[dict[str, ModelLoad], float]] = {}
        # each router's estimate of what each replica of a ranged model holds cached
        self._cached: dict[str, tuple[dict[str, int], float]] = {}
        # each router's requests per model since it started (the console's traffic)
        self._traffic: dict[str, tuple[dict[str, ModelCounters], float]] = {}
        # each router (its id) -> when it last reported
        self._heard: dict[str, float] = {}

    def take(self, report: RouterReport, seen_from: str, now: float) -> None:
        """Take what ``report`` says (a wildcard metrics host: ``seen_from``, the address
        the report came from). A report without a router id says nothing of what it
        holds wedged (an older router's poll without one).

        Raises:
            ReportRefused: the report is not well formed; nothing was taken.
        """
        if report.router and not ROUTER_ID.fullmatch(report.router):
            raise ReportRefused("router must be 1-64 letters, digits, '-' or '_'")
        wedged = frozenset(report.wedged)
        if len(wedged) > MAX_WEDGED or not all(REPLICA_ID.fullmatch(r) for r in wedged):
            raise ReportRefused("wedged must be at most 1,000 replica ids")
        if len(report.load) > MAX_LOADS or any(
            min(load.in_flight, load.waiting, load.arrived) < 0 for load in report.load.values()
        ):
            raise ReportRefused("load must be at most 10,000 models, none below 0")
        if len(report.cached) > MAX_CACHED or not all(
            n >= 0 and REPLICA_ID.fullmatch(r) for r, n in report.cached.items()
        ):
            raise ReportRefused("cached must be at most 10,000 replica ids, none below 0")
        if len(report.traffic) > MAX_LOADS or not all(
            min(c.requests, c.errors, c.tokens, *c.ttft_counts) >= 0
            and len(c.ttft_le) == len(c.ttft_counts) <= MAX_BUCKETS
            for c in report.traffic.values()
        ):
            raise ReportRefused(
                "traffic must be at most 10,000 models, counts not below 0, as many"
                f" ttft_counts as ttft_le, at most {MAX_BUCKETS}"
            )
        address = ""
        if report.metrics:
            try:
                host, port = parse_hostport(report.metrics, key="metrics")
            except ConfigError:
                raise ReportRefused("metrics must be host:port") from None
            address = join_hostport(seen_from if host in _WILDCARDS else host, port)
        if address:
            self.followed_by(address, now)
        if report.router:
            self._seen(self._heard, report.router, now)
            self.report_wedged(report.router, wedged, now)
            self.report_load(report.router, report.load, now)
            self._keep(self._cached, report.router, report.cached, now)
            self._keep(self._traffic, report.router, report.traffic, now)

    def report_load(self, router: str, load: dict[str, ModelLoad], now: float) -> None:
        """One router's load per model now (every report says it again; empty: none)."""
        self._keep(self._loads, router, load, now)

    def loads(self, now: float) -> dict[str, ModelLoad]:
        """Each model's load at the standalone routers that said it lately, summed."""
        for router, (_, at) in list(self._loads.items()):
            if now - at > LOAD_TTL_S:
                del self._loads[router]
        return summed(said for said, _ in self._loads.values())

    def cached(self, now: float) -> dict[str, int]:
        """Each replica's cached prompt blocks as the routers heard from lately believe,
        summed (each router's index holds what that router sent it)."""
        self._forget_old(now)
        out: dict[str, int] = {}
        for said, _ in self._cached.values():
            for replica, blocks in said.items():
                out[replica] = out.get(replica, 0) + blocks
        return out

    def traffic(self, now: float) -> dict[str, dict[str, ModelCounters]]:
        """Each router heard from lately -> its requests per model since it started."""
        self._forget_old(now)
        return {router: said for router, (said, _) in self._traffic.items()}

    def followed_by(self, metrics_address: str, now: float) -> None:
        """A standalone router that serves metrics there reported."""
        self._seen(self._followers, metrics_address, now)

    def _seen(self, table: dict[str, float], key: str, now: float) -> None:
        """``key`` heard from now; bounded: one never heard before waits for room."""
        if key not in table and len(table) >= self.MAX_FOLLOWERS:
            self._forget_old(now)
            if len(table) >= self.MAX_FOLLOWERS:
                return
        table[key] = now

    def report_wedged(self, router: str, replica_ids: frozenset[str], now: float) -> None:
        """What one router holds wedged now (every report says it again; empty: none)."""
        self._keep(self._wedged, router, replica_ids, now)

    def _keep(self, table: dict[str, tuple[_T, float]], router: str, said: _T, now: float) -> None:
        """What ``router`` says now, kept in ``table`` (nothing said: its entry goes);
        bounded: a router never heard from before waits for room."""
        if not said:
            table.pop(router, None)
            return
        if router not in table and len(table) >= self.MAX_FOLLOWERS:
            self._forget_old(now)
            if len(table) >= self.MAX_FOLLOWERS:
                return
        table[router] = (said, now)

    def wedged(self, now: float) -> frozenset[str]:
        """The replicas some router heard from lately holds wedged."""
        self._forget_old(now)
        out: frozenset[str] = frozenset()
        for ids, _ in self._wedged.values():
            out |= ids
        return out

    def followers(self, now: float) -> list[str]:
        """The metrics listeners of the routers heard from lately, sorted."""
        self._forget_old(now)
        return sorted(self._followers)

    def routers(self, now: float) -> int:
        """How many standalone routers (each worker one) reported lately."""
        return sum(1 for seen in self._heard.values() if now - seen <= self.FOLLOWER_TTL_S)

    def _forget_old(self, now: float) -> None:
        for heard in (self._followers, self._heard):
            for name, seen in list(heard.items()):
                if now - seen > self.FOLLOWER_TTL_S:
                    del heard[name]
        for router, (_, said) in list(self._wedged.items()):
            if now - said > self.FOLLOWER_TTL_S:
                del self._wedged[router]
        for table in (self._cached, self._traffic):
            for router, (_, said) in list(table.items()):
                if now - said > self.FOLLOWER_TTL_S:
                    del table[router]

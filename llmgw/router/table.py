"""The routing table: which endpoints serve each model, kept in step with the fleet.

The table follows the control plane's routing ``Snapshot`` through a watch,
an ``async (since) -> Snapshot`` that answers when the snapshot's version is
not ``since``: inside ``llmgw server`` the control plane's publisher itself,
in a standalone ``llmgw router`` ``HttpWatch`` over ``GET /v1/routing`` (a
long poll that answers on the change). Nothing polls on a timer. Endpoints
keep their identity across snapshots, so each keeps its in-flight count,
breaker and load signals. A Draining replica stays in the table (its
in-flight requests finish) but takes no new request. A control plane that
has just started does not know yet what the nodes it has not heard from run:
the routes held to those stay (``llmgw.routing.carried``) until it has heard
from their node or settled. While the control plane cannot be reached at all,
the table stays as it is; either way each endpoint's breaker and wedge
judgement go on protecting clients.

Engine gauges are scraped once a second, every endpoint at once, each scrape
bounded by the next beat: one dead replica ages nobody's gauges but its own.

Requests queued for room wait in their model's room (``rooms``, see
``llmgw.router.room``): a snapshot applied, a reading of a replica's gauges
and every scrape beat wake them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import trio

from llmgw.engines import adapters
from llmgw.engines.base import EngineAdapter
from llmgw.engines.load import read_load
from llmgw.router.balancer import Admission, Endpoint, note_heard, note_progress, silent, wedged
from llmgw.router.prefix import MODES, ROUTER_BLOCKS, Mode, blocks_for
from llmgw.router.room import Rooms
from llmgw.routing import Limits, RouterKey, Snapshot, TrafficView, carried, kept_ready

log = logging.getLogger("llmgw.router")

Watch = Callable[[str], Awaitable[Snapshot]]


class RoutingTable:
    """The endpoints of every model, as of the last snapshot the watch gave.

    ``initial`` is applied at once (inside ``llmgw server``, the publisher's
    current snapshot, so the endpoint never serves from an empty table); a
    standalone router starts empty and routes once its watch answers (``heard``):
    until then it knows neither the models nor the tenants' keys, and says so
    rather than refuse a good key (``router.app``).
    """

    def __init__(
        self,
        watch: Watch | None = None,
        initial: Snapshot | None = None,
        *,
        scrape_s: float = 1.0,
        on_gone: Callable[[list[str]], None] = lambda _: None,
        wedged_after_s: float = 30.0,
        silent_after_s: float = 6.0,
        on_wedged: Callable[[frozenset[str]], None] = lambda _: None,
        on_keys: Callable[[list[RouterKey]], None] = lambda _: None,
        alone: Callable[[], bool] | None = None,
    ) -> None:
        self.watch = watch  # None: fed by ``apply`` alone (tests)
        self.heard = trio.Event()  # set by the first snapshot applied (or with no watch)
        if watch is None:
            self.heard.set()
        # whether this is the fleet's only router (the server's, while no standalone
        # router reports); None: a standalone router, which never is (the server's
        # routes too). Read each scrape: ``only``
        self.alone = alone
        # this router is the only one: it places new conversations evenly over a model's
        # replicas and keeps a conversation where it sent it, not by rendezvous alone
        # (which every router agrees on)
        self.only = False
        self.on_gone = on_gone  # told the replicas that left the table, once each
        self.scrape_s = scrape_s
        self.wedged_after_s = wedged_after_s
        self.silent_after_s = silent_after_s
        self.on_wedged = on_wedged  # told the replicas held wedged, after every judgement
        # told the control plane's API keys when they change (a standalone router's ring)
        self.on_keys = on_keys
        self._keys: list[RouterKey] | None = None
        self.tenants: dict[str, Limits] = {}  # each tenant's limits (``quota``)
        self._weights: dict[str, float] = {}  # tenants' weights other than 1 (``fair``)
        self.version = ""
        self.carried: frozenset[str] = frozenset()  # routes kept that the snapshot lacks
        self.endpoints: dict[str, list[Endpoint]] = {}
        self.admission: dict[str, Admission] = {}
        # how each model's requests are read for affinity: "prefix" if a replica of it
        # routes by prefix, else "session" if one does by session, else "off"
        self.affinity: dict[str, Mode] = {}
        self._known: frozenset[str] = frozenset()
        self._by_key: dict[str, Endpoint] = {}
        self.rooms = Rooms()  # where each model's queued requests wait for room
        # models with a range of replicas -> how long one takes to start (``hold``)
        self.scales: dict[str, float] = {}
        if initial is not None:
            self.apply(initial)

    def weight(self, tenant: str) -> float:
        """A tenant's weight in a full model's queue (``fair``); 1 for any other."""
        return self._weights.get(tenant, 1.0)

    def known(self, model: str) -> bool:
        return model in self._known

    def apply(self, snap: Snapshot) -> None:
        if snap.version and snap.version == self.version:
            return
        table: dict[str, list[Endpoint]] = {}
        seen: set[str] = set()
        for route in snap.routes:
            ep = self._by_key.get(route.key)
            if ep is None or ep.url != route.url:
                ep = self._by_key[route.key] = Endpoint(
                    key=route.key, model=route.model, url=route.url, ready=False
                )
            ep.ready = kept_ready(route, ep.url, ep.engine_key, ep.ready)
            ep.weight = route.weight
            ep.admission = (
                Admission(target_waiting=route.target_waiting, kv_ceiling=route.kv_ceiling)
                if route.target_waiting is not None or route.kv_ceiling is not None
                else None
            )
            ep.draining = route.draining
            ep.engine_key = route.engine_key
            ep.engine = route.engine
            ep.node = route.node
            ep.affinity = _mode(route.affinity)
            ep.affinity_bound = max(1.0, route.affinity_bound)
            table.setdefault(route.model, []).append(ep)
            seen.add(route.key)
        # each replica's index is bounded by what it holds, and all of them by the
        # router's budget (``llmgw_router_prefix_index_bytes``)
        share = ROUTER_BLOCKS // max(1, len(snap.routes))
        for route in snap.routes:
            self._by_key[route.key].prefix.resize(min(share, blocks_for(route.cache_tokens)))
        held = [ep for eps in self.endpoints.values() for ep in eps]
        keep = carried(snap, ((ep.key, ep.model, ep.node) for ep in held))
        for ep in held:
            if ep.key in keep:
                table.setdefault(ep.model, []).append(ep)
                seen.add(ep.key)
        self._say_carried(frozenset(keep), seen, snap)
        gone = [k for k in self._by_key if k not in seen and self._by_key[k].in_flight == 0]
        for key in gone:
            del self._by_key[key]
        if gone:
            self.on_gone(gone)
        self.admission = {
            m: Admission(target_waiting=r.target_waiting, kv_ceiling=r.kv_ceiling)
            for m, r in snap.models.items()
        }
        self.affinity = {m: _strongest(eps) for m, eps in table.items()}
        self._known = frozenset(snap.models)
        self.scales = {m: r.start_s for m, r in snap.models.items() if r.scales}
        self.endpoints = table
        self.version = snap.version
        self.tenants = {t.name: t.limits for t in snap.tenants}
        self._weights = {t.name: t.weight for t in snap.tenants if t.weight != 1.0}
        keys = [*snap.keys, *snap.tenant_keys]
        if keys != self._keys:
            self._keys = keys
            self.on_keys(keys)
        self.rooms.wake_all()  # a replica may be Ready, back from draining, or new
        self.heard.set()

    def _say_carried(self, keep: frozenset[str], listed: set[str], snap: Snapshot) -> None:
        """One line when the routes kept for nodes not heard from change."""
        if keep == self.carried:
            return
        if keep - self.carried:
            log.info(
                "keeping %d routes the control plane does not list yet, to nodes it has "
                "not heard from since it started (%s): they serve until it has",
                len(keep),
                ", ".join(sorted({ep.node for ep in self._by_key.values() if ep.key in keep})),
            )
        dropped = sorted(self.carried - keep - listed)
        if dropped:
            log.info(
                "dropped the routes kept for %s: %s",
                ", ".join(dropped),
                "the control plane has been up for its lost-node timeout"
                if snap.settled
                else "their node came back without them",
            )
        self.carried = keep

    def cached(self) -> dict[str, int]:
        """The prompt blocks this router believes each replica of a model that scales
        holds (its affinity index), by replica id; none for an empty index."""
        return {
            ep.key: len(ep.prefix)
            for model in self.scales
            for ep in self.endpoints.get(model, ())
            if len(ep.prefix)
        }

    def traffic(self, now: float) -> dict[str, TrafficView]:
        """This router's view of each replica it routes to, by replica id."""
        return {ep.key: traffic_view(ep, now) for eps in self.endpoints.values() for ep in eps}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.watch is not None:
                nursery.start_soon(self._follow, self.watch)
            nursery.start_soon(self._scrape_loop)
            task_status.started()

    async def _follow(self, watch: Watch) -> None:
        while True:
            self.apply(await watch(self.version))

    async def _scrape_loop(self) -> None:
        engines = adapters()
        async with httpx.AsyncClient() as client:
            while True:
                beat = trio.current_time() + self.scrape_s
                async with trio.open_nursery() as nursery:
                    for ep in list(self._by_key.values()):
                        adapter = engines.get(ep.engine)
                        if adapter is not None:
                            nursery.start_soon(_scrape, client, ep, adapter, beat, self.rooms)
                self._judge_progress(trio.current_time())
                self._judge_alone()
                self.rooms.wake_all()  # what time alone changes: cool-downs, old readings
                await trio.sleep_until(beat)

    def _judge_alone(self) -> None:
        """Whether this router is the fleet's only one (it places new conversations
        evenly), said when it changes."""
        only = self.alone is not None and self.alone()
        if only == self.only:
            return
        self.only = only
        if only:
            log.info(
                "affinity: no standalone router follows the routing: this router places "
                "new conversations evenly over each model's replicas, and keeps a "
                "conversation moved by load where it sent it"
            )
        else:
            log.info(
                "affinity: standalone routers follow the routing: new conversations go to "
                "their rendezvous first choice, and a conversation moved by load comes back "
                "to it once it has room, so that every router sends a conversation's turns "
                "to one replica"
            )

    def _judge_progress(self, now: float) -> None:
        """A replica with work and a flat progress counter, or with work and nothing
        heard from it at all, is wedged: its breaker opens (and stays open while it
        stays so), said once; its counter moving again (or its work gone) is said once
        too, and its breaker lets a probe in as usual. Without a fresh reading, and
        while its streams still flow, nothing changes."""
        for ep in self._by_key.values():
            note_heard(ep, now)
            why = silent(ep, now, self.silent_after_s) or wedged(ep, now, self.wedged_after_s)
            if why is None:
                continue
            if why:
                ep.breaker.trip(now, f"wedged: {why}")
                if not ep.wedged:
                    log.warning(
                        "replica %s of model %s is wedged: %s; its breaker is open, no new request goes to it, and the %d in "
                        "flight there go on elsewhere",
                        ep.key,
                        ep.model,
                        why,
                        len(ep.streams),
                    )
                    for held in list(ep.streams):
                        held.cut(f"replica {ep.key} is wedged: {why}")
            elif ep.wedged:
                log.info("replica %s of model %s makes progress again", ep.key, ep.model)
            ep.wedged = why
        self.on_wedged(self.wedged_ids())

    def wedged_ids(self) -> frozenset[str]:
        """The replicas this router holds wedged now (for the control plane to restart)."""
        return frozenset(ep.key for ep in self._by_key.values() if ep.wedged)


def _mode(said: str) -> Mode:
    """A route's affinity; one this router does not know (a newer control plane's) is
    taken for "prefix", the default."""
    for mode in MODES:
        if said == mode:
            return mode
    return "prefix"


def _strongest(eps: list[Endpoint]) -> Mode:
    modes = {ep.affinity for ep in eps}
    return "prefix" if "prefix" in modes else "session" if "session" in modes else "off"


async def _scrape(
    client: httpx.AsyncClient, ep: Endpoint, adapter: EngineAdapter, deadline: float, rooms: Rooms
) -> None:
    """One endpoint's gauges, given up at ``deadline``: stale signals degrade to
    the in-flight count, never to "saturated". A reading wakes its model's queue."""
    with trio.move_on_at(deadline):
        before = ep.in_flight
        load = await read_load(client, ep.url, adapter, engine_auth(ep))
        if load is not None:
            # the engine answered somewhere between: the larger count errs towards
            # room (what was sent meanwhile is not counted as sent since)
            ep.in_flight_at_load = max(before, ep.in_flight)
            ep.load, ep.load_at = load, trio.current_time()
            note_progress(ep, load, ep.load_at)
            rooms.wake(ep.model)


def engine_auth(ep: Endpoint) -> dict[str, str]:
    """The header that lets the router past an engine's key (none when it has none)."""
    return {"authorization": f"Bearer {ep.engine_key}"} if ep.engine_key else {}


def traffic_view(ep: Endpoint, now: float) -> TrafficView:
    load = ep.load
    seen = ep.prefix
    engine_rate = None
    if load is not None and load.cache_hits is not None and load.cache_queries:
        engine_rate = load.cache_hits / load.cache_queries  # the engine's own, all routers'
    elif seen.prompt_tokens:
        engine_rate = seen.cached_tokens / seen.prompt_tokens  # its replies to this router
    return TrafficView(
        cache_hit_rate=engine_rate,
        estimated_hit_rate=seen.estimated_tokens / seen.prompt_tokens
        if seen.prompt_tokens
        else None,
        affinity_overruled=seen.overruled / seen.preferred if seen.preferred else None,
        cached_blocks=len(seen),
        prefill_ms_per_token=ep.pace.prefill_ms if ep.pace.known else None,
        slot_s=ep.pace.slot_s if ep.pace.known else None,
        prompt_waits=ep.computing.waits,
        in_flight=ep.in_flight,
        breaker=ep.breaker.state.value,
        waiting=load.waiting if load else None,
        running=load.running if load else None,
        kv_usage=load.kv_usage if load else None,
        load_age_s=None if ep.load_at is None else max(0.0, now - ep.load_at),
        wedged=ep.wedged or "",
    )


class HttpWatch:
    """The control plane's routing, over the admin API's long-poll watch.

    The control plane answers at once when its snapshot differs from the
    version we hold, or after ``poll_s`` with the same one. While it is
    unreachable this keeps trying with backoff, and the table stays as it was:
    engines keep serving, so the router keeps routing.
    """

    # while the control plane cannot be reached, asked again at least this often: a
    # restarted one is followed within seconds
    RETRY_CAP_S = 2.0

    def __init__(self, admin_url: str, token: str, *, poll_s: float = 25.0) -> None:
        self.url = admin_url.rstrip("/") + "/v1/routing"
        self._lost_at: float | None = None  # since when it cannot be followed
        self.poll_s = poll_s
        # more query parameters for each poll: a router's report, to a control plane
        # older than its own path for it (``report.Reporter.query``)
        self.extra: Callable[[], dict[str, str]] = dict
        self._headers = {"authorization": f"Bearer {token}"}
        self._client = httpx.AsyncClient(timeout=poll_s + 10)

    async def __call__(self, since: str) -> Snapshot:
        delay = 0.5
        while True:
            try:
                r = await self._client.get(
                    self.url,
                    params={
                        "since": since,
                        "wait": str(self.poll_s),
                        "carry": "1",  # it keeps what a control plane just started lacks
                    }
                    | self.extra(),
                    headers=self._headers,
                )
                r.raise_for_status()
                snap = msgspec.json.decode(r.content, type=Snapshot)
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                if self._lost_at is None:
                    self._lost_at = trio.current_time()
                    log.warning(
                        "cannot follow the control plane's routing (%s); routing on with "
                        "the table as it is, and asking again every %g s at most",
                        exc,
                        self.RETRY_CAP_S,
                    )
                await trio.sleep(delay)
                delay = min(delay * 2, self.RETRY_CAP_S)
                continue
            if self._lost_at is not None:
                log.info(
                    "following the control plane's routing again, after %.1f s",
                    trio.current_time() - self._lost_at,
                )
                self._lost_at = None
            if snap.version != since:
                log.info("routing table now version %s: %d routes", snap.version, len(snap.routes))
            return snap

    async def __aenter__(self) -> HttpWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await self._client.aclose()

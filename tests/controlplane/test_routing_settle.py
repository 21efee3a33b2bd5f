"""A control plane that just started does not tell standalone routers to drop their
tables: until its agents have come back, its fleet lacks their replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio

from llmgw.admin.api import AdminApi
from llmgw.controlplane.catalog import parse_catalog
from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.reconciler import Timing
from llmgw.http import HttpServer
from tests.conftest import Pki
from tests.controlplane.parts import TINY
from tests.stream.harness import control_plane

SETTLE_S = 1.5
BEFORE = "0123456789abcdef"  # the version a router holds from before the restart
AUTH = {"authorization": "Bearer t0ken"}


@asynccontextmanager
async def just_started(pki: Pki) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A control plane that has just started, settling for SETTLE_S, with no agent
    yet: a client, and the URL of its admin API's routing watch."""
    catalog = parse_catalog(TINY, "catalog.toml")
    async with control_plane(pki, heartbeat=0.5, unreachable_after=30, lost_after=60) as plane:
        fleet = FleetManager(plane.control, catalog, timing=Timing(settle_s=SETTLE_S))
        admin = HttpServer(AdminApi(plane.control, "t0ken", fleet))
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=10) as client:
            listeners = await nursery.start(admin.serve_tcp, "127.0.0.1", 0)
            await nursery.start(fleet.run)
            yield client, f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1/routing"
            nursery.cancel_scope.cancel()


async def test_a_router_holding_a_table_keeps_it_while_agents_come_back(pki: Pki) -> None:
    async with just_started(pki) as (client, url):
        started = trio.current_time()
        # a router with no table yet takes what there is
        with trio.fail_after(1):
            r = await client.get(url, headers=AUTH)
        assert r.status_code == 200
        assert r.json()["routes"] == []
        # one that holds a table is not told to drop it: it is told to keep it (503,
        # which it answers by keeping its table and asking again) ...
        with trio.fail_after(1):
            r = await client.get(url, params={"since": BEFORE, "wait": "0.2"}, headers=AUTH)
        assert r.status_code == 503
        assert "agents come back" in r.json()["error"]["message"]
        # ... or, when its wait outlasts the settling, answered once that is over
        with trio.fail_after(5):
            r = await client.get(url, params={"since": BEFORE, "wait": "10"}, headers=AUTH)
        assert r.status_code == 200
        assert trio.current_time() - started >= SETTLE_S - 0.1
        # settled: answered at once, as before
        with trio.fail_after(1):
            r = await client.get(url, params={"since": BEFORE, "wait": "10"}, headers=AUTH)
        assert r.status_code == 200


async def test_a_router_that_keeps_routes_of_nodes_not_back_takes_the_table_at_once(
    pki: Pki,
) -> None:
    """A router that says it carries (it keeps the routes of nodes the control plane
    has not heard from yet, ``llmgw.routing.carried``) needs no settling: it is
    answered at once, with a snapshot that says so."""
    async with just_started(pki) as (client, url):
        with trio.fail_after(1):
            r = await client.get(
                url, params={"since": BEFORE, "wait": "10", "carry": "1"}, headers=AUTH
            )
        assert r.status_code == 200
        assert r.json()["settled"] is False and r.json()["heard"] == []

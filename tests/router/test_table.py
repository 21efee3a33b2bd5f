"""The routing table follows the control plane's published snapshot, and scrapes gauges.

The tests about following run under a frozen clock (``mock_clock``, rate 0): a
table or a watch that waited on a timer would never see the change, so they
show that a change is pushed, not polled for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from urllib.parse import parse_qs

import attrs
import httpx
import msgspec
import pytest
import trio
import trio.lowlevel
import trio.testing

from llmgw.admin.api import AdminApi
from llmgw.controlplane.followers import RouterReports
from llmgw.controlplane.nodes import LivenessPolicy
from llmgw.controlplane.routing import RoutingPublisher
from llmgw.controlplane.service import ControlPlane
from llmgw.http import HttpServer, Request, Response
from llmgw.router.keys import ApiKey, KeyRing, followed, hash_key, published
from llmgw.router.report import LOAD_S, Reporter
from llmgw.router.table import HttpWatch, RoutingTable
from llmgw.routing import (
    REPORT_PATH,
    ModelLoad,
    ModelRouting,
    Route,
    RouterKey,
    Snapshot,
    versioned,
)

TOKEN = "s3cret-token"


def _fleet(*urls: str, engine: str = "") -> list[Route]:
    return [Route(key=f"m/{i}", model="m", url=u, engine=engine) for i, u in enumerate(urls)]


async def _until(done: Callable[[], bool], wall_s: float = 5.0) -> None:
    """Let tasks and sockets run, bounded in wall time (the trio clock may be frozen)."""
    end = time.monotonic() + wall_s
    while not done():
        assert time.monotonic() < end, "gave up waiting"
        await trio.lowlevel.checkpoint()


@attrs.define
class Admin:
    """A control plane's admin API on loopback: routing from a publisher, what routers
    report kept apart, and every request it was sent."""

    publisher: RoutingPublisher
    routers: RouterReports
    url: str
    heard: list[tuple[str, str, str]]  # method, path, query


async def _admin(nursery: trio.Nursery) -> Admin:
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=15, lost_after=60), heartbeat_interval=5
    )
    publisher = RoutingPublisher(versioned({"m": ModelRouting()}, []))
    routers = RouterReports()
    api = AdminApi(control, TOKEN, routing=publisher, routers=routers)
    heard: list[tuple[str, str, str]] = []

    async def app(request: Request) -> Response:
        heard.append((request.method, request.path, request.query))
        return await api(request)

    listeners = await nursery.start(HttpServer(app).serve_tcp, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    return Admin(publisher, routers, url, heard)


def test_the_version_is_the_content() -> None:
    a = versioned({"m": ModelRouting()}, _fleet("http://127.0.0.1:1", "http://127.0.0.1:2"))
    b = versioned(
        {"m": ModelRouting()}, list(reversed(_fleet("http://127.0.0.1:1", "http://127.0.0.1:2")))
    )
    c = versioned({"m": ModelRouting(kv_ceiling=0.9)}, _fleet("http://127.0.0.1:1"))
    assert a.version == b.version  # the same fleet, whatever order it was listed in
    assert c.version != a.version
    assert [r.key for r in b.routes] == ["m/0", "m/1"]


async def test_a_publish_wakes_waiters_only_when_something_changed(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    first = versioned({"m": ModelRouting()}, [])
    publisher = RoutingPublisher(first)
    got = []

    async def wait() -> None:
        got.append(await publisher.next(first.version))

    nursery.start_soon(wait)
    await trio.testing.wait_all_tasks_blocked()
    assert publisher.watchers == 1
    assert not publisher.publish(versioned({"m": ModelRouting()}, []))  # the same, rebuilt
    await trio.testing.wait_all_tasks_blocked()
    assert got == [] and publisher.watchers == 1
    second = versioned({"m": ModelRouting()}, _fleet("http://127.0.0.1:1"))
    assert publisher.publish(second)
    await trio.testing.wait_all_tasks_blocked()
    assert got == [second]
    assert trio.current_time() == 0  # the clock never moved: nothing waited on a timer


async def test_the_in_process_table_follows_the_publisher_at_once(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    publisher = RoutingPublisher(versioned({"m": ModelRouting()}, []))
    table = RoutingTable(publisher.next, publisher.snapshot)
    assert table.known("m") and table.endpoints == {}  # the initial snapshot, before run
    await nursery.start(table.run)
    publisher.publish(versioned({"m": ModelRouting()}, _fleet("http://127.0.0.1:1")))
    await trio.testing.wait_all_tasks_blocked()
    assert [e.url for e in table.endpoints["m"]] == ["http://127.0.0.1:1"]
    assert table.version == publisher.snapshot.version
    assert trio.current_time() == 0


async def test_the_admin_watch_answers_a_standalone_router_on_the_change(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Through the admin API's HTTP listener and the standalone router's own watch:
    the long poll parked on the publisher answers the moment the snapshot changes."""
    admin = await _admin(nursery)
    publisher = admin.publisher
    table = RoutingTable(HttpWatch(admin.url, TOKEN))
    await nursery.start(table.run)
    await _until(lambda: table.known("m"))  # the first answer: we held no version
    await _until(lambda: publisher.watchers == 1)  # the next poll is parked
    publisher.publish(versioned({"m": ModelRouting()}, _fleet("http://127.0.0.1:7")))
    await _until(lambda: "m" in table.endpoints)
    assert table.version == publisher.snapshot.version
    assert trio.current_time() == 0


async def test_a_standalone_router_tells_the_control_plane_what_it_holds_wedged(
    nursery: trio.Nursery,
) -> None:
    """In a report posted to its own path, under the router's own id, apart from the
    routing polls (which say nothing of it): the control plane holds a replica wedged
    while some router says so, and not once none does."""
    admin = await _admin(nursery)
    reporters = [Reporter(admin.url, TOKEN, every_s=0.05), Reporter(admin.url, TOKEN, every_s=0.05)]
    for reporter in reporters:
        watch = HttpWatch(admin.url, TOKEN, poll_s=0.05)
        watch.extra = reporter.query
        await nursery.start(RoutingTable(watch).run)
        await nursery.start(reporter.run)
    now = trio.current_time
    held = frozenset({"m-ab12cd-1", "Qwen/Qwen3-8B-ab12cd-2"})
    reporters[0].wedged(held)  # as its table says after a judgement; the other's holds none
    await _until(lambda: admin.routers.wedged(now()) == held)
    await trio.sleep(0.3)  # the other router's reports do not clear what this one says
    assert admin.routers.wedged(now()) == held
    reporters[0].wedged(frozenset())
    await _until(lambda: admin.routers.wedged(now()) == frozenset())
    reports = [h for h in admin.heard if h[:2] == ("POST", REPORT_PATH)]
    polls = [
        query for method, path, query in admin.heard if (method, path) == ("GET", "/v1/routing")
    ]
    assert len(reports) > 4 and len(polls) > 4
    assert not [q for q in polls if {"router", "wedged", "metrics"} & set(parse_qs(q))]
    # both are counted as routers that follow the routing, until not heard from
    assert admin.routers.routers(now()) == 2
    assert admin.routers.routers(now() + RouterReports.FOLLOWER_TTL_S + 1) == 0


def test_the_servers_router_places_new_conversations_evenly_only_while_it_is_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Told by the control plane whether standalone routers report: the server's router
    places new conversations evenly while none does, by rendezvous alone while some do
    (said once per change); a standalone router's table never places evenly."""
    caplog.set_level(logging.INFO, "llmgw.router")
    others = [0]
    table = RoutingTable(alone=lambda: others[0] == 0)
    assert not table.only  # until its first look
    for n, only in ((0, True), (0, True), (2, False), (2, False), (0, True)):
        others[0] = n
        table._judge_alone()
        assert table.only is only
    said = [r.getMessage() for r in caplog.records if "affinity:" in r.getMessage()]
    assert len(said) == 3 and "evenly" in said[0] and "standalone routers follow" in said[1]
    standalone = RoutingTable()
    standalone._judge_alone()
    assert not standalone.only


async def test_a_router_says_where_its_metrics_are_and_a_wildcard_is_where_it_is_seen(
    nursery: trio.Nursery,
) -> None:
    admin = await _admin(nursery)
    reporter = Reporter(admin.url, TOKEN, every_s=60)
    await nursery.start(reporter.run)
    reporter.serves_metrics("0.0.0.0:9100")  # sent at once, not on the next beat
    await _until(lambda: admin.routers.followers(trio.current_time()) == ["127.0.0.1:9100"])


async def test_a_bad_router_report_is_refused_and_changes_nothing(nursery: trio.Nursery) -> None:
    admin = await _admin(nursery)
    url = admin.url + REPORT_PATH
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}) as client:
        for body, words in (
            (b"{", "body must be a router report, as JSON"),
            (b'{"wedged": ["m-1"]}', "body must be a router report"),  # whose?
            (b'{"router": "a b", "wedged": ["m-1"]}', "router must be 1-64 letters"),
            (b'{"router": "r", "wedged": ["ok", "<script>"]}', "wedged must be at most 1,000"),
            (
                msgspec.json.encode({"router": "r", "wedged": [f"m-{i}" for i in range(1001)]}),
                "at most",
            ),
            (b'{"router": "r", "wedged": ["m-1"], "metrics": "no-port"}', "metrics must be"),
        ):
            r = await client.post(url, content=body)
            assert r.status_code == 400 and words in r.text, (body, r.text)
    assert admin.routers.wedged(trio.current_time()) == frozenset()
    assert admin.routers.followers(trio.current_time()) == []


async def test_an_older_routers_report_on_its_poll_is_still_taken(nursery: trio.Nursery) -> None:
    """A router older than the report says the same as parameters of its routing poll:
    taken for one release, checked as a report is."""
    admin = await _admin(nursery)
    url = admin.url + "/v1/routing"
    now = trio.current_time
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}) as client:
        for params, words in (
            ({"router": "a b"}, "router must be 1-64 letters"),
            ({"router": "r", "wedged": "ok,<script>"}, "wedged must be at most 1,000"),
            ({"router": "r", "wedged": ",".join(f"m-{i}" for i in range(1001))}, "at most"),
        ):
            r = await client.get(url, params=params)
            assert r.status_code == 400 and words in r.text, (params, r.text)
        assert admin.routers.wedged(now()) == frozenset()
        said = {"router": "old1", "wedged": "m-1,m-2", "metrics": "0.0.0.0:9100"}
        assert (await client.get(url, params=said)).status_code == 200
    assert admin.routers.wedged(now()) == {"m-1", "m-2"}
    assert admin.routers.followers(now()) == ["127.0.0.1:9100"]


async def test_against_a_control_plane_older_than_the_report_it_rides_on_the_polls(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """An older control plane has no path for the report (404): the router says it once,
    and its routing polls carry the report as older routers' did."""
    caplog.set_level(logging.INFO)
    polls: list[dict[str, list[str]]] = []

    async def older(request: Request) -> Response:
        if (request.method, request.path) != ("GET", "/v1/routing"):
            return Response(status=404, headers=[], body=b"no such endpoint")
        polls.append(parse_qs(request.query))
        await trio.sleep(0.05)
        body = msgspec.json.encode(versioned({"m": ModelRouting()}, []))
        return Response(status=200, headers=[("content-type", "application/json")], body=body)

    listeners = await nursery.start(HttpServer(older).serve_tcp, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    reporter = Reporter(url, TOKEN, every_s=60)
    reporter.serves_metrics("127.0.0.1:9100")
    reporter.wedged(frozenset({"m-1"}))
    watch = HttpWatch(url, TOKEN, poll_s=0.05)
    watch.extra = reporter.query
    await nursery.start(reporter.run)
    await _until(lambda: reporter.older)
    await nursery.start(RoutingTable(watch).run)
    await _until(lambda: bool(polls) and "router" in polls[-1])
    assert polls[-1]["router"] == [reporter.router_id]
    assert (polls[-1]["wedged"], polls[-1]["metrics"]) == (["m-1"], ["127.0.0.1:9100"])
    assert "the control plane takes no router report (it is older" in caplog.text


async def test_one_dead_replica_ages_no_other_replicas_gauges(nursery: trio.Nursery) -> None:
    """Five replicas accept connections and never answer; the live one's gauges
    stay as fresh as the scrape interval (a serial scrape would age them by
    every dead replica's deadline in turn)."""
    dead = []
    for _ in range(5):
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # the kernel completes the handshake; nobody ever answers
        dead.append(sock)

    async def metrics(request: Request) -> Response:
        body = b"llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n"
        return Response(200, [("content-type", "text/plain")], body)

    live = await nursery.start(HttpServer(metrics).serve_tcp, "127.0.0.1", 0)
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in dead]
    urls.append(f"http://127.0.0.1:{live[0].socket.getsockname()[1]}")  # listed last
    table = RoutingTable(
        initial=versioned({"m": ModelRouting()}, _fleet(*urls, engine="llama.cpp")), scrape_s=0.2
    )
    await nursery.start(table.run)
    fresh = table.endpoints["m"][-1]
    worst = 0.0
    with trio.fail_after(10):
        while fresh.load_at is None:
            await trio.sleep(0.02)
        for _ in range(75):  # 1.5 s of samples
            await trio.sleep(0.02)
            worst = max(worst, trio.current_time() - fresh.load_at)
    assert fresh.load is not None and fresh.load.running == 2 and fresh.load.waiting == 1
    assert worst < 0.7, f"the live replica's gauges grew {worst:.2f} s old"
    assert all(ep.load is None for ep in table.endpoints["m"][:-1])
    for sock in dead:
        sock.close()


def _on(node: str, key: str, url: str, model: str = "m") -> Route:
    return Route(key=key, model=model, url=url, node=node)


def test_routes_to_nodes_a_new_control_plane_has_not_heard_from_stay_until_it_has() -> None:
    """A restarted control plane lists only what the nodes back so far run: a router
    keeps its routes to the others until their node comes back without them, or the
    control plane has been up for its lost-node timeout."""
    models = {"m": ModelRouting(), "gone": ModelRouting()}
    before = [
        _on("n1", "m-1", "http://127.0.0.1:1"),
        _on("n2", "m-2", "http://127.0.0.1:2"),
        _on("n3", "gone-1", "http://127.0.0.1:3", model="gone"),
    ]
    table = RoutingTable(initial=versioned(models, before))
    kept = table.endpoints["m"][1]
    kept.in_flight = 2  # its own state goes on with it
    # n1 is back with its replica; n2 and n3 are not: their routes stay
    restarted = {"m": ModelRouting(), "gone": ModelRouting()}
    table.apply(versioned(restarted, before[:1], settled=False, heard=["n1"]))
    assert [e.key for e in table.endpoints["m"]] == ["m-1", "m-2"]
    assert table.endpoints["m"][1] is kept and kept.in_flight == 2
    assert table.carried == {"m-2", "gone-1"}
    # a model that left the catalog meanwhile is not kept for
    table.apply(versioned({"m": ModelRouting()}, before[:1], settled=False, heard=["n1"]))
    assert "gone" not in table.endpoints and table.carried == {"m-2"}
    # n2 came back without it: gone
    table.apply(versioned(restarted, before[:1], settled=False, heard=["n1", "n2"]))
    assert [e.key for e in table.endpoints["m"]] == ["m-1"]
    # and a node never back is dropped once the control plane has settled
    table = RoutingTable(initial=versioned(models, before))
    table.apply(versioned(models, before[:1], settled=False, heard=["n1"]))
    assert len(table.endpoints["m"]) == 2
    table.apply(versioned(models, before[:1]))
    assert [e.key for e in table.endpoints["m"]] == ["m-1"] and table.carried == frozenset()


def test_a_settled_control_plane_or_one_that_says_nothing_is_taken_at_its_word() -> None:
    """Outside a restart, or from a control plane older than ``settled``, a route that
    is not listed is gone, as it always was; and a route is never carried twice:
    one the table dropped is not brought back."""
    before = [_on("n1", "m-1", "http://127.0.0.1:1"), _on("n2", "m-2", "http://127.0.0.1:2")]
    table = RoutingTable(initial=versioned({"m": ModelRouting()}, before))
    table.apply(Snapshot(version="old", models={"m": ModelRouting()}, routes=before[:1]))
    assert [e.key for e in table.endpoints["m"]] == ["m-1"]
    table.apply(versioned({"m": ModelRouting()}, before[:1], settled=False, heard=[]))
    assert [e.key for e in table.endpoints["m"]] == ["m-1"]
    # a static endpoint names no node: never kept past its snapshot
    static = Route(key="http://s", model="m", url="http://s")
    table = RoutingTable(initial=versioned({"m": ModelRouting()}, [static]))
    table.apply(versioned({"m": ModelRouting()}, [], settled=False, heard=[]))
    assert table.endpoints == {}


def test_a_snapshot_says_settled_and_heard_only_while_it_matters() -> None:
    settled = versioned({"m": ModelRouting()}, [], heard=["n1"])
    assert settled.settled and settled.heard == []  # nothing to say once settled
    young = versioned({"m": ModelRouting()}, [], settled=False, heard=["n2", "n1"])
    assert young.heard == ["n1", "n2"] and young.version != settled.version
    # an older router's decoder, which knows neither field, reads it as before
    assert msgspec.json.decode(msgspec.json.encode(young), type=_OldSnapshot).routes == []


class _OldSnapshot(msgspec.Struct, kw_only=True):
    version: str = ""
    models: dict[str, ModelRouting] = {}
    routes: list[Route] = []


def test_a_standalone_router_takes_the_control_planes_keys_besides_its_own() -> None:
    """What the routing carries (hashes) joins the router's own keys; a key in both is
    limited as the router's own file says; one the control plane drops is refused."""
    own = ApiKey("edge", hash_key("k-edge"), frozenset({"m"}))
    ring = KeyRing([own])
    seen: list[list[RouterKey]] = []
    table = RoutingTable(on_keys=seen.append)
    cp = [
        ApiKey("team", hash_key("k-team")),
        ApiKey("edge-too", hash_key("k-edge")),  # the same key, every model
    ]
    table.apply(versioned({"m": ModelRouting()}, [], keys=published(cp)))
    assert [[k.name for k in keys] for keys in seen] == [["edge-too", "team"]]
    assert ring.follow(followed(seen[-1])) == "2 keys (added edge-too, team)"
    assert ring.follow(followed(seen[-1])) is None  # nothing new: nothing said
    team = ring.check("Bearer k-team")
    assert team is not None and team.name == "team"
    assert ring.check("Bearer k-edge") == own  # its own file says last
    table.apply(versioned({"m": ModelRouting()}, [], keys=published(cp[1:])))
    assert len(seen) == 2
    assert ring.follow(followed(seen[-1])) == "1 key (removed team)"
    assert ring.check("Bearer k-team") is None
    table.apply(
        versioned({"m": ModelRouting()}, _fleet("http://127.0.0.1:1"), keys=published(cp[1:]))
    )
    assert len(seen) == 2  # told only when the keys change


async def test_a_busy_router_reports_its_load_every_few_seconds_not_every_request(
    nursery: trio.Nursery,
) -> None:
    """Requests for a model that scales arrive all the time: the first after a quiet
    spell is told at once, then the load every LOAD_S, never a report per request."""
    admin = await _admin(nursery)
    reporter = Reporter(admin.url, TOKEN, every_s=60)
    arrived = 0

    def load() -> dict[str, ModelLoad]:
        nonlocal arrived
        said, arrived = arrived, 0
        return {"m": ModelLoad(in_flight=1, arrived=said)} if said else {}

    reporter.load = load
    await nursery.start(reporter.run)
    await _until(lambda: len(reports(admin)) == 1)  # the first, at start
    began = trio.current_time()
    while trio.current_time() < began + 3.0:  # a request every 5 ms for 3 s
        arrived += 1
        reporter.arrived()
        await trio.sleep(0.005)
    sent = reports(admin)
    assert 2 <= len(sent) <= 1 + 3.0 / LOAD_S + 2, len(sent)  # at once, then every 2 s
    assert admin.routers.loads(trio.current_time())["m"].arrived >= 1  # the control plane heard


def reports(admin: Admin) -> list[tuple[str, str, str]]:
    return [h for h in admin.heard if h[:2] == ("POST", REPORT_PATH)]

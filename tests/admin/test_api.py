"""The management API over the project's HTTP server: auth, routes, metrics."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio

from llmgw.admin.api import AdminApi
from llmgw.controlplane.nodes import LivenessPolicy
from llmgw.controlplane.service import ControlPlane
from llmgw.http import HttpServer
from llmgw.protocol.messages import Gpu, Inventory, Memory

TOKEN = "s3cret-token"


@pytest.fixture
async def admin(nursery: trio.Nursery) -> tuple[str, ControlPlane]:
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=15, lost_after=60), heartbeat_interval=5
    )
    inventory = Inventory(
        address="10.1.2.3",
        memory=Memory(total_bytes=64 << 30),
        gpus=[
            Gpu(index=0, name="NVIDIA H200"),
            Gpu(index=1, name="NVIDIA H200", healthy=False, problems=["pending retired pages"]),
        ],
    )
    control.nodes.register("n1", inventory, peer="10.1.2.3:555", connection=1, now=0, wall=0)
    control.nodes.register("n2", Inventory(), peer="10.1.2.4:555", connection=2, now=0, wall=0)
    listeners = await nursery.start(HttpServer(AdminApi(control, TOKEN)).serve_tcp, "127.0.0.1", 0)
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}", control


async def test_every_route_but_healthz_needs_the_token(admin: tuple[str, ControlPlane]) -> None:
    url, _ = admin
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        for path in ("/v1/nodes", "/metrics"):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                r = await client.get(path, headers=headers)
                assert r.status_code == 401
                assert "admin token" in r.json()["error"]["message"]
        # without the token an unknown path looks like a known one: no list of routes
        for method, path in (("GET", "/nope"), ("GET", "/v1/nodes/x/y"), ("PUT", "/v1/nodes")):
            r = await client.request(method, path)
            assert r.status_code == 401, (method, path)
        r = await client.get("/nope", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404
        r = await client.post("/v1/nodes", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 405


async def test_routing_wait_that_is_not_a_number_is_refused_at_once(
    admin: tuple[str, ControlPlane],
) -> None:
    url, _ = admin
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        first = await client.get("/v1/routing", headers=auth)
        version = first.json()["version"]
        for wait in ("nan", "NaN", "inf", "-inf", "soon", "1e999"):
            with trio.fail_after(2):
                r = await client.get(f"/v1/routing?since={version}&wait={wait}", headers=auth)
            assert r.status_code == 400, wait
            assert r.json()["error"]["message"] == "wait must be a number of seconds"
        with trio.fail_after(2):  # a number still waits, and answers when the wait is over
            r = await client.get(f"/v1/routing?since={version}&wait=0.1", headers=auth)
        assert r.status_code == 200
        # a router saying where its metrics are: host:port, or it is told so
        r = await client.get("/v1/routing?metrics=no-port", headers=auth)
        assert (r.status_code, r.json()["error"]["message"]) == (400, "metrics must be host:port")


async def test_nodes_shows_memory_unknown_as_null_and_unhealthy_gpus(
    admin: tuple[str, ControlPlane],
) -> None:
    url, _ = admin
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        r = await client.get("/v1/nodes", headers={"authorization": f"Bearer {TOKEN}"})
    nodes = {n["node_id"]: n for n in r.json()["nodes"]}
    assert nodes["n1"]["memory_total_bytes"] == 64 << 30
    assert nodes["n2"]["memory_total_bytes"] is None  # unknown, not 0
    assert nodes["n1"]["address"] == "10.1.2.3"
    assert nodes["n2"]["address"] == "10.1.2.4"  # from the stream's peer
    bad = [g for g in nodes["n1"]["gpus"] if not g["healthy"]]
    assert bad == [
        {
            "index": 1,
            "name": "NVIDIA H200",
            "healthy": False,
            "problems": ["pending retired pages"],
            "memory_total_mib": None,
        }
    ]


async def test_metrics_are_prometheus_text(admin: tuple[str, ControlPlane]) -> None:
    url, control = admin
    control.nodes.sweep(16)  # both nodes go Unreachable
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        r = await client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.headers["content-type"].startswith("text/plain")
    assert 'llmgw_nodes{state="Unreachable"} 2.0' in r.text
    assert 'llmgw_nodes{state="Ready"} 0.0' in r.text
    assert "llmgw_heartbeat_delay_seconds_bucket" in r.text


def test_ctl_table_shows_dash_for_unknown_memory_and_why_gpus_are_excluded() -> None:
    from llmgw.admin.views import node_view
    from llmgw.cli.render import render_nodes

    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=15, lost_after=60), heartbeat_interval=5
    )
    inv = Inventory(
        gpus=[Gpu(index=0), Gpu(index=1, healthy=False, problems=["remapped-row failure"])],
        memory=Memory(total_bytes=8 << 30),
    )
    control.nodes.register("a", inv, peer="1.1.1.1:1", connection=1, now=0, wall=100)
    control.nodes.register("b", Inventory(), peer="1.1.1.2:1", connection=2, now=0, wall=100)
    text = render_nodes([node_view(n) for n in control.nodes.nodes.values()], now=130)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["NODE", "ADDRESS", "STATE", "SHARDS"]
    assert lines[1].split()[:5] == ["a", "1.1.1.1", "Ready", "0", "30s"]
    assert lines[1].endswith("2 (1 unhealthy: GPU 1: remapped-row failure)")
    assert lines[1].split()[7:9] == ["8", "GiB"]
    assert lines[2].split()[7] == "-"  # no memory reported: unknown, not 0


def test_the_routers_view_of_a_replica_in_words() -> None:
    from llmgw.cli.render import render_traffic
    from llmgw.engines.base import LoadSignals, Timings
    from llmgw.router.balancer import Endpoint
    from llmgw.router.table import traffic_view
    from llmgw.routing import TrafficView

    ep = Endpoint(key="m/0", model="m", url="http://127.0.0.1:1")

    def as_json() -> TrafficView:
        return msgspec.json.decode(
            msgspec.json.encode(traffic_view(ep, now=100.0)), type=TrafficView
        )

    assert render_traffic(as_json()) == "0 in flight, no engine gauges yet"
    ep.in_flight, ep.load, ep.load_at = 3, LoadSignals(waiting=2, running=8, kv_usage=0.91), 99.0
    assert render_traffic(as_json()) == "3 in flight, 2 waiting, 8 running, kv 91%"
    for _ in range(5):
        ep.breaker.on_start(100.0)
        ep.breaker.on_upstream_fault(100.0)
    ep.load_at = 60.0
    assert (
        render_traffic(as_json())
        == "3 in flight, breaker open, 2 waiting, 8 running, kv 91%, gauges 40s old"
    )
    ep.wedged = "3 requests in flight and no progress for 31 s"
    assert render_traffic(as_json()).startswith(
        "3 in flight, WEDGED: 3 requests in flight and no progress for 31 s, breaker open"
    )
    assert render_traffic(None) == "-"  # no router in this server
    # what its replies said of its pace, once they said enough
    ep.pace.observe(Timings(400, 2800.0, 1200.0), 420, 600)
    assert "ms/token" not in render_traffic(as_json())
    ep.pace.observe(Timings(400, 2800.0, 1200.0), 420, 600)
    assert render_traffic(as_json()).endswith("prefill 7 ms/token, slot 4 s")
    ep.computing.waits = 3  # requests that waited for a slot holding their prompt
    assert render_traffic(as_json()).endswith(
        "prefill 7 ms/token, slot 4 s, 3 waited for a slot holding their prompt"
    )


async def test_a_request_without_the_token_is_refused_before_its_body(
    nursery: trio.Nursery,
) -> None:
    """With the API's head check (as ``llmgw server`` wires it), a stranger's body is
    never waited for nor kept: the 401 comes as soon as the head is in."""
    control = ControlPlane(
        policy=LivenessPolicy(unreachable_after=15, lost_after=60), heartbeat_interval=5
    )
    api = AdminApi(control, TOKEN)
    server = HttpServer(api, admit=api.admit)
    listeners = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        head = (
            b"POST /v1/catalog/reload HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: 900000\r\n\r\n"
        )
        await stream.send_all(head + b"{" * 1000)  # then the body stalls
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = await stream.receive_some(65536)
            assert chunk, f"closed without an answer: {got!r}"
            got += chunk
    assert got.startswith(b"HTTP/1.1 401 ")
    assert server.body_bytes == 0
    await stream.aclose()


async def test_models_needs_the_token_and_a_control_plane(admin: tuple[str, ControlPlane]) -> None:
    url, _ = admin
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        assert (await client.get("/v1/models")).status_code == 401
        r = await client.get("/v1/models", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 409  # no catalog profiles: nothing is placed, no models to show


def test_a_model_row_says_crash_loop_cannot_place_and_the_last_failure() -> None:
    from llmgw.admin.views import ModelList
    from llmgw.cli.render import render_failures, render_models
    from llmgw.controlplane.failures import exit_of

    assert exit_of("engine exited with code 1") == (1, None)
    assert exit_of("engine killed by signal SIGKILL") == (None, "SIGKILL")
    failure = {
        "model": "m",
        "replica_id": "m-1",
        "shard_id": "m-1-0",
        "node_id": "n1",
        "reason": "engine exited with code 1",
        "exit_code": 1,
        "signal": None,
        "output_tail": ["error: invalid argument: --nope"],
        "at": 0.0,
        "ago_s": 90.0,
    }
    row = {"model": "m", "wanted": 1, "ready": 0, "starting": 0, "failed": 0, "nodes": []}
    data = {
        "models": [
            {**row, "retry_in_s": 12.4, "cannot_place": "", "failures": [failure]},
            {
                **row,
                "model": "big",
                "retry_in_s": None,
                "cannot_place": "no node fits",
                "failures": [],
            },
        ]
    }
    models = msgspec.convert(data, ModelList).models
    lines = render_models(models).splitlines()
    assert lines[1].startswith("m ") and "crash loop, next try in 12 s" in lines[1]
    assert "last failure 2m ago on n1: engine exited with code 1" in lines[1]
    assert lines[2].endswith("cannot place: no node fits")  # waiting to place is no crash loop
    text = render_failures(models)
    assert "exit 1" in text and "    error: invalid argument: --nope" in text


def test_a_rollout_reads_in_ctl_replicas_and_ctl_models() -> None:
    from llmgw.admin.views import ModelList, ReplicaList
    from llmgw.cli.render import render_models, render_replicas

    shard = {
        "node_id": "n1",
        "port": 1,
        "gpus": [],
        "state": "ready",
        "shard_id": "a-0",
        "detail": "",
        "rank": 0,
        "output_tail": [],
    }
    replica = {
        "replica_id": "tiny-x-1",
        "model": "tiny",
        "profile": "cpu",
        "state": "Ready",
        "why": "",
        "state_since": 3.0,
        "adopted": False,
        "shards": [shard],
    }
    data = {
        "replicas": [
            {**replica, "leaving": True, "leaving_why": "outdated", "outdated": True},
            {**replica, "replica_id": "tiny-x-2", "leaving": False, "outdated": True},
            {**replica, "replica_id": "tiny-x-3", "leaving": True, "leaving_why": "spread"},
        ]
    }
    rows = render_replicas(msgspec.convert(data, ReplicaList).replicas).splitlines()
    assert "Ready,outdated (leaving: replaced by the new profile)" in rows[1]
    assert "Ready,outdated " in rows[2] and "leaving" not in rows[2]
    assert "Ready (leaving: moves to spread)" in rows[3]
    row = {"model": "tiny", "wanted": 2, "ready": 2, "starting": 1, "failed": 0, "nodes": []}
    views = msgspec.convert({"models": [{**row, "outdated": 2, "failures": []}]}, ModelList)
    models = render_models(views.models)
    assert "rolling out a profile change, 2 to replace" in models.splitlines()[1]

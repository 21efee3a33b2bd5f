"""The OpenAI-compatible endpoint with the real openai client, real engines, real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trio

from llmgw.router.keys import hash_key, new_key
from tests.cluster.procs import Daemon, workers_route
from tests.cluster.proxy import Proxy
from tests.cluster.test_control_plane_processes import Cluster, cluster, engine_key, engine_pid
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server


@asynccontextmanager
async def stopped_with_sigterm(router: Daemon) -> AsyncIterator[Daemon]:
    """A standalone router stopped with SIGTERM at the end, failed test or not: its
    first worker stops the others (a SIGKILL to it would leave them running)."""
    try:
        yield router
    finally:
        if router.returncode() is None:
            with trio.move_on_after(5):
                await router.stop(signal.SIGTERM)


def reserved_port() -> socket.socket:
    """A port held for processes that share it with SO_REUSEPORT (a standalone
    router's workers): bound, never listening, so no connection lands on it, and
    nothing else on the machine can take the port while it is held."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    return s


@asynccontextmanager
async def routed(
    tmp_path: Path,
    pki: Pki,
    replicas: int = 1,
    *,
    context: int = 512,
    extra_catalog: str = "",
    router_extra: str = "",
    extra_keys: str = "",
    nodes: int | None = None,
    serves: str = "tiny",
    server_nofile: int | None = None,
    agent_env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Cluster, str, str]]:
    """A cluster with a router: ``replicas`` of the tiny model, on ``nodes`` agents (by
    default one, two for more than one replica), ready once ``serves`` is listed;
    ``agent_env``: over each agent's environment."""
    key = new_key()
    router = (
        '[router]\nlisten = "127.0.0.1:0"\nmax_body_mb = 1\naccess_log = true\n'
        f"{router_extra}"
        f'[[router.keys]]\nname = "tester"\nsha256 = "{hash_key(key)}"\n{extra_keys}'
    )
    # a model that never ends early: long streams to cut
    async with cluster(
        tmp_path,
        pki,
        replicas,
        ends_after=None,
        context=context,
        extra_catalog=extra_catalog,
        server_extra=router,
        settle_s=1,
        log_level="debug",  # whatever the router logs, keys must not be in it
        server_nofile=server_nofile,
    ) as c:
        for i in range(nodes if nodes is not None else 1 + (replicas > 1)):
            c.agent(f"n{i + 1}", env=agent_env)
        await c.wait_ready(replicas)
        m = await c.server.wait_log(r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)")
        base = m.group(1)
        with trio.fail_after(20):
            while True:
                async with httpx.AsyncClient() as client:
                    r = await client.get(
                        base + "/models", headers={"authorization": f"Bearer {key}"}
                    )
                if r.status_code == 200 and serves in [m["id"] for m in r.json()["data"]]:
                    break
                await trio.sleep(0.1)
        yield c, base, key


class Samples(dict[tuple[str, frozenset[tuple[str, str]]], float]):
    """The server's /metrics samples."""

    def __call__(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the samples whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.items() if n == name and want <= ls)

    @classmethod
    def parse(cls, text: str) -> Samples:
        samples = cls()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                name, _, labels = series.partition("{")
                pairs = frozenset(re.findall(r'(\w+)="([^"]*)"', labels))
                samples[(name, pairs)] = float(value)
        return samples


async def listed_routers(c: Cluster) -> list[str]:
    """The routers the server's service discovery lists (``/sd``, on its metrics
    listener), once it lists any: their metrics listeners."""
    sd = (await c.server.wait_log(r"metrics on (http://\S+)/metrics"))[1] + "/sd"
    with trio.fail_after(10):
        while True:
            async with httpx.AsyncClient(timeout=5) as raw:
                groups = (await raw.get(sd)).json()
            routers = [g for g in groups if g["labels"]["llmgw_role"] == "router"]
            if routers:
                return [t for g in routers for t in g["targets"]]
            await trio.sleep(0.2)


async def admin_metrics(c: Cluster) -> Samples:
    return Samples.parse(await c.server.metrics())


async def test_the_openai_client_chats_completes_streams_and_lists(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki) as (c, base, key):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]  # only models with a Ready replica
        assert (await client.models.retrieve("tiny")).id == "tiny"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("huge")  # in the catalog, but no replica
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert chat.choices[0].finish_reason == "length"
        assert chat.choices[0].message.content
        text = await client.completions.create(model="tiny", prompt="hello\n", max_tokens=8)
        assert text.choices[0].text
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert len(pieces) >= 8 and "".join(pieces)
        # tokens reach the metrics: chat 8 + completions 8 (from their usage), the
        # stream's 16 (counted from its events), and 3 from a stream's own usage
        usage = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert [u.usage.completion_tokens async for u in usage if u.usage] == [3]
        seen = await admin_metrics(c)
        assert seen("llmgw_router_completion_tokens_sum", model="tiny") == 8 + 8 + 16 + 3
        assert seen("llmgw_router_time_to_first_token_seconds_count", model="tiny") == 2
        # the raw stream keeps its SSE framing and ends with [DONE], with no content-length
        async with (
            httpx.AsyncClient(timeout=10) as raw,
            raw.stream(
                "POST",
                base + "/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "stream": True,
                },
            ) as r,
        ):
            assert "content-length" not in r.headers
            body = b"".join([c async for c in r.aiter_bytes()])
        assert body.rstrip().endswith(b"data: [DONE]")
        # ctl replicas shows the router's view of the replica: nothing in flight now,
        # breaker closed, and the engine's gauges once scraped after its slot let go
        # (a scrape may come while llama-server still counts the stream as running)
        with trio.fail_after(10):
            while True:
                out = await c.server.ctl("replicas", "--json")
                [traffic] = [r["traffic"] for r in json.loads(out.stdout)["replicas"]]
                if traffic["load_age_s"] is not None and traffic["running"] == 0:
                    break
                await trio.sleep(0.2)
        assert traffic["in_flight"] == 0 and traffic["breaker"] == "closed"
        assert traffic["running"] == 0 and traffic["waiting"] == 0  # llama.cpp's gauges
        table = (await c.server.ctl("replicas")).stdout.decode()
        assert "TRAFFIC" in table and "0 in flight, 0 waiting, 0 running" in table


async def test_errors_in_openais_format(tmp_path: Path, pki: Pki) -> None:
    async with routed(tmp_path, pki) as (c, base, key):
        bad = openai.AsyncOpenAI(base_url=base, api_key="llmgw-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        good = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        with pytest.raises(openai.NotFoundError) as info:
            await good.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
        assert "does not exist" in str(info.value)
        async with httpx.AsyncClient(timeout=10) as raw:
            auth = {"authorization": f"Bearer {key}"}
            missing = await raw.post(base + "/chat/completions", json={"model": "tiny"})
            assert missing.status_code == 401
            malformed = await raw.post(
                base + "/chat/completions", content=b"{not json", headers=auth
            )
            assert malformed.status_code == 400
            assert malformed.json()["error"]["type"] == "invalid_request_error"
            huge = await raw.post(
                base + "/chat/completions", content=b"x" * (2 << 20), headers=auth
            )
            assert huge.status_code == 413
            assert "error" in huge.json()
        log = c.server.log()
        assert "413" in log  # debug logging was on and saw these requests
        assert "status=401 key=- tenant=- model=-" in log  # and the access log
        assert "status=404 key=tester tenant=- model=nope" in log
        assert key not in log and "llmgw-wrong" not in log
        assert hash_key(key) in (tmp_path / "server.toml").read_text()  # only its hash is kept


async def test_a_client_that_disconnects_mid_stream_stops_the_engine(
    tmp_path: Path, pki: Pki
) -> None:
    # 8,000 tokens in an 8,192 context take this engine about 20 s on one
    # thread (each token attends to all before it), so it is still generating
    # when the client leaves; nothing but the router's closing the upstream can
    # end it within the wait below. (Waiting for a whole reply instead, this
    # llama-server build keeps generating after its client leaves, so there the
    # router's part is shown in process: tests/router/test_app.py.)
    wanted = 8000
    async with routed(tmp_path, pki, context=8192) as (c, base, key):
        [replica] = await c.replicas()
        engine = f"http://127.0.0.1:{replica['shards'][0]['port']}"
        own = {
            "authorization": f"Bearer {engine_key(tmp_path, 'n1', replica['shards'][0]['shard_id'])}"
        }

        async def gauges() -> dict[str, float]:
            async with httpx.AsyncClient(timeout=5) as client:
                text = (await client.get(engine + "/metrics", headers=own)).text
            return {
                name: float(value)
                for name, value in (line.split()[:2] for line in text.splitlines() if line)
                if name.startswith("llamacpp:")
            }

        async with (
            httpx.AsyncClient(timeout=30) as raw,
            raw.stream(
                "POST",
                base + "/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": wanted,
                    "stream": True,
                },
            ) as r,
        ):
            assert r.status_code == 200, (await r.aread()).decode()
            async for _ in r.aiter_bytes():
                break  # the first bytes arrived: the engine is generating
            with trio.fail_after(5):  # as its gauge says, once it has been read again
                while (await gauges())["llamacpp:requests_processing"] != 1.0:
                    await trio.sleep(0.05)
        # the client is gone: the router closed the upstream, the engine stopped
        with trio.fail_after(5):
            while (now := await gauges())["llamacpp:requests_processing"] != 0.0:
                await trio.sleep(0.05)
        # stopped, not finished: most of the tokens asked for were never made
        assert now["llamacpp:tokens_predicted_total"] < wanted / 2, now


async def test_a_long_prefill_does_not_cut_a_stream(tmp_path: Path, pki: Pki) -> None:
    """llama-server sends a stream's head as soon as a slot takes the request,
    then reads the prompt: the prefill falls between the head and the first
    event, and is bounded by the first-byte timeout, not the idle one."""
    async with routed(tmp_path, pki, context=8192, router_extra="idle_timeout_s = 0.3\n") as (
        _,
        base,
        key,
    ):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        start = trio.current_time()
        stream = await client.completions.create(
            model="tiny", prompt="hello world " * 1500, max_tokens=4, stream=True
        )  # about 7,500 tokens: 1.5 s of prefill here
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert trio.current_time() - start > 0.3  # the prefill did outlast the idle timeout
        assert len(pieces) >= 4


async def test_killing_a_replicas_engine_fails_no_request_that_had_not_started(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki, replicas=2) as (c, base, key):
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=20)
        replicas = await c.replicas()
        victim = replicas[0]["shards"][0]
        failures: list[str] = []
        done = 0

        async def one() -> None:
            nonlocal done
            try:
                await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            except openai.APIError as exc:
                failures.append(str(exc))
            done += 1

        async with trio.open_nursery() as nursery:
            for i in range(40):
                if i == 10:
                    os.killpg(
                        engine_pid(c.tmp, victim["node_id"], victim["shard_id"]), signal.SIGKILL
                    )
                nursery.start_soon(one)
                await trio.sleep(0.05)
        assert done == 40
        # a request already being answered by the killed engine may fail; none other may
        assert len(failures) <= 1, failures


async def test_draining_a_node_under_routed_traffic_loses_nothing(tmp_path: Path, pki: Pki) -> None:
    """ctl drain under traffic through the router: a stream in flight on the old
    replica runs to its end, no request fails, and once the replacement is Ready
    the old one takes no new request and goes. (Here the old replica is also the
    busier, so load alone would spare it; tests/router/test_app.py shows the
    draining rule on its own, with the draining replica the idler one on paper.)"""
    async with routed(tmp_path, pki, context=8192) as (c, base, key):
        [old] = await c.replicas()
        old_node = old["shards"][0]["node_id"]
        c.agent("n2")
        await c.server.wait_node("n2", "Ready")
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        ended: list[str | None] = []
        sent, failed = 0, []
        done = trio.Event()

        async def long_stream() -> None:  # about 8 s of tokens on the old replica
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5000,
                stream=True,
            )
            ended.extend([c.choices[0].finish_reason async for c in stream if c.choices][-1:])

        async def traffic() -> None:
            nonlocal sent
            while not done.is_set():
                try:
                    await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                    )
                except openai.APIError as exc:
                    failed.append(repr(exc))
                sent += 1
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            await trio.sleep(0.5)  # it has started on the only replica
            nursery.start_soon(traffic)
            await c.server.ctl("drain", old_node)
            old_id, counted = old["replica_id"], None
            after_drain: list[float] = []
            with trio.fail_after(60):
                while True:
                    replicas = await c.replicas()
                    draining = any(
                        r["replica_id"] == old_id and r["state"] == "Draining" for r in replicas
                    )
                    if draining and counted is None:
                        # a table beat later the old replica must take nothing more:
                        # what it will have answered in all is what it has answered
                        # now, and what it still holds (less the stream, counted at
                        # its head; a short request may wait behind it in the engine)
                        await trio.sleep(0.5)
                        now = await admin_metrics(c)
                        counted = (
                            now("llmgw_router_requests_total", replica=old_id)
                            + now("llmgw_router_in_flight", replica=old_id)
                            - 1
                        )
                    elif counted is not None:  # never more than it held when it drained
                        now = await admin_metrics(c)
                        after_drain.append(now("llmgw_router_requests_total", replica=old_id))
                    where = [(s["node_id"], r["state"]) for r in replicas for s in r["shards"]]
                    if where == [("n2", "Ready")]:
                        break
                    await trio.sleep(0.1)
            await trio.sleep(1.0)  # the replacement serves on its own
            with trio.fail_after(30):  # a request may have waited behind the stream
                while sent < 10:
                    await trio.sleep(0.1)
            done.set()
        assert ended == ["length"]  # the stream ran to its end, not cut
        assert sent >= 10 and failed == []
        seen = await admin_metrics(c)
        assert counted is not None, "the old replica was never seen Draining"
        assert max(after_drain, default=0) <= counted, (after_drain, counted)
        # gone from the table, its series are gone from the metrics too
        assert seen("llmgw_router_requests_total", replica=old_id) == 0
        assert seen("llmgw_router_requests_total", model="tiny") > 0


async def test_a_hung_engine_times_out_and_its_breaker_opens(tmp_path: Path, pki: Pki) -> None:
    """An engine that accepts and never answers: each request ends in a bounded 504,
    and after five in a row the breaker opens. It is the model's only replica, so
    requests still go there (panic) rather than a 503 for everyone."""
    listener = await trio.open_tcp_listeners(0, host="127.0.0.1")
    hung_port = listener[0].socket.getsockname()[1]
    held: list[trio.SocketStream] = []

    async def accept_and_say_nothing() -> None:
        while True:
            held.append(await listener[0].accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_and_say_nothing)
        extra = f'\n[models.stuck]\nstatic_endpoints = ["http://127.0.0.1:{hung_port}"]\n'
        async with routed(
            tmp_path,
            pki,
            extra_catalog=extra,
            router_extra="first_byte_timeout_s = 0.5\nmax_attempts = 1\n",
        ) as (c, base, key):
            async with httpx.AsyncClient(timeout=10) as raw:
                auth = {"authorization": f"Bearer {key}"}
                req = {"model": "stuck", "messages": [{"role": "user", "content": "hi"}]}
                for _ in range(5):
                    start = trio.current_time()
                    r = await raw.post(base + "/chat/completions", json=req, headers=auth)
                    assert r.status_code == 504, r.text
                    assert trio.current_time() - start < 3
                r = await raw.post(base + "/chat/completions", json=req, headers=auth)
                assert r.status_code == 504, r.text  # panic: the least bad replica
                # the healthy model is untouched, and the metrics tell the story
                ok = await raw.post(
                    base + "/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4,
                    },
                    headers=auth,
                )
                assert ok.status_code == 200
                metrics = await admin_metrics(c)
            assert metrics("llmgw_router_breaker_open", model="stuck") == 1
            assert metrics("llmgw_router_panic", model="stuck") == 1
            assert metrics("llmgw_router_panic_routed_total", model="stuck") == 1
            assert metrics("llmgw_router_panic", model="tiny") == 0
            assert metrics("llmgw_router_upstream_errors_total", model="stuck") == 6
            assert metrics("llmgw_router_upstream_errors_total", kind="timeout_head") == 6
            assert metrics("llmgw_router_requests_total", model="stuck", status="504") == 6
            assert metrics("llmgw_router_requests_total", model="tiny", key="tester") == 1
        nursery.cancel_scope.cancel()


async def test_a_key_limited_to_some_models_sees_only_those(tmp_path: Path, pki: Pki) -> None:
    other = new_key()
    extra_keys = (
        f'[[router.keys]]\nname = "limited"\nsha256 = "{hash_key(other)}"\nmodels = ["huge"]\n'
    )
    async with routed(tmp_path, pki, extra_keys=extra_keys) as (_, base, key):
        limited = openai.AsyncOpenAI(base_url=base, api_key=other, max_retries=0)
        assert [m.id for m in (await limited.models.list()).data] == []
        with pytest.raises(openai.PermissionDeniedError):  # it exists, but not for this key
            await limited.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        with pytest.raises(openai.NotFoundError):  # an unknown model stays unknown
            await limited.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        full = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        assert [m.id for m in (await full.models.list()).data] == ["tiny"]


async def test_a_standalone_router_with_two_workers_follows_the_control_plane(
    tmp_path: Path, pki: Pki
) -> None:
    """`llmgw router` on its own (two processes sharing the port) follows the routing
    table over the admin API, and keeps serving while the control plane is away."""
    # (a [metrics] table among the [router] keys: the server's own metrics listener)
    metrics = '[metrics]\nlisten = "127.0.0.1:0"\n'
    async with routed(tmp_path, pki, router_extra=metrics) as (c, _, key):
        held = reserved_port()
        port = held.getsockname()[1]
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            "workers = 2\n"
            'metrics_listen = "127.0.0.1:0"\n'
            f'[router]\nlisten = "127.0.0.1:{port}"\n'
            f'[[router.keys]]\nname = "edge"\nsha256 = "{hash_key(key)}"\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        c.agents["router"] = router  # killed with the rest
        base = f"http://127.0.0.1:{port}/v1"
        await workers_route(router, 1)  # both workers
        m = await router.wait_log(r"router metrics on (http://127\.0\.0\.1:\d+/metrics)")
        metrics_url = m.group(1)
        # the control plane's service discovery lists the router, as it said in its report
        targets = await listed_routers(c)
        assert [f"http://{t}/metrics" for t in targets] == [metrics_url]
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        for _ in range(6):  # connections land on both workers
            reply = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content
        # one metrics page for both workers, each sample labelled with its worker (a
        # worker that does not answer within a second is left out of that page, and
        # said so: on a busy machine, the next scrape has it)
        async with httpx.AsyncClient(timeout=5) as raw:
            with trio.fail_after(15):
                while True:
                    page = (await raw.get(metrics_url)).text
                    samples = Samples.parse(page)
                    if samples("llmgw_router_worker_up", worker="1") == 1:
                        break
                    await trio.sleep(0.5)
        assert samples("llmgw_router_requests_total", model="tiny", status="200") == 6
        routes_seen = {
            dict(labels)["worker"]
            for (name, labels) in samples
            if name == "llmgw_router_in_flight" and ("model", "tiny") in labels
        }
        assert routes_seen == {"0", "1"}  # both follow the table
        # what every daemon's metrics carry: its build, its process, and no _created series
        assert samples("llmgw_build_info", role="router", version="0.1.0") >= 1
        assert samples("process_cpu_seconds_total") > 0
        assert "_created" not in page
        await c.server.stop(signal.SIGKILL)  # the control plane goes away
        await trio.sleep(0.5)
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content  # the engine serves, the router routes
        took = await router.stop(signal.SIGTERM)
        held.close()
        assert took < 2.0


async def test_a_standalone_router_reports_in_a_post_of_its_own_and_polls_with_none(
    tmp_path: Path, pki: Pki
) -> None:
    """What a router tells the control plane (where its metrics are) goes in a report
    posted to its own path, and that is what the control plane's service discovery
    lists; the routing polls carry none of it. Read off the wire: the router follows
    the control plane through a proxy that keeps every byte the router sent."""
    metrics = '[metrics]\nlisten = "127.0.0.1:0"\n'
    async with cluster(tmp_path, pki, server_extra=metrics) as c, trio.open_nursery() as nursery:
        proxy = Proxy(int(c.server.admin_url.rsplit(":", 1)[1]))
        await nursery.start(proxy.serve)
        (tmp_path / "router.toml").write_text(
            f'admin_url = "http://127.0.0.1:{proxy.port}"\n'
            'admin_token_file = "state/admin-token"\n'
            'metrics_listen = "127.0.0.1:0"\n'
            '[router]\nlisten = "127.0.0.1:0"\n'
        )
        async with stopped_with_sigterm(
            Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        ) as router:
            m = await router.wait_log(r"router metrics on http://(127\.0\.0\.1:\d+)/metrics")
            assert await listed_routers(c) == [m.group(1)]
            sent = bytes(proxy.sent).decode(errors="replace")
            heads = re.findall(r"(GET|POST) (/v1/routing\S*) HTTP/1\.1", sent)
            assert ("POST", "/v1/routing/report") in heads, heads
            polls = [path for method, path in heads if method == "GET"]
            assert polls and not [p for p in polls if re.search(r"[?&](router|wedged|metrics)=", p)]
            assert f'"metrics":"{m.group(1)}"' in sent  # in the report's body
        proxy.sever()
        nursery.cancel_scope.cancel()


async def test_every_worker_of_a_standalone_router_logs_at_the_level_asked(
    tmp_path: Path, pki: Pki
) -> None:
    """`llmgw router --log-level debug` over a config that says info: every worker logs
    at debug (the reports each worker makes, under its own router id, show), not only
    the first."""
    async with routed(tmp_path, pki) as (c, _, _):
        held = reserved_port()
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            'workers = 2\nlog_level = "info"\n'
            f'[router]\nlisten = "127.0.0.1:{held.getsockname()[1]}"\n'
        )
        args = ["router", "--config", "router.toml", "--log-level", "debug"]
        async with stopped_with_sigterm(Daemon("router", args, tmp_path).start()) as router:
            await workers_route(router, 1)
            reports = r"router (\w+) reported to the control plane"
            with trio.move_on_after(10):
                while len(set(re.findall(reports, router.log()))) < 2:
                    await trio.sleep(0.1)
            workers = set(re.findall(reports, router.log()))
            assert len(workers) == 2, f"{len(workers)} of 2 workers log at debug:\n{router.log()}"
        held.close()

"""Tenants and their keys through real processes: ``llmgw ctl tenant``/``key`` against
``llmgw server``, its in-process router and a standalone ``llmgw router`` of two
workers, a real llama-server behind them and the real openai client in front."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

from tests.cluster.procs import Daemon, listening, workers_route
from tests.cluster.test_router_processes import reserved_port, stopped_with_sigterm
from tests.conftest import Pki
from tests.engines.test_tinymodel import llama_server
from tests.realparts import needs_server
from tests.router.gateway import Gateway, gateway
from tools.support.tinymodel import write_model

pytestmark = needs_server

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def chat(base: str, key: str, max_tokens: int = 4) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            base + "/chat/completions",
            json={"model": "m", "messages": HI, "max_tokens": max_tokens},
            headers={"authorization": f"Bearer {key}"},
        )


async def status_within(
    bases: list[str], key: str, status: int, within: float, times: int = 4
) -> float:
    """Seconds until a chat with ``key`` answers ``status`` through every one of
    ``bases``, ``times`` over (a standalone router's connections land on either of
    its workers); fails past ``within``."""
    start = trio.current_time()
    for base in bases:
        for _ in range(times):
            while (got := (await chat(base, key)).status_code) != status:
                took = trio.current_time() - start
                assert took < within, f"{base}: still {got} after {took:.2f} s, not {status}"
                await trio.sleep(0.02)
    return trio.current_time() - start


async def ctl_json(gw: Gateway, *args: str) -> dict[str, object]:
    out = (await gw.server.ctl(*args, "--json")).stdout.decode()
    answer = json.loads(out)
    assert isinstance(answer, dict)
    return answer


async def usage(gw: Gateway, tenant: str) -> list[dict[str, Any]]:
    """``ctl usage --tenant T --json``'s rows."""
    out = (await gw.server.ctl("usage", "--tenant", tenant, "--json")).stdout
    rows = json.loads(out)["rows"]
    assert isinstance(rows, list)
    return rows


@asynccontextmanager
async def fleet(tmp_path: Path, pki: Pki) -> AsyncIterator[tuple[Gateway, str]]:
    """A server routing model ``m`` to a llama-server, and a standalone router of two
    workers following it: the gateway and the router's base URL."""
    # a model that never ends early, with room for a stream of seconds
    model = write_model(tmp_path / "tiny.gguf", ends_after=None, context_length=4096)
    async with (
        llama_server(model, tmp_path, parallel=2, context=8192) as url,
        gateway(tmp_path, pki, [url]) as gw,
    ):
        held = reserved_port()
        port = held.getsockname()[1]
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{gw.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            "workers = 2\n"
            f'[router]\nlisten = "127.0.0.1:{port}"\naccess_log = true\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path)
        async with stopped_with_sigterm(router.start()):
            await workers_route(router, 1)
            yield gw, f"http://127.0.0.1:{port}/v1"
        held.close()


async def test_a_tenants_key_is_made_used_revoked_and_kept_across_a_restart(
    tmp_path: Path, pki: Pki
) -> None:
    """``ctl tenant create`` and ``ctl key create --tenant``: the key, shown once, works
    at the in-process router and at every worker of a standalone router within a
    second, names its tenant in the access log, is listed by its first letters only;
    revoked, every router refuses it within a second; one that expires is refused
    after, saying so; and the server restarted keeps every confirmed change."""
    async with fleet(tmp_path, pki) as (gw, edge):
        made = await gw.server.ctl("tenant", "create", "acme", "--rpm", "1000")
        assert "acme" in made.stdout.decode() and "rpm=1000" in made.stdout.decode()
        answer = await ctl_json(gw, "key", "create", "--tenant", "acme", "--name", "acme-ci")
        key = str(answer["key"])
        assert key.startswith("llmgw-")
        took = await status_within([gw.base, edge], key, 200, within=1.0)
        client = openai.AsyncOpenAI(base_url=edge, api_key=key, max_retries=0)
        reply = await client.chat.completions.create(model="m", messages=HI, max_tokens=4)
        assert reply.choices[0].message.content
        # what it used, fleet-wide: 4 answers in process, 5 through the standalone
        # router's workers, which report theirs within seconds
        with trio.fail_after(15):
            while not (rows := await usage(gw, "acme")) or rows[0]["requests"] != 9:
                await trio.sleep(0.2)
        [row] = rows
        assert row["model"] == "m" and row["completion_tokens"] == 9 * 4, row
        assert row["prompt_tokens"] >= 9, row
        table = (await gw.server.ctl("usage")).stdout.decode()
        assert re.search(r"acme\s+m\s+9\s+\d+\s+36\s+-", table), table

        listed = (await gw.server.ctl("key", "list")).stdout.decode()
        assert "acme-ci" in listed and key[:12] in listed and key not in listed
        shown = json.dumps(await ctl_json(gw, "tenant", "show", "acme"))
        assert key not in shown and "sha256" not in shown
        state = (tmp_path / "state" / "tenants.json").read_text()
        assert key not in state
        assert re.search(r"status=200 key=acme-ci tenant=acme model=m", gw.server.log())

        revoked = await gw.server.ctl("key", "revoke", "acme-ci")
        assert "key acme-ci of tenant acme revoked" in revoked.stdout.decode()
        took = max(took, await status_within([gw.base, edge], key, 401, within=1.0))

        # a key that expires works until then, and is refused after, saying so
        brief = str(
            (await ctl_json(gw, "key", "create", "--tenant", "acme", "--expires", "3s"))["key"]
        )
        await status_within([gw.base, edge], brief, 200, within=1.0)
        await trio.sleep(3.1)
        gone = await chat(edge, brief)
        assert gone.status_code == 401 and "expired at" in gone.json()["error"]["message"]

        # the server restarted: the tenant and a key made before it are there still
        kept = str((await ctl_json(gw, "key", "create", "--tenant", "acme"))["key"])
        gw.server.kill()
        # back where the standalone router looks for it (its leases come from there)
        config = tmp_path / "server.toml"
        admin = gw.server.admin_url.rsplit(":", 1)[1]
        config.write_text(
            config.read_text().replace(
                '[admin]\nlisten = "127.0.0.1:0"', f'[admin]\nlisten = "127.0.0.1:{admin}"'
            )
        )
        gw.server.start()
        await gw.server.ready(count=2)
        m = await gw.server.wait_log(r"OpenAI-compatible endpoint on (http://\S+/v1)", count=2)
        with trio.fail_after(20):
            while (await chat(m.group(1), kept)).status_code != 200:
                await trio.sleep(0.1)
        await status_within([edge], kept, 200, within=10.0)
        assert (await chat(m.group(1), key)).status_code == 401  # revoked stays revoked
        tenants = (await gw.server.ctl("tenant", "list")).stdout.decode()
        assert re.search(r"acme\s+all\s+rpm=1000\s+1 \(\+1 expired\)", tenants), tenants
        for secret in (key, brief, kept):
            assert secret not in gw.server.log()
    print(f"a made or revoked key reached every router in {took:.2f} s at most")


async def test_a_tenants_limits_hold_at_the_router_and_say_which(tmp_path: Path, pki: Pki) -> None:
    """In flight 1: a second request while a stream runs is 429 naming the limit, with
    Retry-After, until the stream ends. Then 3 a minute, set on the running tenant
    (``ctl tenant set``): three answered with OpenAI's x-ratelimit headers counting
    down, the fourth 429 with its reset; counted per tenant in the metrics. A key's
    own limit holds within its tenant's."""
    async with fleet(tmp_path, pki) as (gw, _):
        await gw.server.ctl("tenant", "create", "busy", "--in-flight", "1")
        key = str((await ctl_json(gw, "key", "create", "--tenant", "busy"))["key"])
        await status_within([gw.base], key, 200, within=1.0, times=1)
        client = openai.AsyncOpenAI(base_url=gw.base, api_key=key, max_retries=0)
        stream = await client.chat.completions.create(
            model="m", messages=HI, max_tokens=3000, stream=True
        )
        refused = await chat(gw.base, key)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "tenant 'busy' is at its limit of 1 requests in flight" in error["message"]
        assert refused.headers["retry-after"] == "1"
        async for _ in stream:
            pass
        assert (await chat(gw.base, key)).status_code == 200  # the stream's slot is free

        await gw.server.ctl("tenant", "set", "busy", "--in-flight", "0", "--rpm", "3")
        with trio.fail_after(5):  # the new limits reach the router
            while "rpm" not in json.dumps(await ctl_json(gw, "tenant", "show", "busy")):
                await trio.sleep(0.05)
        await trio.sleep(0.5)
        left = []
        for _ in range(3):
            r = await chat(gw.base, key)
            if r.status_code == 429:
                break
            assert r.status_code == 200
            left.append(int(r.headers["x-ratelimit-remaining-requests"]))
            assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert left == [2, 1, 0][: len(left)] and left, left
        over = await chat(gw.base, key)
        assert over.status_code == 429
        assert "limit of 3 requests per minute: it resets in" in over.json()["error"]["message"]
        assert int(over.headers["retry-after"]) >= 1
        assert over.headers["x-ratelimit-remaining-requests"] == "0"
        assert await gw.sample("llmgw_router_tenant_refused_total", tenant="busy", limit="rpm") == 1
        assert await gw.sample("llmgw_router_tenant_refused_total", limit="in_flight") == 1

        # a key's own limit, within its tenant's
        await gw.server.ctl("tenant", "set", "busy", "--rpm", "0")
        own = await ctl_json(gw, "key", "create", "--tenant", "busy", "--rpm", "1")
        await status_within([gw.base], str(own["key"]), 200, within=1.0, times=1)
        mine = await chat(gw.base, str(own["key"]))
        assert mine.status_code == 429 and "key " in mine.json()["error"]["message"]
        assert (await chat(gw.base, key)).status_code == 200  # the tenant's other key

        # tokens a minute: each request reserves its worst case and settles on its usage
        await gw.server.ctl("tenant", "create", "wordy", "--tpm", "300")
        wordy = str((await ctl_json(gw, "key", "create", "--tenant", "wordy"))["key"])
        await status_within([gw.base], wordy, 200, within=1.0, times=1)
        big = await chat(gw.base, wordy, max_tokens=1000)
        assert big.status_code == 429 and "lower max_tokens" in big.json()["error"]["message"]
        used, remaining = 0, []
        for _ in range(40):
            r = await chat(gw.base, wordy, max_tokens=16)
            if r.status_code == 429:
                break
            assert r.status_code == 200, r.text
            used += r.json()["usage"]["total_tokens"]
            remaining.append(int(r.headers["x-ratelimit-remaining-tokens"]))
        assert r.status_code == 429 and "300 tokens per minute: it resets in" in r.text
        assert r.headers["x-ratelimit-limit-tokens"] == "300"
        assert remaining == sorted(remaining, reverse=True) and len(remaining) >= 3, remaining
        first = 0  # what status_within's request used is within the 300 too
        reserve = len(json.dumps({"model": "m", "messages": HI, "max_tokens": 16})) // 3 + 17
        assert 300 - reserve - 40 <= used + first <= 300, (used, reserve)
        assert (
            await gw.sample("llmgw_router_tenant_refused_total", tenant="wordy", limit="tpm") == 2
        )
        [row] = await usage(gw, "wordy")  # the in-process router's, read as asked
        assert row["requests"] == len(remaining) + 1, row
        assert row["prompt_tokens"] + row["completion_tokens"] >= used, row
        assert row["refused"] == {"tpm": 2}, row


async def test_a_tenants_limits_hold_across_every_router_process(tmp_path: Path, pki: Pki) -> None:
    """12 a minute, sent through the in-process router and the two workers of a
    standalone router in turn: exactly 12 answered, however they fall, each router
    spending leases of the one limit. Then a budget of tokens a day: what is served
    stays within it, and past it every router refuses with insufficient_quota. With
    the control plane killed, a router serves what its leases hold, then refuses
    saying why."""
    async with fleet(tmp_path, pki) as (gw, edge):
        await gw.server.ctl("tenant", "create", "shared")
        key = str((await ctl_json(gw, "key", "create", "--tenant", "shared"))["key"])
        await status_within([gw.base, edge], key, 200, within=1.0)
        await gw.server.ctl("tenant", "set", "shared", "--rpm", "12")
        await trio.sleep(1.0)  # the limit reaches every router
        got = [(await chat(base, key)).status_code for _ in range(12) for base in (gw.base, edge)]
        assert got.count(200) == 12 and got.count(429) == 12, got
        over = await chat(edge, key)
        assert over.status_code == 429
        assert "tenant 'shared' is at its limit of 12 requests per minute" in over.text
        leases = json.loads((tmp_path / "state" / "leases.json").read_text())
        assert any(k.startswith("tenant/shared/rpm") for k in leases["pots"]), leases
        # the operator's view: every router exchanging, the minute's 12 granted
        samples = await gw.metrics()
        no_labels: frozenset[tuple[str, str]] = frozenset()
        assert samples["llmgw_leases_routers", no_labels] == 3, samples  # 1 + 2 workers
        assert samples["llmgw_leases_exchanges_total", no_labels] > 3
        assert samples["llmgw_leases_granted_units_total", frozenset({("kind", "rpm")})] >= 12
        assert samples["llmgw_leases_denied_total", frozenset({("kind", "rpm"), ("why", "limit")})]

        await gw.server.ctl("tenant", "create", "thrifty", "--budget-day", "600")
        thrifty = str((await ctl_json(gw, "key", "create", "--tenant", "thrifty"))["key"])
        served, answers = 0, []
        with trio.fail_after(60):
            for i in range(200):
                r = await chat((gw.base, edge)[i % 2], thrifty, max_tokens=16)
                answers.append(r.status_code)
                if r.status_code == 200:
                    served += r.json()["usage"]["total_tokens"]
                elif r.status_code == 429:
                    error = r.json()["error"]
                    if error["code"] == "insufficient_quota":
                        break
                    assert "cannot ask" not in error["message"], error
        assert error["type"] == "insufficient_quota", error
        assert "has used its budget of 600 tokens a day: it resets in" in error["message"]
        reserve = len(json.dumps({"model": "m", "messages": HI, "max_tokens": 16})) // 3 + 17
        assert 600 - 2 * reserve <= served <= 600, (served, answers)
        for base in (gw.base, edge):  # spent, at every router
            assert (await chat(base, thrifty)).json()["error"]["code"] == "insufficient_quota"
        shown = (await gw.server.ctl("tenant", "show", "thrifty")).stdout.decode()
        counted = re.search(r"counted\s+budget_day (\d+)/600", shown)
        assert counted and served <= int(counted.group(1)) <= 600, shown

        # the control plane killed: the standalone router spends what it holds, then
        # refuses in words; it never serves what it was not granted
        await gw.server.ctl("tenant", "create", "steady", "--rpm", "600")
        steady = str((await ctl_json(gw, "key", "create", "--tenant", "steady"))["key"])
        await status_within([edge], steady, 200, within=1.0)
        for _ in range(10):  # busy: it holds requests ahead of need
            assert (await chat(edge, steady)).status_code == 200
        gw.server.kill()
        after = [await chat(edge, steady) for _ in range(40)]
        codes = [r.status_code for r in after]
        # each connection lands on either worker, each with leases of its own
        assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
        for r in after:
            if r.status_code == 429:
                refused = r.json()["error"]["message"]
                assert "cannot ask for more" in refused and "control plane" in refused, refused
        assert codes.count(200) <= 30, codes  # what they held: a few seconds' worth


async def test_a_budget_nearly_spent_waits_for_what_a_stream_in_flight_reserved(
    tmp_path: Path, pki: Pki
) -> None:
    """A stream reserves its worst case (its max_tokens) of its tenant's budget until it
    ends. A request through another router that fits only in what the stream will not
    use waits for it (the stream cut a moment later gives it back) and is served,
    rather than told the budget is used up for the day; the count stays within it."""
    async with fleet(tmp_path, pki) as (gw, edge):
        await gw.server.ctl("tenant", "create", "nearly", "--budget-day", "5000")
        key = str((await ctl_json(gw, "key", "create", "--tenant", "nearly"))["key"])
        await status_within([gw.base, edge], key, 200, within=1.0, times=1)
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": "m", "messages": HI, "max_tokens": 4000, "stream": True}
        answers: list[httpx.Response] = []
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream(
                "POST", gw.base + "/chat/completions", json=body, headers=headers
            ) as stream,
        ):
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data:")
            await trio.sleep(1.2)  # the in-process router has said what it reserved

            async def fits_once_the_stream_ends() -> None:
                answers.append(await chat(edge, key, max_tokens=1500))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fits_once_the_stream_ends)
                await trio.sleep(0.5)
                assert not answers, answers[0].text  # it waits, while the stream runs
                async for line in lines:  # still running: nothing it reserved came back
                    assert '"finish_reason":"length"' not in line
                    break
                await stream.aclose()
        [answer] = answers
        assert answer.status_code == 200, answer.text
        shown = (await gw.server.ctl("tenant", "show", "nearly")).stdout.decode()
        counted = re.search(r"counted\s+budget_day (\d+)/5000", shown)
        assert counted and int(counted.group(1)) <= 5000, shown


async def test_a_router_starting_refuses_no_good_key_while_its_table_comes(
    tmp_path: Path, pki: Pki
) -> None:
    """A standalone router (re)started holds its clients' connections until the control
    plane's routing table comes, with the tenants' keys, rather than answer a good key
    401 (the control plane held still a second here). One that hears nothing within
    5 s serves, answering 503 that says why, /healthz not ready, until it comes."""
    async with fleet(tmp_path, pki) as (gw, edge):
        await gw.server.ctl("tenant", "create", "t")
        key = str((await ctl_json(gw, "key", "create", "--tenant", "t"))["key"])
        await status_within([gw.base, edge], key, 200, within=1.0, times=1)
        held = reserved_port()
        port = held.getsockname()[1]
        base = f"http://127.0.0.1:{port}/v1"
        (tmp_path / "late.toml").write_text(
            f'admin_url = "{gw.server.admin_url}"\nadmin_token_file = "state/admin-token"\n'
            f'[router]\nlisten = "127.0.0.1:{port}"\n'
        )
        answers: list[httpx.Response] = []

        async def first_request() -> None:
            while not listening(port):
                await trio.sleep(0.01)
            answers.append(await chat(base, key))

        gw.server.send_signal(signal.SIGSTOP)
        try:
            late = Daemon("late", ["router", "--config", "late.toml"], tmp_path).start()
            async with stopped_with_sigterm(late), trio.open_nursery() as nursery:
                nursery.start_soon(first_request)
                await trio.sleep(1.0)
                assert not answers, answers[0].text  # held, not refused
                gw.server.send_signal(signal.SIGCONT)
            [answer] = answers
            assert answer.status_code == 200, answer.text

            gw.server.send_signal(signal.SIGSTOP)  # and now for longer than it waits
            late = Daemon("late", ["router", "--config", "late.toml"], tmp_path).start()
            async with stopped_with_sigterm(late):
                await late.wait_log(r"no routing table from the control plane at .* within 5 s")
                unheard = await chat(base, key)
                assert unheard.status_code == 503, unheard.text
                assert unheard.json()["error"]["code"] == "router_starting"
                assert "not received the routing table" in unheard.json()["error"]["message"]
                assert unheard.headers["retry-after"] == "1"
                async with httpx.AsyncClient(timeout=5) as client:
                    health = await client.get(f"http://127.0.0.1:{port}/healthz")
                assert health.status_code == 503 and "starting" in health.text
                gw.server.send_signal(signal.SIGCONT)
                await status_within([base], key, 200, within=10.0, times=1)
        finally:
            gw.server.send_signal(signal.SIGCONT)
            held.close()


async def test_tenant_commands_say_what_is_wrong_in_one_line(tmp_path: Path, pki: Pki) -> None:
    """Refusals an operator meets: each one line, exit 2, nothing changed."""
    model = write_model(tmp_path / "tiny.gguf", ends_after=None)
    async with llama_server(model, tmp_path) as url, gateway(tmp_path, pki, [url]) as gw:
        await gw.server.ctl("tenant", "create", "acme", "--models", "m")
        for args, said in [
            (("tenant", "create", "acme"), "tenant 'acme' exists already"),
            (("tenant", "create", "Bad Name"), "tenant name 'Bad Name': use lowercase"),
            (("tenant", "show", "nobody"), "no tenant 'nobody'"),
            (("key", "create", "--tenant", "nobody"), "no tenant 'nobody'"),
            (("key", "create", "--tenant", "acme", "--models", "x"), "may use only m"),
            (("key", "create", "--tenant", "acme", "--expires", "soon"), "--expires 'soon'"),
            (("key", "revoke", "nope"), "no key 'nope'"),
            (("tenant", "set", "acme"), "nothing to change"),
            (("tenant", "create", "zero", "--rpm", "0"), "--rpm 0: give a number of at least 1"),
        ]:
            result = await gw.server.ctl(*args, check=False)
            err = result.stderr.decode().strip()
            assert result.returncode == 2 and said in err, (args, err)
            assert len(err.splitlines()) == 1, err
        listed = json.loads((await gw.server.ctl("tenant", "list", "--json")).stdout)
        assert [t["name"] for t in listed["tenants"]] == ["acme"]
        # a key of no tenant: the config lines, as before tenants
        lines = (await gw.server.ctl("key", "create", "edge")).stdout.decode()
        assert "[[router.keys]]" in lines and 'name = "edge"' in lines


@pytest.mark.parametrize("broken", [b"{not json", b'{"tenants": 3}'])
async def test_a_tenants_file_the_server_cannot_read_stops_it_with_one_line(
    tmp_path: Path, pki: Pki, broken: bytes
) -> None:
    """Rather than start with no tenants and refuse every tenant's key."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "tenants.json").write_bytes(broken)
    with pytest.raises(Exception, match="tenants file is not valid"):
        async with gateway(tmp_path, pki, ["http://127.0.0.1:9"]):
            pass


async def test_a_full_model_serves_the_quiet_tenant_before_the_one_that_floods_it(
    tmp_path: Path, pki: Pki
) -> None:
    """A one-slot engine, nothing admitted that would wait on it, the router's queue
    on: while a stream of the noisy tenant holds the slot, three more of its requests
    queue, then one of the quiet tenant (new: it used nothing). When the slot frees,
    the quiet one goes first, then the noisy ones in the order they came; the access
    log says how long each waited for room (``queued=``)."""
    model = write_model(tmp_path / "tiny.gguf", ends_after=None, context_length=4096)
    async with (
        llama_server(model, tmp_path, parallel=1, context=4096) as url,
        gateway(
            tmp_path,
            pki,
            [url],
            router_extra="queue_timeout_s = 30",
            model_extra="[models.m.routing]\ntarget_waiting = 0\n",
        ) as gw,
    ):
        keys = {}
        for tenant in ("noisy", "quiet"):
            await gw.server.ctl("tenant", "create", tenant)
            keys[tenant] = str((await ctl_json(gw, "key", "create", "--tenant", tenant))["key"])
        await status_within([gw.base], keys["quiet"], 200, within=2.0, times=1)

        async def ask(key: str) -> None:
            r = await chat(gw.base, key, max_tokens=8)
            assert r.status_code == 200, r.text

        async def queued() -> int:
            samples = await gw.metrics()
            return int(samples.get(("llmgw_router_queued", frozenset({("model", "m")})), 0))

        async def until_queued(n: int) -> None:
            while await queued() < n:
                await trio.sleep(0.01)

        # long enough to outlast the queueing below on a slow machine
        body = {"model": "m", "messages": HI, "max_tokens": 3000, "stream": True}
        auth = {"authorization": f"Bearer {keys['noisy']}"}
        with trio.fail_after(60):
            async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as inner:
                async with client.stream(
                    "POST", gw.base + "/chat/completions", json=body, headers=auth
                ) as r:
                    lines = r.aiter_lines()
                    await lines.__anext__()  # the stream holds the slot
                    for i in range(3):
                        inner.start_soon(ask, keys["noisy"])
                        await until_queued(i + 1)  # each queued before the next is sent
                    inner.start_soon(ask, keys["quiet"])
                    await until_queued(4)
                    async for _ in lines:
                        pass
                assert await queued() == 0
        # in the order the one slot served them: the quiet one, then the noisy ones,
        # each of which waited less than the one before (it came later)
        waited = re.findall(r"tenant=(\w+) .* queued=([\d.]+)s", gw.server.log())
        assert [who for who, _ in waited] == ["quiet", "noisy", "noisy", "noisy"], waited
        noisy = [float(s) for _, s in waited[1:]]
        assert noisy[0] > noisy[1] > noisy[2] > 0, waited
        waits = (await gw.metrics())[
            "llmgw_router_queue_seconds_count", frozenset({("model", "m")})
        ]
        assert waits == 4, waits

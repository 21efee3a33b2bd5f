"""The console's traffic page and bench curves through real processes: requests through
the server's own router and through a standalone router (which reports its counters
to the control plane) are counted per model, with errors, TTFT p95 and tokens per
second; a ``ctl bench`` run reaches the model's page and is drawn by the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tests.cluster.procs import Daemon
from tests.cluster.test_router_processes import routed
from tests.conftest import Pki
from tests.console.test_console_api import console_url, signed_in, tokens
from tests.realparts import needs_server

pytestmark = needs_server

CONSOLE = '[console]\nlisten = "127.0.0.1:0"\ntraffic_step_s = 1\n'


async def chats(base: str, key: str, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
    async with client:
        for i in range(n):
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=4,
                stream=True,
            )
            async for _ in stream:
                pass


async def traffic_of(client: httpx.AsyncClient, model: str, at_least: int) -> dict[str, Any]:
    """The model's series once it counts ``at_least`` requests."""
    with trio.fail_after(30):
        while True:
            view = (await client.get("/api/traffic")).json()
            series = view["models"].get(model)
            if series is not None and sum(series["requests"]) >= at_least:
                return dict(series)
            await trio.sleep(0.2)


async def test_traffic_counts_every_routers_requests_and_bench_runs_are_drawn(
    tmp_path: Path, pki: Pki
) -> None:
    async with routed(tmp_path, pki, router_extra=CONSOLE) as (c, base, key):
        url = await console_url(c.server)
        admin, viewer = tokens(tmp_path)
        async with signed_in(url, viewer) as (client, _):
            await chats(base, key, 3)
            series = await traffic_of(client, "tiny", 3)
            assert len(series["requests"]) == 3600  # an hour of 1 s steps
            assert sum(series["errors"]) == 0
            assert any(t is not None and t > 0 for t in series["ttft_p95_s"]), series
            assert max(series["tokens_per_s"]) > 0

            # a standalone router, following the same control plane, reports its own
            (tmp_path / "router.toml").write_text(
                f'admin_url = "{c.server.admin_url}"\nadmin_token = "{admin}"\n'
                '[router]\nlisten = "127.0.0.1:0"\n'
                + (tmp_path / "server.toml")
                .read_text()
                .split("[[router.keys]]", 1)[1]
                .join(["[[router.keys]]", ""])
            )
            router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
            try:
                m = await router.wait_log(r"serving on (http://127\.0\.0\.1:\d+/v1)")
                with trio.fail_after(20):
                    while True:
                        async with httpx.AsyncClient() as probe:
                            r = await probe.get(
                                m.group(1) + "/models", headers={"authorization": f"Bearer {key}"}
                            )
                        if r.status_code == 200 and r.json()["data"]:
                            break
                        await trio.sleep(0.1)
                await chats(m.group(1), key, 4)
                await traffic_of(client, "tiny", 7)  # 3 here, 4 there
            finally:
                router.kill()

        # a bench run is sent to the server, listed on the model's page and drawn
        [replica] = await c.wait_ready(1)
        await c.server.ctl(
            "bench", "tiny", "--replica", replica["replica_id"], "--levels", "1", "--slo", "ttft_p95=10s", "--duration", "1",
            "--input-words", "16", "--output-tokens", "4", "--out", str(tmp_path / "b.json"),
        )  # fmt: skip
        await c.server.wait_log(r"kept a bench result of tiny \(cpu, 1 levels, capacity 1\)")
        async with signed_in(url, viewer) as (client, _):
            runs = (await client.get("/api/models/tiny/bench")).json()["runs"]
            assert len(runs) == 1 and runs[0]["capacity"] == 1, runs
            assert runs[0]["levels"][0]["concurrency"] == 1
            svg = await client.get("/api/models/tiny/bench.svg?run=0")
            assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
            assert b"<svg" in svg.content and b"TTFT p95" in svg.content
            assert (await client.get("/api/models/tiny/bench.svg?run=1")).status_code == 404

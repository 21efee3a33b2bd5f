"""What a vLLM replica reused, as the router reads it: two stand-in vLLM processes (started
as the adapter starts them: prefix caching on, prompt token details on) behind the
router, the real openai client in front.

A conversation's turns go to one replica; each reply's ``usage.prompt_tokens_details.
cached_tokens`` reaches the access log (``cached=N/M``) and the metrics; the engine's
own counters (``vllm:prefix_cache_hits``/``queries``) reach the replica's view; and a
replica whose cache was reset is noticed as having evicted the prompt.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.engines.base import Launch
from llmgw.engines.vllm import VLLM
from llmgw.router.table import RoutingTable
from llmgw.routing import ModelRouting, Route, Snapshot
from tests.engines.test_vllm import STANDINS, running, spec, wait_healthy
from tests.ports import own_port
from tests.router.test_affinity_llama import two_users
from tests.router.test_resume import front


@asynccontextmanager
async def standins(
    tmp_path: Path, n: int, token_delay_s: float = 0.001
) -> AsyncIterator[list[str]]:
    """``n`` stand-in vLLMs serving model ``m``, launched with the adapter's arguments."""
    urls = []
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=10))
        for i in range(n):
            port = own_port()
            launch = VLLM.launch(spec(model="m", port=port), {"vllm": "vllm"})
            argv = [sys.executable, str(STANDINS / "vllm.py"), *launch.argv[1:]]
            assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
            proc = await stack.enter_async_context(
                running(
                    Launch(argv=argv, env={}, health_url=None, metrics_url=None),
                    tmp_path / f"vllm-{i}.log",
                    STANDIN_LOAD_S="0",
                    STANDIN_TOKEN_DELAY_S=str(token_delay_s),
                    VLLM_API_KEY="",
                    CUDA_VISIBLE_DEVICES="0,1",
                )
            )
            url = f"http://127.0.0.1:{port}"
            await wait_healthy(client, f"{url}/health", proc)
            urls.append(url)
        yield urls


async def test_a_vllm_replicas_reuse_is_read_and_an_eviction_noticed(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.router.access")
    async with standins(tmp_path, 2) as urls:
        table = RoutingTable(scrape_s=0.2)
        routes = [Route(key=f"v{i}", model="m", url=u, engine="vllm") for i, u in enumerate(urls)]
        table.apply(Snapshot(version="1", models={"m": ModelRouting()}, routes=routes))
        await nursery.start(table.run)
        app, client = await front(nursery, table, access_log=True)
        messages = [
            {"role": "system", "content": "Answer from the notes. " * 20},
            {"role": "user", "content": "Notes: " + "the tide comes in twice a day. " * 30},
        ]
        lines: list[tuple[str, int, int]] = []
        with trio.fail_after(30):
            for turn in range(4):
                reply = await client.chat.completions.create(
                    model="m",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=4,
                    stream=turn % 2 == 1,
                    **({"stream_options": {"include_usage": True}} if turn % 2 else {}),  # type: ignore[arg-type]
                )
                if turn % 2:
                    _ = [chunk async for chunk in reply]  # type: ignore[union-attr]
                messages += [
                    {"role": "assistant", "content": "Hello from the vLLM stand-in."},
                    {"role": "user", "content": f"And then {turn}?"},
                ]
                found = re.findall(r"replica=(\S+) .* cached=(\d+)/(\d+)", caplog.text)
                replica, cached, prompt = found[-1]
                lines.append((replica, int(cached), int(prompt)))
                if turn == 2:  # the replica drops its whole prefix cache
                    async with httpx.AsyncClient(trust_env=False) as raw:
                        home = urls[int(replica[1:])]
                        assert (await raw.post(f"{home}/reset_prefix_cache")).status_code == 200
        assert len({r for r, _, _ in lines}) == 1, lines  # one replica throughout
        assert lines[0][1] == 0 and lines[1][1] > 0.8 * lines[1][2], lines
        assert lines[3][1] == 0, lines  # after the reset: nothing reused
        metrics = app.metrics.registry
        home_key = lines[0][0]
        labels = {"model": "m", "replica": home_key}
        assert metrics.get_sample_value("llmgw_router_prefix_evicted_total", labels) == 1
        assert metrics.get_sample_value("llmgw_router_prompt_tokens_cached_total", labels) == sum(
            c for _, c, _ in lines
        )
        # the engine's own counters reach the replica's view (a scrape from before the
        # last request may be read first: wait for one that counts all four)
        expected = sum(c for _, c, _ in lines) / sum(p for _, _, p in lines)
        with trio.move_on_after(5):
            while (view := table.traffic(trio.current_time())[home_key]).cache_hit_rate != (
                pytest.approx(expected)
            ):
                await trio.sleep(0.1)
        assert view.cache_hit_rate == pytest.approx(expected)


async def test_a_vllm_replicas_running_requests_share_a_prompt_and_none_waits(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's prefix cache serves a prompt's blocks to every request running on it: a
    second user of a system prompt sent while the first is in flight goes at once (a
    llama.cpp replica would hold it for a slot holding the prompt: ``computing``)."""
    caplog.set_level(logging.INFO, "llmgw.router.access")
    async with standins(tmp_path, 1, token_delay_s=0.1) as urls:  # a reply takes ~0.6 s
        table = RoutingTable()
        route = Route(key="v0", model="m", url=urls[0], engine="vllm")
        table.apply(Snapshot(version="1", models={"m": ModelRouting()}, routes=[route]))
        _, client = await front(nursery, table, access_log=True)
        system = "Answer from the notes. " * 60
        await two_users(client, table.endpoints["m"][0], system, max_tokens=200)
    records = [r for r in caplog.records if r.name == "llmgw.router.access"]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 2 and not any("waited=" in line for line in lines), lines
    # they ran at once: the second began before the first ended
    took = [float(re.search(r" time=([0-9.]+)s", line)[1]) for line in lines]  # type: ignore[index]
    began = [r.created - t for r, t in zip(records, took, strict=True)]
    assert max(began) < min(r.created for r in records), lines

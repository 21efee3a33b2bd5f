"""A real Prometheus (Debian's package; tools/setup installs it as root) scrapes a real
fleet through packaging/prometheus.yml: every target (the server, the agent, the
engine through its agent, a standalone router) is found by the control plane's service discovery and is
up, and every query of packaging/grafana-dashboard.json returns data. Every metrics
listener listens on 0.0.0.0, as the packaging suggests: each is found at an address
that reaches it, never at the wildcard."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from llmgw.router.keys import hash_key, new_key
from tests.cluster.procs import Daemon
from tests.cluster.test_control_plane_processes import cluster
from tests.conftest import Pki
from tests.packaging.test_build import stop
from tests.ports import own_port
from tests.realparts import needs_server

pytestmark = needs_server

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
SD_URL = "http://cp.example.net:9465/sd"
TOKEN_FILE = "/etc/prometheus/llmgw-metrics-token"


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((PACKAGING / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def prometheus_config(sd_url: str, token_file: Path) -> str:
    """packaging/prometheus.yml as shipped, pointed at this fleet: its control plane's
    discovery and token, and a one-second scrape."""
    text = (PACKAGING / "prometheus.yml").read_text()
    assert SD_URL in text and TOKEN_FILE in text
    text = text.replace(SD_URL, sd_url).replace(TOKEN_FILE, str(token_file))
    return text.replace("scrape_interval: 15s", "scrape_interval: 1s").replace(
        "refresh_interval: 30s", "refresh_interval: 1s"
    )


async def query(client: httpx.AsyncClient, base: str, expr: str) -> list[Any]:
    r = await client.get(f"{base}/api/v1/query", params={"query": expr})
    body = r.json()
    assert body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


async def test_prometheus_finds_every_target_and_every_dashboard_query_has_data(
    tmp_path: Path, pki: Pki
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "prometheus is not installed: tools/setup installs Debian's prometheus package "
            "when run as root (apt-get install prometheus)"
        )
    token = tmp_path / "prometheus-token"
    token.write_text("prom-secret\n")
    key = new_key()
    server_extra = (
        f'[metrics]\nlisten = "0.0.0.0:0"\ntoken_file = "{token}"\n'
        '[router]\nlisten = "127.0.0.1:0"\n'
        f'[[router.keys]]\nname = "t"\nsha256 = "{hash_key(key)}"\n'
    )
    metrics = f'[metrics]\nlisten = "0.0.0.0:0"\ntoken_file = "{token}"\n'
    async with cluster(tmp_path, pki, ends_after=None, server_extra=server_extra, settle_s=1) as c:
        c.agent("n1", more=metrics)
        await c.wait_ready(1)
        listening = (await c.server.wait_log(r"metrics on (http://\S+)/metrics"))[1]
        sd = listening.replace("0.0.0.0", "127.0.0.1") + "/sd"
        base = (await c.server.wait_log(r"OpenAI-compatible endpoint on (http://\S+/v1)"))[1]
        # a standalone router too, with its metrics behind the same token
        (tmp_path / "router.toml").write_text(
            f'admin_url = "{c.server.admin_url}"\n'
            'admin_token_file = "state/admin-token"\n'
            'metrics_listen = "0.0.0.0:0"\n'
            f'metrics_token_file = "{token}"\n'
            f'[router]\nlisten = "127.0.0.1:{own_port()}"\n'
            f'[[router.keys]]\nname = "t"\nsha256 = "{hash_key(key)}"\n'
        )
        router = Daemon("router", ["router", "--config", "router.toml"], tmp_path).start()
        c.agents["router"] = router  # stopped with the rest
        await router.wait_log(r"router metrics on")
        (tmp_path / "prometheus.yml").write_text(prometheus_config(sd, token))
        port = own_port()
        with (tmp_path / "prometheus.log").open("wb") as log:
            prom = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
            hi: Any = [{"role": "user", "content": "hi"}]
            async with httpx.AsyncClient(timeout=5) as http:
                # every target found through discovery, and up
                every = {"server": "up", "agent": "up", "engine": "up", "router": "up"}
                roles: dict[str, str] = {}
                with trio.move_on_after(60):
                    while True:
                        try:
                            r = await http.get(f"{url}/api/v1/targets")
                            active = r.json()["data"]["activeTargets"]
                        except (httpx.HTTPError, KeyError, ValueError):
                            active = []
                        roles = {t["labels"].get("role"): t["health"] for t in active}
                        wild = [t["scrapeUrl"] for t in active if "0.0.0.0" in t["scrapeUrl"]]
                        assert not wild, f"targets at a wildcard address: {wild}"
                        if roles == every:
                            break
                        await trio.sleep(0.5)
                assert roles == every, f"targets found and their health: {roles}"
                # traffic, streamed and not, so the request panels have something to show
                for _ in range(3):
                    await client.chat.completions.create(model="tiny", messages=hi, max_tokens=8)
                    stream = await client.chat.completions.create(
                        model="tiny", messages=hi, max_tokens=8, stream=True
                    )
                    async for _ in stream:
                        pass
                empty: dict[str, str] = {}
                with trio.move_on_after(60):
                    while True:
                        empty = {
                            title: expr
                            for title, expr in dashboard_queries()
                            if not await query(http, url, expr)
                        }
                        if not empty:
                            break
                        await trio.sleep(1)
                assert empty == {}, f"dashboard queries without data: {empty}"
                up = await query(http, url, 'up{job="llmgw"}')
                assert {s["metric"]["role"] for s in up} == {"server", "agent", "engine", "router"}
                assert all(s["value"][1] == "1" for s in up), up
                # the engine's own page, read through its agent with the engine's key,
                # labelled with its model and replica
                [engine] = [s["metric"] for s in up if s["metric"]["role"] == "engine"]
                assert engine["model"] == "tiny" and engine["replica"].startswith("tiny-")
                llama = await query(http, url, 'llamacpp:requests_processing{role="engine"}')
                assert llama and llama[0]["metric"]["replica"] == engine["replica"], llama
        finally:
            stop(prom)

"""Metrics listeners of their own, with real processes: Prometheus reads them with its
own read-only token (or none), never the admin token, which can drain nodes."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.cluster.procs import Daemon, Server, write_server_config
from tests.cluster.test_discovery_processes import agent
from tests.cluster.test_errors_processes import exit_code, refused_at_start
from tests.cluster.test_versions_processes import NO_GPUS
from tests.conftest import Pki


def metrics_server(tmp_path: Path, pki: Pki, token: str) -> Server:
    """A server whose [metrics] listener asks for ``token`` (the file holds it)."""
    (tmp_path / "prometheus-token").write_text(token + "\n")
    config = write_server_config(tmp_path, pki)
    config.write_text(
        config.read_text() + '[metrics]\nlisten = "127.0.0.1:0"\ntoken_file = "prometheus-token"\n'
    )
    return Server("server", ["server", "--config", "server.toml"], tmp_path)


async def test_metrics_listeners_ask_for_their_own_token_and_not_the_admin_one(
    tmp_path: Path, pki: Pki
) -> None:
    started: list[Daemon] = []
    try:
        server = metrics_server(tmp_path, pki, "prom-secret")
        started.append(server.start())
        await server.ready()
        server_url = (await server.wait_log(r"metrics on (http://\S+/metrics) \(token asked\)"))[1]
        n1 = agent(
            tmp_path,
            pki,
            started,
            "n1",
            server.stream_port,
            NO_GPUS
            + f'[metrics]\nlisten = "127.0.0.1:0"\ntoken_file = "{tmp_path}/prometheus-token"\n',
        )
        agent_url = (await n1.wait_log(r"agent metrics on (http://\S+/metrics)"))[1]
        await server.wait_node("n1", "Ready")
        admin = (tmp_path / "state" / "admin-token").read_text().strip()
        async with httpx.AsyncClient(timeout=5) as client:
            for role, url in (("server", server_url), ("agent", agent_url)):
                assert (await client.get(url)).status_code == 401, role
                wrong = await client.get(url, headers={"authorization": f"Bearer {admin}"})
                assert wrong.status_code == 401, role  # the admin token is not Prometheus's
                ok = await client.get(url, headers={"authorization": "Bearer prom-secret"})
                assert ok.status_code == 200, (role, ok.text)
                assert f'role="{role}"' in ok.text and "llmgw_build_info" in ok.text
            # service discovery lists the server and every agent that serves metrics,
            # behind the same token, and each target it names answers
            assert (await client.get(server_url.replace("/metrics", "/sd"))).status_code == 401
            sd = await client.get(
                server_url.replace("/metrics", "/sd"),
                headers={"authorization": "Bearer prom-secret"},
            )
            groups = {g["labels"]["llmgw_role"]: g for g in sd.json()}
            assert groups["agent"]["labels"]["node"] == "n1"
            assert f"http://{groups['server']['targets'][0]}/metrics" == server_url
            [agent_target] = groups["agent"]["targets"]
            assert f"http://{agent_target}/metrics" == agent_url
            # the admin listener's /metrics stays, behind the admin token
            page = await client.get(
                server.admin_url + "/metrics", headers={"authorization": f"Bearer {admin}"}
            )
            assert page.status_code == 200 and "llmgw_build_info" in page.text
    finally:
        for d in started:
            d.kill()


async def test_an_empty_metrics_token_file_stops_the_server_with_one_line(
    tmp_path: Path, pki: Pki
) -> None:
    server = metrics_server(tmp_path, pki, "").start()
    assert await exit_code(server) == 2
    line = refused_at_start(server, "llmgw server")
    assert line.endswith("prometheus-token: metrics.token_file: is empty: write the token in it"), (
        line
    )

"""``llmgw server`` as a process, routing one model to static engine endpoints, for
tests of the endpoint through real processes (the engines are the test's)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import trio

from llmgw.router.keys import hash_key, new_key
from tests.cluster.procs import Server
from tests.conftest import Pki


@attrs.frozen
class Gateway:
    server: Server
    base: str  # the OpenAI-compatible endpoint, ".../v1"
    key: str  # an API key it takes
    admin_token: str

    async def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """The server's /metrics samples: (name, labels) -> value."""
        async with httpx.AsyncClient(timeout=5) as client:
            text = (
                await client.get(
                    self.server.admin_url + "/metrics",
                    headers={"authorization": f"Bearer {self.admin_token}"},
                )
            ).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                name, _, labels = series.partition("{")
                samples[name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
        return samples

    async def sample(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in (await self.metrics()).items() if n == name and want <= ls)


@asynccontextmanager
async def gateway(
    workdir: Path, pki: Pki, urls: list[str], router_extra: str = "", model_extra: str = ""
) -> AsyncIterator[Gateway]:
    """``llmgw server`` routing model ``m`` to ``urls`` (llama.cpp endpoints), its
    router on a free loopback port; stopped on the way out, however the test ends.
    ``router_extra``: more of ``[router]``; ``model_extra``: more of the catalog, after
    ``[models.m]``'s keys."""
    key = new_key()
    quoted = ", ".join(f'"{u}"' for u in urls)
    (workdir / "catalog.toml").write_text(
        f'[models.m]\nstatic_endpoints = [{quoted}]\nstatic_engine = "llama.cpp"\n' + model_extra
    )
    (workdir / "server.toml").write_text(
        f"""state_dir = "state"
catalog = "catalog.toml"
[agent_stream]
listen = "127.0.0.1:0"
ca = "{pki.ca}"
cert = "{pki.server_cert}"
key = "{pki.server_key}"
[admin]
listen = "127.0.0.1:0"
[router]
listen = "127.0.0.1:0"
access_log = true
{router_extra}
[[router.keys]]
name = "tester"
sha256 = "{hash_key(key)}"
"""
    )
    server = Server("server", ["server", "--config", "server.toml"], workdir)
    server.start()
    try:
        await server.ready()
        m = await server.wait_log(r"OpenAI-compatible endpoint on (http://127\.0\.0\.1:\d+/v1)")
        base = m.group(1)
        with trio.fail_after(20):
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    r = await client.get(
                        base + "/models", headers={"authorization": f"Bearer {key}"}
                    )
                    if r.status_code == 200 and "m" in [x["id"] for x in r.json()["data"]]:
                        break
                    await trio.sleep(0.1)
        token = (workdir / "state" / "admin-token").read_text().strip()
        yield Gateway(server, base, key, token)
    finally:
        server.kill()

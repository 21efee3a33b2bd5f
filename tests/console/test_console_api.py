"""The web console's listener through a real ``llmgw server`` and a real agent: sign-in
and roles, the cookie, cross-site requests refused, actions logged like ``ctl``, the
live feed driven by the control plane's changes, TLS with the server's certificate,
and a non-loopback listen without TLS refused in one line."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.cluster.procs import Server, llmgw, write_server_config
from tests.cluster.test_control_plane_processes import Cluster, cluster
from tests.conftest import Pki
from tests.realparts import needs_server

pytestmark = needs_server

CONSOLE = '[console]\nlisten = "127.0.0.1:0"\ntraffic_step_s = 1\n'


async def console_url(server: Server) -> str:
    m = await server.wait_log(r"web console on (https?://\S+/) \(sign in with the viewer token")
    return m.group(1).rstrip("/")


def tokens(tmp: Path) -> tuple[str, str]:
    """(admin, viewer), as the server created them in its state directory."""
    admin = (tmp / "state" / "admin-token").read_text().strip()
    viewer = (tmp / "state" / "console-viewer-token").read_text().strip()
    return admin, viewer


@asynccontextmanager
async def signed_in(
    url: str, token: str, **kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A client signed in with ``token``, and its CSRF token."""
    async with httpx.AsyncClient(base_url=url, timeout=10, **kw) as client:
        r = await client.post("/api/login", json={"token": token})
        assert r.status_code == 200, r.text
        yield client, r.json()["csrf"]


@asynccontextmanager
async def console_cluster(
    tmp: Path, pki: Pki, extra: str = CONSOLE
) -> AsyncIterator[tuple[Cluster, str]]:
    async with cluster(tmp, pki, replicas=0, server_extra=extra) as c:
        url = await console_url(c.server)
        c.agent("n1")
        await c.server.wait_node("n1", "Ready")
        yield c, url


async def test_viewer_reads_admin_acts_and_cross_site_posts_are_refused(
    tmp_path: Path, pki: Pki
) -> None:
    async with console_cluster(tmp_path, pki) as (c, url):
        admin, viewer = tokens(tmp_path)
        said = (await c.server.ctl("console")).stdout.decode()
        assert f"web console: {url}/" in said, said
        assert str(tmp_path / "state" / "console-viewer-token") in said, said
        async with httpx.AsyncClient(base_url=url, timeout=10) as anon:
            page = await anon.get("/")
            assert page.status_code == 200 and b"<html" in page.content.lower()
            csp = page.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert (await anon.get("/static/console.js")).status_code == 200
            assert (await anon.get("/static/../app.py")).status_code == 404
            refused = await anon.get("/api/nodes")
            assert refused.status_code == 401, refused.text
            assert "sign in" in refused.json()["error"]["message"]
            wrong = await anon.post("/api/login", json={"token": "guess"})
            assert wrong.status_code == 401
            assert "wrong token" in wrong.json()["error"]["message"]
            await c.server.wait_log(
                r"console: a sign-in with a wrong token from 127\.0\.0\.1 \(0 more since last report\)"
            )

        async with signed_in(url, viewer) as (client, csrf):
            r = await client.post("/api/login", json={"token": viewer})
            cookie = r.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
            assert "Secure" not in cookie  # plain HTTP on loopback
            assert r.json()["role"] == "viewer"
            nodes = (await client.get("/api/nodes")).json()["nodes"]
            assert [n["node_id"] for n in nodes] == ["n1"]
            assert (await client.get("/api/models")).status_code == 200
            placement = await client.get("/api/models/tiny/placement")
            assert placement.status_code == 200, placement.text
            acted = await client.post(
                "/api/nodes/n1",
                json={"intent": "cordon"},
                headers={"x-csrf-token": r.json()["csrf"]},
            )
            assert acted.status_code == 403, acted.text
            assert "viewer" in acted.json()["error"]["message"]
            assert (await c.server.nodes())["n1"]["cordoned"] is False
            await c.server.wait_log(
                r"console: a viewer at 127\.0\.0\.1 tried `llmgw ctl cordon n1`: refused"
            )

        async with signed_in(url, admin) as (client, csrf):
            assert (await client.get("/api/session")).json()["role"] == "admin"
            # no CSRF token: what a form on another site would send with the cookie
            forged = await client.post("/api/nodes/n1", json={"intent": "cordon"})
            assert forged.status_code == 403, forged.text
            assert "CSRF" in forged.json()["error"]["message"]
            # the token, but a browser saying the page is another site's
            elsewhere = await client.post(
                "/api/nodes/n1",
                json={"intent": "cordon"},
                headers={"x-csrf-token": csrf, "origin": "https://evil.example"},
            )
            assert elsewhere.status_code == 403, elsewhere.text
            assert (await c.server.nodes())["n1"]["cordoned"] is False
            before = (await client.get("/api/nodes")).json()["nodes"][0]
            assert before["cordoned"] is False  # the view is now kept until a change
            done = await client.post(
                "/api/nodes/n1", json={"intent": "cordon"}, headers={"x-csrf-token": csrf}
            )
            # the change rang the bell: no console is shown the view from before it
            assert (await client.get("/api/nodes")).json()["nodes"][0]["cordoned"] is True
            assert done.status_code == 200, done.text
            assert "cordoned" in done.json()["message"]
            assert (await c.server.nodes())["n1"]["cordoned"] is True
            await c.server.wait_log(r"console: admin at 127\.0\.0\.1 asked: llmgw ctl cordon n1")
            await c.server.wait_log(r"node n1 cordoned: nothing new is placed there")
            out = await client.post("/api/logout", headers={"x-csrf-token": csrf})
            assert out.status_code == 200
            assert (await client.get("/api/session")).json()["role"] == ""
            assert (await client.get("/api/nodes")).status_code == 401


async def test_the_live_feed_says_what_changed_as_it_changes(tmp_path: Path, pki: Pki) -> None:
    async with console_cluster(tmp_path, pki) as (c, url):
        admin, _ = tokens(tmp_path)
        async with (
            signed_in(url, admin) as (client, _),
            client.stream("GET", "/api/events") as feed,
        ):
            assert feed.headers["content-type"] == "text/event-stream"
            lines = feed.aiter_lines()
            assert (await anext(lines)).startswith("retry:")

            async def next_change() -> dict[str, Any]:
                async for line in lines:
                    if line.startswith("data: "):
                        return dict(json.loads(line[6:]))
                raise AssertionError("the feed ended")

            # an action through the admin API (as ctl would) reaches the feed
            await c.server.ctl("cordon", "n1")
            with trio.fail_after(1):
                change = await next_change()
            assert "intent" in change["what"], change
            # a node going silent: its move to Unreachable is a change of "nodes"
            c.agents["n1"].signal_group(signal.SIGSTOP)
            with trio.fail_after(10):
                while "nodes" not in (change := await next_change())["what"]:
                    pass
            nodes = (await client.get("/api/nodes")).json()["nodes"]
            assert nodes[0]["state"] in ("Unreachable", "Lost"), nodes
            # an open feed does not hold the server up
            took = await c.server.stop(signal.SIGTERM)
            assert took < 1.0, f"the server took {took:.2f} s to stop with a feed open"
            assert c.server.returncode() == 0


async def test_tls_with_the_servers_certificate_and_a_secure_cookie(
    tmp_path: Path, pki: Pki
) -> None:
    extra = '[console]\nlisten = "127.0.0.1:0"\ntls = true\n'
    async with console_cluster(tmp_path, pki, extra) as (_, url):
        assert url.startswith("https://127.0.0.1:")
        _, viewer = tokens(tmp_path)
        async with signed_in(url, viewer, verify=ssl.create_default_context(cafile=pki.ca)) as (
            client,
            _,
        ):
            r = await client.post("/api/login", json={"token": viewer})
            assert "Secure" in r.headers["set-cookie"]
            assert (await client.get("/api/nodes")).json()["nodes"][0]["node_id"] == "n1"
        async with httpx.AsyncClient(timeout=5) as plain:  # plain HTTP to the TLS port
            try:
                answer = await plain.get(url.replace("https://", "http://") + "/api/nodes")
            except httpx.HTTPError:
                pass  # closed: nothing served in clear
            else:
                assert answer.status_code != 200


def test_a_console_beyond_loopback_without_tls_is_refused_in_one_line(
    tmp_path: Path, pki: Pki
) -> None:
    config = write_server_config(tmp_path, pki)
    config.write_text(config.read_text() + '[console]\nlisten = "0.0.0.0:0"\n')
    done = subprocess.run(
        llmgw("server", "--config", str(config)), capture_output=True, timeout=30, cwd=tmp_path
    )
    err = done.stderr.decode()
    assert done.returncode != 0, err
    lines = [line for line in err.splitlines() if "console.listen" in line]
    assert len(lines) == 1, err
    assert "console.tls = true" in lines[0] and "not loopback" in lines[0], err

"""The web console in a real headless Chromium against a real server, agents, engine and
router: sign in, every page renders without a console error (a screenshot of each,
checked not blank), a node going Unreachable is on screen within a second of the
server saying so, a drain started from the page completes, a viewer cannot act, and
a forged cross-site POST (a form on another origin, carrying the cookie) is refused."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from tests.cluster.test_control_plane_processes import Cluster
from tests.cluster.test_router_processes import routed
from tests.conftest import Pki
from tests.console.browser import (
    Browser,
    open_browser_async,
    png_is_blank,
    screenshot_dir,
    serve_pages,
)
from tests.console.test_console_api import console_url, tokens
from tests.console.test_console_traffic import chats
from tests.realparts import needs_server

pytestmark = needs_server

CONSOLE = '[console]\nlisten = "127.0.0.1:0"\ntraffic_step_s = 1\n'

# records, in the page, when a node's row first reads a state (the wall clock, ms)
WATCH_STATE = """
const [node, state] = arguments;
window.__seen = null;
const look = () => {
  const cell = document.querySelector(`tr[data-node="${node}"] td.state`);
  if (window.__seen === null && cell && cell.textContent.includes(state)) {
    window.__seen = performance.timeOrigin + performance.now();
  }
};
new MutationObserver(look).observe(document.body,
  {subtree: true, childList: true, characterData: true});
look();
return true;
"""


async def run(b: Browser, method: Any, *args: Any, **kw: Any) -> Any:
    """A blocking browser call, off the trio loop (the server's tests run in it)."""
    return await trio.to_thread.run_sync(partial(method, *args, **kw))


async def shot(b: Browser, name: str) -> Path:
    path = await run(b, b.screenshot, screenshot_dir() / f"console-{name}.png")
    assert not png_is_blank(path), f"{path} is blank"
    return path


async def sign_in(b: Browser, url: str, token: str) -> None:
    await run(b, b.get, url + "/")
    await run(b, b.fill, "input#token", token)
    await run(b, b.click, "button#signin-button")
    await run(b, b.wait_for, 'table#nodes tr[data-node="n1"]')
    await run(b, b.wait_for_text, "#live", "live")


def logged_at(line: str) -> float:
    """The wall clock of a server log line (``2026-12-05 19:46:30,239 LEVEL ...``)."""
    stamp, ms = line[:19], int(line[20:23])
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + ms / 1000


async def test_an_admin_signs_in_sees_every_page_live_and_drains_a_node(
    tmp_path: Path, pki: Pki
) -> None:
    async with console_in_browser(tmp_path, pki) as (c, base, key, url, b):
        admin, _ = tokens(tmp_path)
        await run(b, b.get, url + "/")
        await run(b, b.wait_for, "input#token")
        await shot(b, "signin")
        await sign_in(b, url, admin)
        await run(b, b.wait_for, 'table#models tr[data-model="tiny"]')
        assert await run(b, b.js, "return document.body.dataset.role") == "admin"
        await shot(b, "fleet")
        await run(b, b.assert_no_console_errors)

        # a model's page: its replica, its placement, and no bench run yet
        [replica] = await c.wait_ready(1)
        host = replica["shards"][0]["node_id"]
        other = "n2" if host == "n1" else "n1"
        await run(b, b.get, url + "/#/model/tiny")
        await run(b, b.wait_for, f'table#replicas tr[data-replica="{replica["replica_id"]}"]')
        await run(b, b.wait_for, "section#placement")
        await shot(b, "model")
        await run(b, b.assert_no_console_errors)

        # traffic through the server's router, on the traffic page
        await chats(base, key, 3)
        await run(b, b.get, url + "/#/traffic")
        await run(b, b.wait_for, 'div.traffic-model[data-model="tiny"]', timeout=15)
        await shot(b, "traffic")
        await run(b, b.assert_no_console_errors)

        # a node going silent: on screen within a second of the server's own line
        await run(b, b.get, url + "/#/fleet")
        await run(b, b.wait_for, f'table#nodes tr[data-node="{other}"]')
        await run(b, b.js, WATCH_STATE, other, "Unreachable")
        c.agents[other].signal_group(signal.SIGSTOP)
        m = await c.server.wait_log(
            rf"(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) \w+ \S+ node {other} is Unreachable",
            timeout=15,
        )
        said = logged_at(m.group(1))
        with trio.fail_after(5):
            while (seen := await run(b, b.js, "return window.__seen")) is None:
                await trio.sleep(0.05)
        late = seen / 1000 - said
        assert late <= 1.0, f"on screen {late:.3f} s after the server said it"
        await shot(b, "unreachable")
        c.agents[other].signal_group(signal.SIGCONT)
        await run(b, b.wait_for_text, f'tr[data-node="{other}"] td.state', "Ready", timeout=15)

        # a drain from the page, confirmed, done: the replica moves to the other node
        await run(b, b.click, f'button[data-action="drain"][data-node="{host}"]')
        await run(b, b.wait_for, "dialog#confirm")
        asked = await run(b, b.text, "#confirm-text")
        assert f"llmgw ctl drain {host}" in asked, asked
        await shot(b, "confirm")
        await run(b, b.click, "#confirm-yes")
        await run(b, b.wait_for_text, "#message", "draining")
        await run(b, b.wait_for_text, f'tr[data-node="{host}"] td.intent', "drained", timeout=60)
        await shot(b, "drained")
        log = c.server.log()
        assert re.search(rf"console: admin at 127\.0\.0\.1 asked: llmgw ctl drain {host}", log)
        assert re.search(rf"node {host} drained: nothing runs there", log)
        where = [s["node_id"] for r in await c.replicas() for s in r["shards"]]
        assert where == [other], where
        await run(b, b.assert_no_console_errors)


def forging(target: str) -> dict[str, str]:
    """A page of another site whose form posts, with the browser's cookie, a cordon as
    JSON in a text/plain body (what a form can forge) to ``target``."""
    return {
        "/": f"""<!doctype html><html><head><link rel="icon" href="data:,"></head><body>
<form method="POST" action="{target}" enctype="text/plain">
<input name='{{"intent": "cordon", "x": "' value='"}}'></form>
<script>document.forms[0].submit()</script></body></html>"""
    }


@asynccontextmanager
async def console_in_browser(
    tmp_path: Path, pki: Pki
) -> AsyncIterator[tuple[Cluster, str, str, str, Browser]]:
    """Two nodes, one replica of the tiny model behind the server's router, the console,
    and a browser: (cluster, router base URL, API key, console URL, browser)."""
    async with (
        routed(tmp_path, pki, nodes=2, router_extra=CONSOLE) as (c, base, key),
        open_browser_async() as b,
    ):
        yield c, base, key, await console_url(c.server), b


async def test_a_viewer_cannot_act_and_a_forged_cross_site_post_is_refused(
    tmp_path: Path, pki: Pki
) -> None:
    async with console_in_browser(tmp_path, pki) as (c, _, _, url, b):
        admin, viewer = tokens(tmp_path)
        await sign_in(b, url, viewer)
        assert await run(b, b.js, "return document.body.dataset.role") == "viewer"
        assert await run(b, b.texts, "button[data-action]") == []
        assert await run(b, b.shown, "button#reload") is None
        await shot(b, "viewer")
        # the page's own session, asking anyway: refused by the server
        answer = await run(
            b,
            b.js,
            """return (async () => {
              const s = await (await fetch('/api/session')).json();
              const r = await fetch('/api/nodes/n1', {method: 'POST',
                headers: {'x-csrf-token': s.csrf, 'content-type': 'application/json'},
                body: JSON.stringify({intent: 'cordon'})});
              return [r.status, (await r.json()).error.message];
            })();""",
        )
        assert answer[0] == 403 and "viewer" in answer[1], answer
        # the browser logs the refusal itself, and nothing else went wrong
        errors = await run(b, b.console_errors)
        assert errors and all("403" in e for e in errors), errors

        # many tabs of the console in one browser: a hidden tab lets its live feed go
        # (a browser keeps six connections to one server), the one shown stays live
        for _ in range(7):
            await run(b, b.driver.switch_to.new_window, "tab")
            await run(b, b.get, url + "/#/fleet")
            await run(b, b.wait_for_text, "#live", "live")
        await c.server.ctl("cordon", "n2")
        await run(b, b.wait_for_text, 'tr[data-node="n2"] td.intent', "cordoned", timeout=5)
        await c.server.ctl("uncordon", "n2")
        for handle in (await run(b, lambda: b.driver.window_handles))[1:]:
            await run(b, b.driver.switch_to.window, handle)
            await run(b, b.driver.close)
        await run(b, b.driver.switch_to.window, (await run(b, lambda: b.driver.window_handles))[0])

        # signed in as admin, the browser visits another site that posts to the console
        await run(b, b.get, url + "/")
        await run(b, b.click, "#signout")
        await sign_in(b, url, admin)
        with serve_pages(forging(url + "/api/nodes/n1")) as evil:
            await run(b, b.get, evil + "/")
            text = await run(b, b.wait_for_text, "body", "refused")
        assert "CSRF" in text, text
        assert (await c.server.nodes())["n1"]["cordoned"] is False

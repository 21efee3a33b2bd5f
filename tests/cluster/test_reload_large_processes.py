"""A large catalog through `ctl reload` on a real server: one over the bound is refused
in one line and the old catalog stays; one under it is read off the event loop while
the agents' heartbeats go on being heard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import trio

from tests.cluster.test_control_plane_processes import cluster
from tests.conftest import Pki
from tests.realparts import needs_server
from tools.support.catalogs import catalog_of

pytestmark = needs_server

MAX_CATALOG_BYTES = 4 << 20  # the documented bound (catalog.MAX_CATALOG_BYTES)


async def test_a_catalog_over_the_bound_is_refused_in_one_line_and_the_old_one_stays(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        [replica] = await c.wait_ready(1)
        catalog = tmp_path / "catalog.toml"
        catalog.write_text(catalog.read_text() + catalog_of(MAX_CATALOG_BYTES))
        size = catalog.stat().st_size
        assert size > MAX_CATALOG_BYTES
        done = await c.server.ctl("reload", check=False)
        assert done.returncode != 0
        err = done.stderr.decode().strip()
        assert len(err.splitlines()) == 1, err
        assert (
            f"catalog not reloaded, nothing changed: {catalog}: 4.1 MiB, over the 4 MiB"
            " this file may be" in err
        ), err
        # the old catalog stays, and what runs keeps running
        models = json.loads((await c.server.ctl("models", "--json")).stdout)["models"]
        assert sorted(m["model"] for m in models) == ["huge", "tiny"], models
        [still] = await c.wait_ready(1)
        assert still["replica_id"] == replica["replica_id"]
        await c.server.wait_log(r"catalog not reloaded, nothing changed: .*4\.1 MiB")


async def test_a_large_catalog_is_read_off_the_loop_and_nodes_stay_ready(
    tmp_path: Path, pki: Pki
) -> None:
    async with cluster(tmp_path, pki) as c:
        c.agent("n1")
        c.agent("n2")
        await c.wait_ready(1)
        await c.server.wait_node("n2", "Ready")
        catalog = tmp_path / "catalog.toml"
        catalog.write_text(catalog.read_text() + catalog_of(MAX_CATALOG_BYTES - 200_000))
        assert catalog.stat().st_size <= MAX_CATALOG_BYTES
        with trio.fail_after(60):
            done = await c.server.ctl("reload")
        out = done.stdout.decode()
        m = re.search(r"catalog reloaded from \S+: (\d+) models", out)
        assert m is not None, out
        assert int(m[1]) > 15_000, out
        await trio.sleep(3)  # the passes after it, over every model of the new catalog
        nodes = await c.server.nodes()
        assert {n: v["state"] for n, v in nodes.items()} == {"n1": "Ready", "n2": "Ready"}
        # heartbeats went on being heard: no node ever left Ready
        assert "Unreachable" not in c.server.log(), c.server.log()[-3000:]
        await c.wait_ready(1)

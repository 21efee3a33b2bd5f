"""Versions with real processes: each agent reports its build at registration, and
`ctl nodes` shows a fleet halfway through an upgrade for what it is."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx

import llmgw
from llmgw.version import BUILD_FILE, VERSION
from tests.cluster.procs import Daemon
from tests.cluster.test_discovery_processes import agent, start
from tests.conftest import Pki

NO_GPUS = '[discovery]\nnvidia_smi = "/nonexistent"\n'


async def test_ctl_nodes_shows_each_agents_build_and_warns_about_a_mixed_fleet(
    tmp_path: Path, pki: Pki
) -> None:
    # an older llmgw, as the single file carries it: the package with its _build.txt
    older = tmp_path / "older"
    shutil.copytree(
        Path(llmgw.__file__).parent,
        older / "llmgw",
        ignore=shutil.ignore_patterns("__pycache__", BUILD_FILE),
    )
    (older / "llmgw" / BUILD_FILE).write_text("0ld0ld0ld0ld\n")
    started: list[Daemon] = []
    try:
        server = await start(tmp_path, pki, started)
        n1 = agent(
            tmp_path,
            pki,
            started,
            "n1",
            server.stream_port,
            NO_GPUS + '[metrics]\nlisten = "127.0.0.1:0"\n',
        )
        await server.wait_node("n1", "Ready")
        # every daemon's metrics say which build it runs, carry its process, and no
        # _created series
        m = await n1.wait_log(r"agent metrics on (http://\S+/metrics)")
        async with httpx.AsyncClient(timeout=5) as client:
            pages = {"agent": (await client.get(m.group(1))).text, "server": await server.metrics()}
        for role, page in pages.items():
            info = re.search(rf"^llmgw_build_info\{{(.*role=\"{role}\".*)\}} 1\.0$", page, re.M)
            assert info and f'version="{VERSION}"' in info.group(1), page
            assert re.search(r"^process_cpu_seconds_total \S+$", page, re.M), page
            assert "_created" not in page, page
        out = (await server.ctl("nodes")).stdout.decode()
        assert "mixed versions" not in out, out  # one build everywhere
        agent(
            tmp_path,
            pki,
            started,
            "n2",
            server.stream_port,
            NO_GPUS,
            env={"PYTHONPATH": str(older)},
        )
        await server.wait_node("n2", "Ready")
        await server.wait_log(r"node n2 registered from \S+ \(agent 0\.1\.0 \(build 0ld0ld0ld0ld\)")
        nodes = json.loads((await server.ctl("nodes", "--json")).stdout)
        versions = {n["node_id"]: n["version"] for n in nodes["nodes"]}
        # this checkout's build (read by the server, which started after this test did)
        current = nodes["server_version"]
        assert current.startswith(f"{VERSION} (build ") and "0ld" not in current
        assert versions == {"n1": current, "n2": "0.1.0 (build 0ld0ld0ld0ld)"}
        out = (await server.ctl("nodes")).stdout.decode()
        row = next(line for line in out.splitlines() if line.startswith("n2 "))
        assert "0.1.0+0ld0ld0ld0ld" in row, out
        warning = out.strip().splitlines()[-1]
        assert warning == (
            f"warning: mixed versions: {current} on n1; 0.1.0 (build 0ld0ld0ld0ld) on n2; "
            f"the server runs {current}"
        ), out
    finally:
        for d in started:
            d.kill()

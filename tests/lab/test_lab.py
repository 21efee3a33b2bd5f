"""The lab (``tools/lab``): nodes as network namespaces, each with its own address
and hostname, the control plane in a namespace of its own, a standalone router on
the host. The same code people run; root only, and it fails, never skips, where
namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.realparts import needs_server
from tools.support.lab import Lab, LabError, preflight
from tools.support.procs import alive

ROOT = Path(__file__).resolve().parents[2]


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out or "0"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    try:
        preflight()
    except LabError as e:
        pytest.fail(f"the lab cannot run here: {e}")
    # a name of this run's own: links and namespaces never collide with another run's
    lab = Lab(
        tmp_path_factory.mktemp("lab"), name=_base36(os.getpid())[-5:], nodes=2, small_disk=("n2",)
    )
    try:
        lab.up(timeout=90)
        yield lab
    finally:
        lab.down()  # idempotent: the last test downs it too


def _ctl_nodes(lab: Lab) -> list[dict[str, object]]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw",
            "ctl",
            "nodes",
            "--json",
            "--config",
            str(lab.dir / "server.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    nodes: list[dict[str, object]] = json.loads(out.stdout)["nodes"]
    return nodes


@needs_server
def test_two_nodes_serve_a_chat_completion_through_the_standalone_router(lab: Lab) -> None:
    assert lab.base_url.startswith(f"http://{lab.state['host_ip']}:")  # not loopback
    client = openai.OpenAI(base_url=lab.base_url, api_key=lab.key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content


@needs_server
def test_each_agent_registers_with_its_hostname_and_its_namespace_address(lab: Lab) -> None:
    nodes = {str(n["node_id"]): n for n in _ctl_nodes(lab)}
    assert sorted(nodes) == ["n1", "n2"]
    for node, view in nodes.items():
        assert view["address"] == lab.address(node)
        assert view["address"] != "127.0.0.1"
        assert view["state"] == "Ready"
    assert len({lab.address(n) for n in nodes}) == 2


@needs_server
def test_a_partitioned_node_goes_unreachable_and_comes_back_when_healed(lab: Lab) -> None:
    lab.partition("n2")
    try:
        lab.wait_node("n2", "Unreachable", timeout=15)
        assert lab.node_state("n1") == "Ready"
    finally:
        lab.heal("n2")
    lab.wait_node("n2", "Ready", timeout=30)
    lab.partition("n1", drop=True)  # link up, every packet dropped
    try:
        lab.wait_node("n1", "Unreachable", timeout=15)
    finally:
        lab.heal("n1")
    lab.wait_node("n1", "Ready", timeout=30)


@needs_server
def test_an_agent_killed_and_restarted_registers_again(lab: Lab) -> None:
    old = lab.state["procs"]["n2"]
    assert lab.kill("n2", "9") == [old]
    assert not alive(old)
    lab.wait_node("n2", "Unreachable", timeout=15)
    assert lab.restart("n2") != old
    lab.wait_node("n2", "Ready", timeout=30)
    with pytest.raises(LabError, match="not a signal"):
        lab.kill("n2", "NOPE")


@needs_server
def test_fill_disk_fills_the_small_state_dir_and_free_empties_it(lab: Lab) -> None:
    state_dir = lab.dir / "agent-n2"
    lab.fill_disk("n2")
    assert shutil.disk_usage(state_dir).free < 1 << 20
    lab.fill_disk("n2", free=True)
    assert shutil.disk_usage(state_dir).free > 8 << 20
    with pytest.raises(LabError, match="no small disk"):
        lab.fill_disk("n1")


@needs_server
def test_down_leaves_no_namespace_link_or_process(lab: Lab) -> None:
    pids = list(lab.state["procs"].values())
    pids += [p for node in lab.state["nodes"] for p in lab.engine_pids(node)]
    assert len(pids) >= 5  # control plane, router, two agents, an engine
    namespaces = list(lab.state["namespaces"])
    prefix = f"llmgw-{lab.name}-"
    lab.down()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in namespaces if ns in netns.split()]
    assert prefix not in netns
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert prefix not in links
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    assert f"{lab.state['subnet']}." not in routes
    assert [p for p in pids if alive(p)] == []
    assert str(lab.dir) not in Path("/proc/mounts").read_text()  # the small disk too
    assert json.loads((lab.dir / "lab.json").read_text())["procs"] == {}

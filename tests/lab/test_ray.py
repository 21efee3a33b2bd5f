"""vLLM over Ray through the control plane and agents, in the lab: two nodes, each a
network namespace with its own address and a fake H200 (nvidia-smi's output from a
real node), vLLM and Ray as the suite's stand-ins, which join, wait and die as the
real ones do (``tests/engines/standins``). Root only; it fails, never skips, where
namespaces cannot be made."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.lab.test_lab import _base36
from tools.support.lab import WIDE_MODEL, Lab, LabError, preflight
from tools.support.procs import alive

REPLY = "Hello from the vLLM stand-in."


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    try:
        preflight()
    except LabError as e:
        pytest.fail(f"the lab cannot run here: {e}")
    lab = Lab(tmp_path_factory.mktemp("ray"), name="r" + _base36(os.getpid())[-4:], gpus=True)
    try:
        lab.up(timeout=120)
        yield lab
    finally:
        lab.down()


def _wait(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except (OSError, LabError, KeyError, httpx.HTTPError):
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"gave up after {timeout:g} s waiting for {what}")


def _wide(lab: Lab, state: str = "Ready", *, not_id: str = "") -> dict[str, Any] | None:
    for r in lab.replicas():
        if r["model"] == WIDE_MODEL and r["state"] == state and r["replica_id"] != not_id:
            found: dict[str, Any] = r
            return found
    return None


def _ranks(replica: dict[str, Any]) -> list[str]:
    """The replica's nodes, rank 0 first."""
    return [s["node_id"] for s in sorted(replica["shards"], key=lambda s: s["rank"])]


def _chat(lab: Lab, *, stream: bool) -> str:
    client = openai.OpenAI(base_url=lab.base_url, api_key=lab.key, timeout=10, max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    if not stream:
        reply = client.chat.completions.create(model=WIDE_MODEL, messages=messages)
        return reply.choices[0].message.content or ""
    text = ""
    finish = None
    for chunk in client.chat.completions.create(model=WIDE_MODEL, messages=messages, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", f"the stream ended without its finish_reason: {text!r}"
    return text


def _log(lab: Lab, who: str) -> str:
    return (lab.dir / f"{who}.log").read_text(errors="replace")


def _engine_log(lab: Lab, node: str, shard_id: str) -> str:
    return (lab.dir / f"agent-{node}" / "shards" / f"{shard_id}.log").read_text(errors="replace")


def _held(lab: Lab) -> list[tuple[str, int]]:
    """Every (node, GPU) a live replica's shard holds, once per holder."""
    return [
        (s["node_id"], gpu)
        for r in lab.replicas()
        if r["state"] not in ("Stopping",)
        for s in r["shards"]
        for gpu in s["gpus"]
    ]


def _ray_heads() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "standins/ray.py _serve-head"], capture_output=True)
    return [int(p) for p in out.stdout.split()]


def test_a_model_over_two_nodes_starts_its_head_first_and_serves(lab: Lab) -> None:
    replica = _wait("the model over two nodes to be Ready", lambda: _wide(lab))
    rid = replica["replica_id"]
    head, worker = _ranks(replica)
    assert head != worker
    log = _log(lab, "cp")
    # rank 0 was started alone; rank 1 only once rank 0 ran
    started = [m.group(1) for m in re.finditer(rf"shard ({rid}-\d) is starting", log)]
    assert started[:2] == [f"{rid}-0", f"{rid}-1"], started
    assert f"replica {rid}: rank 0 runs on {head}; starting rank 1 on {worker} to join it" in log
    # the worker joined the head at the head node's reported address, from its own
    joined = f"joined the head at {lab.address(head)}:6390 as {lab.address(worker)}"
    assert joined in _engine_log(lab, worker, f"{rid}-1")
    # rank 0's vLLM served only once every rank had joined (TP 1 x PP 2 = 2 GPUs)
    assert "the Ray cluster has 2 GPUs" in _engine_log(lab, head, f"{rid}-0")
    assert _chat(lab, stream=False) == REPLY
    assert _chat(lab, stream=True) == REPLY
    nodes = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "nodes", "--config", str(lab.dir / "server.toml")],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "vllm stand-in" in nodes and "lab" in nodes  # its engines and its fabric


def test_every_rank_is_adopted_by_restarted_agents_and_control_plane(lab: Lab) -> None:
    replica = _wait("the model to be Ready", lambda: _wide(lab))
    rid = replica["replica_id"]
    head, worker = _ranks(replica)
    pids = {node: lab.engine_pids(node, rid) for node in (head, worker)}
    assert all(pids.values()), pids
    for node in (head, worker):
        lab.kill(node)
    for node in (head, worker):
        lab.restart(node)
    for node in (head, worker):
        lab.wait_node(node, "Ready", timeout=30)
    again = _wait("the same replica Ready again", lambda: _wide(lab))
    assert again["replica_id"] == rid  # adopted, not replaced
    assert {node: lab.engine_pids(node, rid) for node in (head, worker)} == pids
    # adopted as ready, as it was: the replica never went back to Starting (unrouted)
    for rank in (0, 1):
        assert _log(lab, "cp").count(f"shard {rid}-{rank} is starting") == 1
    assert _chat(lab, stream=False) == REPLY
    for node in (head, worker):
        # the Ray head that rank 0 daemonized is its shard's, not an unknown engine
        assert "left running and unmanaged" not in _log(lab, node)
    lab.kill("cp")
    lab.restart("cp")
    again = _wait("the replica adopted by a new control plane", lambda: _wide(lab), timeout=45)
    assert again["replica_id"] == rid
    assert {node: lab.engine_pids(node, rid) for node in (head, worker)} == pids
    assert f"replica {rid} failed" not in _log(lab, "cp")
    assert _chat(lab, stream=True) == REPLY


def test_a_rank_killed_fails_the_replica_stops_every_rank_and_frees_its_gpus(lab: Lab) -> None:
    replica = _wait("the model to be Ready", lambda: _wide(lab))
    rid = replica["replica_id"]
    head, worker = _ranks(replica)
    [head_pid] = lab.engine_pids(head, rid)
    [ray_head] = _ray_heads()
    lab.kill(worker, engine=True, shard=rid)
    new = _wait("a replacement Ready", lambda: _wide(lab, not_id=rid), timeout=60)
    log = _log(lab, "cp")
    # the replica fails for its killed rank, or for its head, which exits as its worker
    # dies: whichever of the two nodes' reports arrives first (the suite saw the head's)
    killed = f"replica {rid} failed: shard {rid}-1 on {worker} failed: engine killed by signal 9"
    head_exit = f"replica {rid} failed: shard {rid}-0 on {head} failed: engine exited"
    assert killed in log or head_exit in log, log[-3000:]
    # rank 0 on the other node was stopped, with the Ray head it daemonized
    assert not alive(head_pid)
    assert not alive(ray_head)
    assert _ray_heads() != [ray_head] and len(_ray_heads()) == 1
    # every GPU is held once: the failed replica's were freed before they were given again
    held = _held(lab)
    assert len(held) == len(set(held)) == 2, held
    assert sorted(held) == sorted((s["node_id"], 0) for s in new["shards"])
    assert _chat(lab, stream=False) == REPLY


def test_a_drain_goes_through_rank_0_and_then_stops_the_workers(lab: Lab) -> None:
    replica = _wait("the model to be Ready", lambda: _wide(lab))
    rid = replica["replica_id"]
    head, worker = _ranks(replica)
    config = ["--config", str(lab.dir / "server.toml")]
    ctl = [sys.executable, "-m", "llmgw", "ctl"]
    subprocess.run([*ctl, "drain", worker, *config], check=True, capture_output=True, timeout=30)
    try:
        # no other pair of nodes can hold it: after the lab's 10 s drain grace it drains
        _wait(
            "the replica to be gone",
            lambda: not any(r["replica_id"] == rid for r in lab.replicas()),
            timeout=60,
        )
        log = _log(lab, "cp")
        order = [
            (m.group(1), m.group(2))
            for m in re.finditer(rf"shard ({rid}-\d) is (draining|stopping|stopped)", log)
        ]
        first_worker = next(i for i, (sid, _) in enumerate(order) if sid == f"{rid}-1")
        assert (f"{rid}-0", "stopped") in order[:first_worker], order  # rank 0 went first
        assert f"replica {rid} failed" not in log  # the worker ending with its head is no failure
        assert not lab.engine_pids(head, rid) and not lab.engine_pids(worker, rid)
        assert _ray_heads() == []
    finally:
        subprocess.run([*ctl, "uncordon", worker, *config], capture_output=True, timeout=30)
    _wait("the model back on both nodes", lambda: _wide(lab), timeout=60)

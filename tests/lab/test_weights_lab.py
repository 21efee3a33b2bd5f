"""Weights across a fabric in the lab, the invariants of ``tools/bench_weights.py``
(not its times): four nodes in namespaces, their links shaped, each with a transfer
listener; the hub stand-in on the lab's bridge. Warmed together they read the hub
once; a node killed mid-fetch and restarted resumes from what it had and the hub
still serves the file once; a damaged copy on a peer is refused by that peer, the
chunk taken from another, and the taker's file is right. Root only; it fails, never
skips, where namespaces cannot be made."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from tests.lab.test_lab import _base36
from tests.realparts import needs_server
from tools import bench_weights

pytestmark = needs_server


def test_a_fabric_reads_the_hub_once_resumes_a_killed_node_and_refuses_a_damaged_copy(
    tmp_path: Path,
) -> None:
    args = argparse.Namespace(
        scenario=["all", "resume", "corrupt"],
        size_mb=12.0,
        hub_mbps=24.0,  # 4 s from the hub: the killed node is caught mid-fetch
        link_mbps=200,
        nodes=4,
        name=_base36(os.getpid())[-5:],
        dir=tmp_path,
    )
    results = {r.scenario: r for r in bench_weights.run(args)}
    assert set(results) == {"all", "resume", "corrupt"}, results
    for r in results.values():
        assert not r.problems, (r.scenario, r.problems, r.notes)
        assert r.hub_bytes == 12 * 2**20, r  # the hub read once, whatever happened
    assert len(results["all"].per_node_s) == 4
    notes = " ".join(results["resume"].notes)
    killed = re.search(r"killed at (\d+)% of the file", notes)
    assert killed and 40 <= int(killed.group(1)) < 100, notes  # caught mid-fetch
    resumed = re.search(r"\(([\d.]+) MiB taken, ([\d.]+) MiB resumed\)", notes)
    assert resumed and float(resumed.group(2)) > 0, notes  # what it had, kept
    assert "n1 refused it: 0" not in " ".join(results["corrupt"].notes)

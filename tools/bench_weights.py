"""Weights across a fabric, measured: eight nodes warmed with one model file, the hub
read once, a node killed mid-fetch, a damaged copy on a peer.

The lab (``tools/support/lab.py``): eight nodes in one network (one fabric), each
node's link limited both ways with ``tc tbf`` (``--link-mbps``), every agent with
a weights transfer listener (``[weights] peer_listen``) and a weights directory of
its own; the hub stand-in (``tools/support/hubstandin.py``) on the lab's bridge,
serving a file of random bytes generated at run time (``--size-mb``) at
``--hub-mbps`` per answer, as a hub's CDN limits one download; huggingface_hub
in every agent pointed at it (``HF_ENDPOINT``). Each scenario uses a file of its
own (the same bytes under another repository), so none finds another's copy.

Scenarios, each through ``ctl weights prefetch`` (the admin API) and timed by
polling ``GET /v1/weights`` every 0.2 s:

- ``one``: one node from the hub: the baseline;
- ``all``: the eight together (a chain: each takes from the one told before it):
  the time until all eight hold it, against ``one``, and the bytes the hub served;
- ``resume``: the eight together, and the fifth node's agent killed (SIGKILL)
  once it holds 40 %, restarted, and told again: it resumes from what it had,
  the node after it goes on from the one before, and the hub serves the file once;
- ``corrupt``: two nodes hold the file (the second took it from the first, so the
  first keeps a manifest of it); a byte in the middle of the first's copy is
  flipped; a third node takes it from them: the first refuses the damaged chunk
  (its listener checks every chunk against its manifest before sending), the
  third takes that chunk from the second, and its file is whole and right.

    .venv/bin/python -m tools.bench_weights            # 256 MB, ~6 minutes
    .venv/bin/python -m tools.bench_weights --quick    # 64 MB, ~2 minutes

Root only (the lab makes namespaces and shapes links). Every wait is bounded;
the lab is torn down, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tools.support.hubstandin import HubStandIn
from tools.support.lab import Lab, LabError, preflight
from tools.support.procs import interrupt_on_sigterm

NODES = 8
REPO = "acme/bench-{}-GGUF"
FILE = "model.gguf"
SCENARIOS = ("one", "all", "resume", "corrupt")


@dataclass
class Result:
    scenario: str
    size_mb: float
    seconds: float | None = None  # until every node asked holds the file
    per_node_s: dict[str, float] = field(default_factory=dict)
    hub_bytes: int = 0  # the hub served, of this scenario's file
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def catalog(size: int) -> str:
    out = ""
    for name in SCENARIOS:
        out += f"""
[models.bench-{name}]
replicas = 0
[[models.bench-{name}.profiles]]
name = "cpu"
engine = "llama.cpp"
min_memory_gb = 1
source = "hf://{REPO.format(name)}/{FILE}"
fetch_stall_s = 60
"""
    return out


class Fleet:
    """The lab's admin API, for this benchmark."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.http = httpx.Client(
            base_url=lab.admin_url,
            headers={"authorization": f"Bearer {lab.admin_token()}"},
            timeout=10,
        )

    def prefetch(self, name: str, nodes: Sequence[str] = ()) -> dict[str, Any]:
        r = self.http.post(f"/v1/models/bench-{name}/prefetch", json={"nodes": list(nodes)})
        if r.status_code != 200:
            raise LabError(f"prefetch bench-{name}: {r.status_code} {r.text}")
        answer: dict[str, Any] = r.json()
        return answer

    def weights(self) -> list[dict[str, Any]]:
        nodes: list[dict[str, Any]] = self.http.get("/v1/weights").json()["nodes"]
        return nodes

    def holders(self, name: str) -> set[str]:
        source = f"hf://{REPO.format(name)}/{FILE}"
        return {
            n["node_id"] for n in self.weights() for c in n["copies"] if c.get("source") == source
        }

    def progress(self, name: str, node: str) -> float:
        """How much of the file ``node`` has, as its heartbeats say (0 to 1)."""
        source = f"hf://{REPO.format(name)}/{FILE}"
        for n in self.weights():
            if n["node_id"] != node:
                continue
            for f in n["fetching"]:
                if f["source"] == source and f.get("total_bytes"):
                    return float(f.get("done_bytes", 0)) / float(f["total_bytes"])
        return 0.0

    def wait_held(
        self, name: str, nodes: Sequence[str], since: float, timeout: float
    ) -> dict[str, float]:
        """Seconds from ``since`` until each of ``nodes`` held the file (those that did)."""
        held: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(held) < len(nodes):
            now = time.monotonic()
            for node in self.holders(name):
                if node in nodes and node not in held:
                    held[node] = round(now - since, 2)
            time.sleep(0.2)
        return held


def shape(lab: Lab, mbit: int) -> None:
    """Each node's link limited to ``mbit`` each way (tbf on both ends of its veth)."""
    for node, entry in lab.state["nodes"].items():
        rate = f"{mbit}mbit"
        for argv in (
            ["tc", "qdisc", "replace", "dev", entry["veth"], "root"],
            ["ip", "netns", "exec", entry["ns"], "tc", "qdisc", "replace", "dev", "eth0", "root"],
        ):
            r = subprocess.run(
                [*argv, "tbf", "rate", rate, "burst", "256kbit", "latency", "100ms"],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                raise LabError(f"cannot limit {node}'s link: {r.stderr.strip()}")


def landed(lab: Lab, node: str, name: str) -> Path:
    return lab.dir / f"weights-{node}" / "hf" / REPO.format(name) / "main" / FILE


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def hub_bytes(hub: HubStandIn, name: str) -> int:
    return sum(r.sent for r in hub.gets(REPO.format(name)))


def run(args: argparse.Namespace) -> list[Result]:
    size = int(args.size_mb * 2**20)
    work = args.dir.resolve()
    # what an earlier run left (its weights, a .part of a run cut short) is not this one's
    shutil.rmtree(work / "lab", ignore_errors=True)
    hub_root = work / "hub"
    first = hub_root / REPO.format(SCENARIOS[0]) / FILE
    first.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    with first.open("wb") as f:
        for at in range(0, size, 1 << 20):
            f.write(rng.randbytes(min(1 << 20, size - at)))
    digest = sha256_of(first)
    for name in SCENARIOS[1:]:  # the same bytes under another name: no scenario finds another's
        path = hub_root / REPO.format(name) / FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(first, path)
    hubs: list[HubStandIn] = []

    def start_hub(lab: Lab) -> None:
        hub = HubStandIn(hub_root, host=lab.state["host_ip"])
        hub.rate = int(args.hub_mbps * 1e6 / 8)
        hubs.append(hub)
        lab.agent_env.update({"HF_ENDPOINT": hub.url, "HF_HOME": str(work / "hf-home")})
        shape(lab, args.link_mbps)

    lab = Lab(
        work / "lab",
        name=args.name or f"bw{os.getpid() % 1000}",
        nodes=args.nodes,
        agent_config=('[weights]\ndefault_dir = "weights-{node}"\npeer_listen = "0.0.0.0:7445"\n'),
        agent_env={"HF_TOKEN": ""},
        extra_catalog=catalog(size),
        before_start=start_hub,
    )
    results: list[Result] = []
    nodes = [f"n{i}" for i in range(1, args.nodes + 1)]
    bound = 10 * size / (args.hub_mbps * 1e6 / 8) + 60  # a whole run at a tenth the rate
    try:
        lab.up(timeout=180)
        fleet = Fleet(lab)
        hub = hubs[0]

        def say(what: str) -> None:
            print(f"  {what}", file=sys.stderr, flush=True)

        for name in args.scenario or SCENARIOS:
            r = Result(name, args.size_mb)
            results.append(r)
            say(f"{name} ...")
            if name == "one":
                t0 = time.monotonic()
                fleet.prefetch(name, ["n1"])
                r.per_node_s = fleet.wait_held(name, ["n1"], t0, bound)
            elif name == "all":
                t0 = time.monotonic()
                fleet.prefetch(name)
                r.per_node_s = fleet.wait_held(name, nodes, t0, bound)
            elif name == "resume":
                t0 = time.monotonic()
                fleet.prefetch(name)
                victim = nodes[len(nodes) // 2]  # n5 of eight: nodes before it and after
                deadline = time.monotonic() + bound
                while fleet.progress(name, victim) < 0.4 and time.monotonic() < deadline:
                    time.sleep(0.1)
                had = fleet.progress(name, victim)
                lab.kill(victim, "KILL")
                r.notes.append(f"{victim}'s agent killed at {had:.0%} of the file")
                lab.restart(victim)
                lab.wait_node(victim, "Ready", timeout=30)
                fleet.prefetch(name, [victim])  # told again, as an operator would
                r.per_node_s = fleet.wait_held(name, nodes, t0, bound)
                log = (lab.dir / f"{victim}.log").read_text(errors="replace")
                resumed = [line for line in log.splitlines() if "resumed)" in line]
                if resumed:
                    r.notes.append(f"{victim}: {resumed[-1].split(': ', 1)[-1][-60:]}")
            elif name == "corrupt":
                t0 = time.monotonic()
                fleet.prefetch(name, ["n1", "n2"])
                fleet.wait_held(name, ["n1", "n2"], t0, bound)
                damaged = landed(lab, "n1", name)
                with damaged.open("r+b") as f:  # one byte in the middle, flipped
                    f.seek(size // 2)
                    byte = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([byte[0] ^ 0xFF]))
                r.notes.append("a byte of n1's copy flipped")
                before = hub_bytes(hub, name)
                t0 = time.monotonic()
                fleet.prefetch(name, ["n3"])
                r.per_node_s = fleet.wait_held(name, ["n3"], t0, bound)
                if hub_bytes(hub, name) != before:
                    r.problems.append("n3 went to the hub for some of it")
                n1_log = (lab.dir / "n1.log").read_text(errors="replace")
                refused = [line for line in n1_log.splitlines() if "damaged" in line.lower()]
                r.notes.append(f"n1 refused it: {len(refused)} log line(s)")
                if not refused:
                    r.problems.append("n1 said nothing of its damaged copy")
            asked = ["n1"] if name == "one" else ["n3"] if name == "corrupt" else nodes
            missing = [n for n in asked if n not in r.per_node_s]
            if missing:
                r.problems.append(f"not held in {bound:.0f} s: {', '.join(missing)}")
            else:
                r.seconds = max(r.per_node_s.values())
            r.hub_bytes = hub_bytes(hub, name)
            for node in r.per_node_s:
                got = landed(lab, node, name)
                if sha256_of(got) != digest:
                    r.problems.append(f"{node}'s copy is not the file")
            if r.hub_bytes != size:
                r.problems.append(f"the hub served {r.hub_bytes} bytes, not {size}")
            say(f"{name}: {r.seconds} s, hub {r.hub_bytes / size:.2f}x the file")
    except LabError as e:
        results.append(Result("lab", args.size_mb, problems=[str(e)]))
    finally:
        lab.down()
        for hub in hubs:
            hub.close()
    return results


def table(results: list[Result]) -> str:
    one = next((r.seconds for r in results if r.scenario == "one"), None)
    lines = [f"{'scenario':<10}{'seconds':>9}{'vs one':>8}{'hub/file':>10}  notes"]
    for r in results:
        ratio = f"{r.seconds / one:.2f}x" if r.seconds and one else "-"
        secs = f"{r.seconds:.1f}" if r.seconds is not None else "-"
        hub = f"{r.hub_bytes / (r.size_mb * 2**20):.2f}x"
        notes = "; ".join(r.notes + [f"PROBLEM: {p}" for p in r.problems])
        lines.append(f"{r.scenario:<10}{secs:>9}{ratio:>8}{hub:>10}  {notes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/bench_weights.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--scenario", action="append", choices=SCENARIOS, default=[])
    ap.add_argument("--size-mb", type=float, default=256.0, help="the model file (256)")
    ap.add_argument("--hub-mbps", type=float, default=32.0, help="the hub, per answer (32)")
    ap.add_argument("--link-mbps", type=int, default=200, help="each node's link (200)")
    ap.add_argument("--quick", action="store_true", help="a 64 MB file")
    ap.add_argument("--nodes", type=int, default=NODES, help="in the fabric (8)")
    ap.add_argument("--name", default="", help="the lab's name (links are named by it)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/llmgw-bench-weights"))
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb = 64.0
    try:
        preflight()
    except LabError as e:
        print(f"bench_weights: {e}", file=sys.stderr)
        return 1
    args.dir.mkdir(parents=True, exist_ok=True)
    results = run(args)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(
            f"{args.nodes} nodes, one fabric; file {args.size_mb:g} MiB; hub {args.hub_mbps:g} "
            f"Mbit/s per answer; links {args.link_mbps} Mbit/s each way"
        )
        print(table(results))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())

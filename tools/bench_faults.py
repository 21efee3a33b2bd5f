"""Faults, measured: what each fault costs the traffic, and how long until the fleet
is whole again.

Each scenario builds a lab of its own (``tools/support/lab.py``: nodes as network
namespaces, the control plane in its own, a standalone ``llmgw router`` on the
host, the tiny model served by a real llama-server), starts a few client
threads that send chat completions through the router, streamed and not, one
after another, injects one fault, repairs it, and stops the traffic once the
fleet is whole again (or a bound passes). Per scenario it reports:

- ``sent``, ``failed``: requests, and those that did not end well (an error
  status, a transport error, a timeout, or a cut stream);
- ``cut``: streams that answered 200 but did not end with a finish_reason and
  ``[DONE]``;
- ``whole_s``: seconds from the repair (heal, restart, SIGCONT; for a kill the
  agent or the control plane repairs, so from the kill) until the fleet is whole:
  every node Ready, every model at its wanted count of Ready replicas, nothing
  Pending, Starting, Draining, Stopping or Failed left;
- per scenario, what else it is about (see each one's ``notes``).

Scenarios: ``partition`` (the node that runs the replica, 30 s, then healed;
lost after 10 s, so it is replaced elsewhere; after the reconnect, how long the
model has more Ready replicas, and more engines running, than wanted, and whether
two live replicas ever hold one node's port or GPU), ``kill-cp``, ``kill-agent``,
``kill-engine`` (kill -9, then restart), ``stop-engine`` (SIGSTOP for 20 s, then
SIGCONT), ``full-disk`` (the agent's state dir full; what the agent says),
``netem`` (200 ms and 5 % loss on the agent's link: no node may flap).
``partition-gpus``: ``partition`` in a lab of three nodes with fake GPUs and a model
over two of them (vLLM on Ray, the suite's stand-ins), where a GPU could be held twice.

    .venv/bin/python -m tools.bench_faults                       # all, ~6 minutes
    .venv/bin/python -m tools.bench_faults --scenario kill-cp --json

Root only (the lab makes namespaces). Every wait is bounded; each lab is torn
down, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tools.support.faults import (
    MODEL,
    Outcome,
    Traffic,
    double_held,
    not_whole,
    one_request,
    orphans,
    replica_node,
    tiny_engines,
    wait_whole,
)
from tools.support.lab import Lab, LabError, preflight
from tools.support.procs import interrupt_on_sigterm

# -- scenarios --------------------------------------------------------------------


@dataclass
class Result:
    scenario: str
    sent: int = 0
    failed: int = 0
    cut: int = 0
    whole_s: float | None = None
    skipped: str = ""
    failures: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def count(self, outcomes: list[Outcome]) -> None:
        self.sent = len(outcomes)
        self.failed = sum(not o.ok for o in outcomes)
        self.cut = sum(o.cut for o in outcomes)
        for o in outcomes:
            if not o.ok:
                self.failures[o.why] = self.failures.get(o.why, 0) + 1


WHOLE_WITHIN = 120.0


def _run_lab(
    scenario: str,
    body: Callable[[Lab, Traffic, Result], float],
    *,
    workdir: Path,
    nodes: int = 2,
    lost_after_s: float = 30.0,
    small_disk: tuple[str, ...] = (),
    clients: int = 3,
    gpus: bool = False,
) -> Result:
    """Up a lab, let traffic go, run ``body`` (it injects and repairs the fault and
    returns when the repair was done, monotonic), wait for the fleet to be whole,
    stop the traffic, check what is left, and tear down."""
    result = Result(scenario)
    name = f"bf{os.getpid() % 1000}"  # this run's own: links never collide with another's
    lab = Lab(
        workdir / scenario,
        name=name,
        nodes=nodes,
        lost_after_s=lost_after_s,
        small_disk=small_disk,
        gpus=gpus,
    )
    try:
        lab.up(timeout=120)
        if wait_whole(lab, 60) is None:
            raise LabError(f"the fleet is not whole before the fault: {not_whole(lab)}")
        with Traffic(lab, clients=clients) as traffic:
            time.sleep(2)  # traffic going before the fault
            repaired = body(lab, traffic, result)
            if result.whole_s is None:  # unless the scenario measured it while it watched
                whole = wait_whole(lab, WHOLE_WITHIN)
                if whole is None:
                    why = not_whole(lab)
                    result.problems.append(f"not whole {WHOLE_WITHIN:g} s on: {why}")
                else:
                    result.whole_s = max(0.0, time.monotonic() - repaired)
            time.sleep(2)  # traffic on a whole fleet, after
        result.count(traffic.snapshot())
        result.problems += [f"orphan: {o}" for o in orphans(lab)]
        result.problems += [f"held twice: {d}" for d in double_held(lab.replicas())]
    except LabError as e:
        result.problems.append(f"lab: {e}")
    finally:
        lab.down()
    return result


def partition(lab: Lab, traffic: Traffic, result: Result) -> float:
    """Partition the replica's node for 30 s; it goes Unreachable, then Lost, and the
    replica is replaced elsewhere. Heal; watch the surplus after the reconnect."""
    node = replica_node(lab)
    result.notes["node"] = node
    heartbeat = lab.liveness[0]
    t0 = time.monotonic()
    lab.partition(node)
    seen: dict[str, float] = {}
    twice: set[str] = set()
    while time.monotonic() - t0 < 30:
        state = lab.node_state(node)
        if state and state not in seen:
            seen[state] = time.monotonic() - t0
        with contextlib.suppress(httpx.HTTPError, OSError):
            twice.update(double_held(lab.replicas()))
        time.sleep(0.1)
    result.notes["unreachable_after_s"] = _r(seen.get("Unreachable"))
    result.notes["lost_after_s"] = _r(seen.get("Lost"))
    try:
        elsewhere = [
            r["shards"][0]["node_id"]
            for r in lab.replicas()
            if r["model"] == MODEL and r["state"] == "Ready"
        ]
    except (httpx.HTTPError, OSError):
        elsewhere = []
    result.notes["replaced_on"] = ",".join(n for n in elsewhere if n != node) or "-"
    lab.heal(node)
    healed = time.monotonic()
    # after the reconnect: how long more Ready replicas, and more engines, than wanted
    reconnect: float | None = None
    surplus_ready = surplus_engines = 0.0
    last = time.monotonic()
    wanted = 1
    while time.monotonic() - healed < 30:
        now = time.monotonic()
        try:
            if reconnect is None and lab.node_state(node) == "Ready":
                reconnect = now
            replicas = lab.replicas()
        except (httpx.HTTPError, OSError):
            replicas = []
        twice.update(double_held(replicas))
        if reconnect is not None:
            ready = sum(
                r["model"] == MODEL and r["state"] == "Ready" and not r["leaving"] for r in replicas
            )
            since = max(last, reconnect)  # what was before the reconnect does not count
            if ready > wanted:
                surplus_ready += now - since
            if tiny_engines(lab) > wanted:
                surplus_engines += now - since
            if not not_whole(lab):
                if result.whole_s is None:
                    result.whole_s = now - healed
                if now - reconnect > 10:
                    break
        last = now
        time.sleep(0.05)
    result.notes["reconnect_s"] = _r(None if reconnect is None else reconnect - healed)
    result.notes["surplus_ready_s"] = round(surplus_ready, 2)
    result.notes["surplus_engines_s"] = round(surplus_engines, 2)
    result.notes["heartbeat_s"] = heartbeat
    adopted = [r["replica_id"] for r in lab.replicas() if r["adopted"]]
    result.notes["adopted"] = ",".join(adopted) or "-"
    if reconnect is None:
        result.problems.append(f"{node} did not come back within 30 s of the heal")
    if surplus_ready > heartbeat:
        result.problems.append(
            f"{MODEL} had more Ready replicas than wanted for {surplus_ready:.2f} s"
            f" after the reconnect (at most one heartbeat, {heartbeat:g} s)"
        )
    result.problems += [f"held twice: {d}" for d in sorted(twice)]
    return healed


def kill_restart(who: str) -> Callable[[Lab, Traffic, Result], float]:
    def body(lab: Lab, traffic: Traffic, result: Result) -> float:
        target = replica_node(lab) if who == "agent" else who
        result.notes["killed"] = target
        lab.kill(target, "KILL")
        time.sleep(2)  # down for a while: the traffic meets it
        lab.restart(target)
        return time.monotonic()

    return body


def kill_engine(lab: Lab, traffic: Traffic, result: Result) -> float:
    node = replica_node(lab)
    result.notes["node"] = node
    old = next(r["replica_id"] for r in lab.replicas() if r["model"] == MODEL)
    pids = lab.kill(node, "KILL", engine=True, shard=MODEL)
    killed = time.monotonic()
    result.notes["killed"] = ",".join(map(str, pids))
    # whole again means whole with another replica: wait until the old one is not Ready
    while time.monotonic() - killed < 15:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if not any(r["replica_id"] == old and r["state"] == "Ready" for r in lab.replicas()):
                result.notes["noticed_s"] = _r(time.monotonic() - killed)
                break
        time.sleep(0.02)
    else:
        result.problems.append(f"{old} still Ready 15 s after its engine was killed")
    return killed  # the agent and the control plane repair it


def stop_engine(lab: Lab, traffic: Traffic, result: Result) -> float:
    node = replica_node(lab)
    result.notes["node"] = node
    replica = next(r["replica_id"] for r in lab.replicas() if r["model"] == MODEL)
    pids = lab.kill(node, "STOP", engine=True, shard=MODEL)
    try:
        time.sleep(20)
        after = {r["replica_id"]: r for r in lab.replicas()}
        was = after.get(replica)
        result.notes["after_20s"] = (
            "gone" if was is None else f"{was['state']}{'' if was['healthy'] else ', unhealthy'}"
        )
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    return time.monotonic()


def full_disk(lab: Lab, traffic: Traffic, result: Result) -> float:
    node = "n2"
    log = lab.dir / f"{node}.log"
    before = log.stat().st_size if log.exists() else 0
    lab.fill_disk(node)
    time.sleep(10)
    # what it says: in its log, and to the control plane
    said = log.read_bytes()[before:].decode(errors="replace") if log.exists() else ""
    lines = [
        ln
        for ln in said.splitlines()
        if re.search(r"space|disk|ENOSPC|full|No space", ln, re.IGNORECASE)
    ]
    result.notes["agent_said"] = lines[0][:160] if lines else "nothing"
    result.notes["agent_said_lines"] = len(lines)
    view = next((n for n in lab.nodes() if n["node_id"] == node), {})
    result.notes["node_state"] = view.get("state", "?")
    result.notes["reported"] = "; ".join(view.get("problems", [])) or "nothing"
    served = _direct_ok(lab)
    result.notes["served_while_full"] = served
    if not lines:
        result.problems.append(f"{node}'s agent said nothing of its full state dir in 10 s")
    if not view.get("problems"):
        result.problems.append(f"{node}'s agent told the control plane nothing in 10 s")
    lab.fill_disk(node, free=True)
    return time.monotonic()


def _direct_ok(lab: Lab) -> str:
    """Ten requests through the router now: how many ended well."""
    headers = {"authorization": f"Bearer {lab.key}"}
    with httpx.Client(base_url=lab.base_url, headers=headers, timeout=30) as c:
        ok = sum(one_request(c, stream=i % 2 == 1).ok for i in range(10))
    return f"{ok}/10"


def netem(lab: Lab, traffic: Traffic, result: Result) -> float:
    node = replica_node(lab)
    result.notes["node"] = node
    try:
        lab.netem(node, delay="200ms", loss="5%")
    except LabError as e:
        if "netem" not in str(e):
            raise
        result.skipped = "no netem"  # this kernel has none, and the lab no replacement
        return time.monotonic()
    flaps = 0
    last = "Ready"
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 30:
            state = lab.node_state(node) or last
            if state != last:
                flaps += 1
                last = state
            time.sleep(0.1)
    finally:
        lab.heal(node)
    result.notes["state_changes"] = flaps
    if flaps:
        result.problems.append(f"{node} changed state {flaps} times under 200 ms and 5 % loss")
    return time.monotonic()


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


SCENARIOS: dict[str, tuple[Callable[[Lab, Traffic, Result], float], dict[str, Any]]] = {
    "partition": (partition, {"lost_after_s": 10.0}),
    # the same with fake GPUs and a model over two nodes (vLLM on Ray, stand-ins): no
    # GPU is held twice through the loss, the replacement and the reconnect
    "partition-gpus": (partition, {"lost_after_s": 10.0, "gpus": True, "nodes": 3}),
    "kill-cp": (kill_restart("cp"), {}),
    "kill-agent": (kill_restart("agent"), {}),
    "kill-engine": (kill_engine, {}),
    "stop-engine": (stop_engine, {}),
    "full-disk": (full_disk, {"small_disk": ("n2",)}),
    "netem": (netem, {}),
}


def run(scenario: str, workdir: Path) -> Result:
    body, options = SCENARIOS[scenario]
    return _run_lab(scenario, body, workdir=workdir, **options)


# -- the report -------------------------------------------------------------------


def table(results: list[Result]) -> str:
    head = f"{'scenario':12} {'sent':>6} {'failed':>7} {'cut':>4} {'whole_s':>8}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.skipped:
            lines.append(
                f"{r.scenario:12} {'-':>6} {'-':>7} {'-':>4} {'-':>8}  skipped: {r.skipped}"
            )
            continue
        whole = "never" if r.whole_s is None else f"{r.whole_s:.1f}"
        notes = " ".join(f"{k}={v}" for k, v in r.notes.items())
        lines.append(f"{r.scenario:12} {r.sent:>6} {r.failed:>7} {r.cut:>4} {whole:>8}  {notes}")
        if r.failures:
            why = ", ".join(f"{k}: {v}" for k, v in sorted(r.failures.items()))
            lines.append(f"{'':12} failures by kind: {why}")
        for p in r.problems:
            lines.append(f"{'':12} PROBLEM: {p}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/bench_faults.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS), default=[])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/llmgw-bench-faults"))
    args = ap.parse_args(argv)
    try:
        preflight()
    except LabError as e:
        print(f"bench_faults: {e}", file=sys.stderr)
        return 1
    args.dir.mkdir(parents=True, exist_ok=True)
    results = []
    for scenario in args.scenario or list(SCENARIOS):
        if not args.json:
            print(f"{scenario} ...", file=sys.stderr, flush=True)
        results.append(run(scenario, args.dir.resolve()))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(table(results))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())

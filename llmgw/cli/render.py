"""What ``ctl`` prints of the management API's views: tables for people, the API's
own JSON for scripts.

Each renderer is a pure function of a typed view (``llmgw.admin.views``, or the
control plane's ``FleetStatus``) and, where an age is shown, of an explicit
``now``: it reads no clock and no network, so a test hands it a view and reads
the words an operator would. ``emit`` picks between the two outputs: with
``--json`` the body exactly as the API sent it (one line; scripts read it, and
a field this ``ctl`` does not know still reaches them), else the renderer's
table.

What the columns say is part of the behaviour: a replica's STATE carries its
health, verification, rollout and why it leaves; problems follow a table, one
line each, with the engine's last lines indented under a failure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from llmgw.admin.views import (
    ConsoleInfo,
    FailureView,
    ModelView,
    NodeView,
    PlacementView,
    ReloadAnswer,
    ReplicaView,
)
from llmgw.cli.admin_client import Answer
from llmgw.controlplane import moves
from llmgw.controlplane.fabrics import FleetStatus, describe_copies
from llmgw.routing import TrafficView
from llmgw.weights.progress import fetching_words, progress_words

T = TypeVar("T")


def emit(answer: Answer[T], as_json: bool, render: Callable[[T], str]) -> None:
    """Print ``answer``: its JSON as the API sent it, or ``render`` of its view."""
    if as_json:
        sys.stdout.write(answer.body.decode() + "\n")
    else:
        print(render(answer.view))


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _ago(wall: float, now: float) -> str:
    s = max(0.0, now - wall)
    if s < 60:
        return f"{s:.0f}s ago"
    if s < 3600:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def _age(seconds: float) -> str:
    return _ago(0.0, seconds)


# --- nodes, status -------------------------------------------------------------------


def _mem(total: int | None) -> str:
    if total is None:
        return "-"
    return f"{total / 2**30:.1f}".removesuffix(".0") + " GiB"


def _gpus(node: NodeView) -> str:
    if not node.gpus:
        return "0"
    bad = [g for g in node.gpus if not g.healthy]
    if not bad:
        return str(len(node.gpus))
    why = "; ".join(f"GPU {g.index}: {', '.join(g.problems) or 'unhealthy'}" for g in bad)
    return f"{len(node.gpus)} ({len(bad)} unhealthy: {why})"


def _state(node: NodeView) -> str:
    if node.drained:
        return f"{node.state},Drained"
    if node.draining:
        return f"{node.state},draining"
    if node.cordoned:
        return f"{node.state},cordoned"
    if node.awaited:
        return f"{node.state},awaited"  # known from before a restart, not back yet
    return node.state


def _engines(node: NodeView) -> str:
    return ",".join(f"{k} {v}".strip() for k, v in sorted(node.engines.items())) or "-"


def render_nodes(nodes: list[NodeView], now: float, server_version: str = "") -> str:
    rows = [
        [
            "NODE",
            "ADDRESS",
            "STATE",
            "SHARDS",
            "LAST SEEN",
            "VERSION",
            "MEM",
            "FABRIC",
            "ENGINES",
            "GPUS",
        ]
    ]
    for n in nodes:
        rows.append(
            [
                n.node_id,
                n.address or "-",
                _state(n),
                str(n.shards),
                _ago(n.last_seen, now),
                _short_version(n.version),
                _mem(n.memory_total_bytes),
                n.fabric or "-",
                _engines(n),
                _gpus(n),
            ]
        )
    lines = [table(rows)]
    problems = [f"{n.node_id}: {p}" for n in nodes for p in n.problems]
    if problems:
        lines.append("")
        lines.extend(f"warning: {p}" for p in problems)
    versions: dict[str, list[str]] = {}
    for n in nodes:
        if not n.awaited:  # not back since the control plane started: nothing said yet
            versions.setdefault(n.version or "unknown", []).append(n.node_id)
    if len(versions) > 1 or (server_version and versions and server_version not in versions):
        lines.append("")
        lines.append(
            "warning: mixed versions: "
            + "; ".join(f"{v} on {', '.join(ids)}" for v, ids in versions.items())
            + (f"; the server runs {server_version}" if server_version else "")
        )
    return "\n".join(lines)


def _short_version(version: str) -> str:
    """``0.1.0 (build 1a2b3c4d5e6f)`` as ``0.1.0+1a2b3c4d5e6f``, to fit a column."""
    if not version:
        return "-"
    number, _, build = version.partition(" (build ")
    return f"{number}+{build.rstrip(')')}" if build else number


def render_status(status: FleetStatus) -> str:
    rows = [["FABRIC", "NODES", "MODEL", "HELD ON"]]
    for f in status.fabrics:
        name = f.fabric or "(no fabric)"
        if not f.models:
            rows.append([name, str(len(f.nodes)), "-", "no weights found"])
        for i, m in enumerate(f.models):
            first = i == 0
            rows.append(
                [
                    name if first else "",
                    str(len(f.nodes)) if first else "",
                    m.model,
                    describe_copies(m),
                ]
            )
    lines = [table(rows)]
    if status.cannot_place:
        lines.append("")
        lines.extend(f"cannot place {c.model}: {c.why}" for c in status.cannot_place)
    if status.warnings:
        lines.append("")
        lines.extend(f"warning: {w}" for w in status.warnings)
    if status.nodes_not_scanning:
        lines.append("")
        lines.append(
            "not looking for weights (no weights dirs configured, no default dir): "
            + ", ".join(status.nodes_not_scanning)
        )
    return "\n".join(lines)


# --- replicas ------------------------------------------------------------------------


def render_traffic(t: TrafficView | None) -> str:
    """The router's view of a replica, in a few words ("-": no router here)."""
    if t is None:
        return "-"
    words = [f"{t.in_flight} in flight"]
    if t.wedged:
        words.append(f"WEDGED: {t.wedged}")
    if t.breaker != "closed":
        words.append(f"breaker {t.breaker}")
    if t.load_age_s is None:
        words.append("no engine gauges yet")
    else:
        said = (("waiting", t.waiting), ("running", t.running))
        gauges = [f"{v:g} {k}" for k, v in said if v is not None]
        if t.kv_usage is not None:
            gauges.append(f"kv {t.kv_usage:.0%}")
        words.extend(gauges)
        if t.load_age_s > 5:
            words.append(f"gauges {t.load_age_s:.0f}s old")
    if t.cache_hit_rate is not None:
        cached = f"cache hits {t.cache_hit_rate:.0%}"
        if t.estimated_hit_rate is not None:
            cached += f" (router estimated {t.estimated_hit_rate:.0%})"
        words.append(cached)
    if t.cached_blocks:
        words.append(f"{t.cached_blocks} prompt blocks held, as the router believes")
    if t.affinity_overruled is not None:
        words.append(f"affinity overruled by load {t.affinity_overruled:.0%}")
    if t.prefill_ms_per_token is not None and t.slot_s is not None:
        words.append(f"prefill {t.prefill_ms_per_token:.3g} ms/token, slot {t.slot_s:.3g} s")
    if t.prompt_waits:
        words.append(f"{t.prompt_waits} waited for a slot holding their prompt")
    return ", ".join(words)


def render_replicas(replicas: list[ReplicaView]) -> str:
    routed = any(r.traffic is not None for r in replicas)
    rows = [["REPLICA", "MODEL", "PROFILE", "STATE", "FOR", "SHARDS", *(["TRAFFIC"] * routed)]]
    problems: list[str] = []
    for r in replicas:
        shards = ", ".join(
            f"{s.node_id}:{s.port}{'/gpu' + ','.join(map(str, s.gpus)) if s.gpus else ''} {s.state}"
            for s in r.shards
        )
        state = r.state + (",unhealthy" if not r.healthy else "")
        state += ",unverified" if not r.verified else ""
        state += ",outdated" if r.outdated else ""
        if r.leaving and r.state not in ("Draining", "Failed", "Stopping"):
            why = moves.words(r.leaving_why)
            state += f" (leaving{': ' + why if why else ''})"
        rows.append(
            [
                r.replica_id,
                r.model,
                r.profile,
                state,
                f"{r.state_since:.0f}s",
                shards or "-",
                *([render_traffic(r.traffic)] * routed),
            ]
        )
        if r.why and r.state in ("Failed", "Stopping"):
            problems.append(f"{r.replica_id}: {r.why}")
        for s in r.shards:
            where = f"{r.replica_id} shard {s.shard_id} on {s.node_id}"
            if not s.healthy:
                problems.append(f"{where} is not routed: {s.detail}")
            if not s.verified:
                why = s.unverified_why or "is not checked yet (learned from a report)"
                problems.append(f"{where} is not routed: its engine {why}")
            if (f := s.fetching) is not None:
                how = fetching_words(f.source, f.done_bytes, f.total_bytes, f.rate_bps, f.peer)
                problems.append(f"{where}: {how}")
            if s.detail and s.state == "failed":
                problems.append(f"{where}: {s.detail}")
                problems.extend(f"    {line}" for line in s.output_tail[-5:])
    return "\n".join([table(rows), *([""] + problems if problems else [])])


# --- models, failures, placement, reload ---------------------------------------------


def _exit(f: FailureView) -> str:
    if f.signal:
        return f"signal {f.signal}"
    if f.exit_code is not None:
        return f"exit {f.exit_code}"
    return "-"


def _model_state(m: ModelView) -> str:
    """What an operator most needs to know about a model, in words."""
    words = []
    if m.outdated:
        words.append(f"rolling out a profile change, {m.outdated} to replace")
    retry = m.retry_in_s
    if m.cannot_place:
        words.append(f"cannot place: {m.cannot_place}")
        if retry is not None:
            words.append(f"next try in {retry:.0f} s")
    elif retry is not None:
        words.append(f"crash loop, next try in {retry:.0f} s")
    if m.weights_missing:
        words.append("no node reports its weights")
    for fetch in m.fetching:
        p = fetch.progress
        how = progress_words(p.done_bytes, p.total_bytes, p.rate_bps, p.peer)
        words.append(f"fetching {how or 'its weights'} on {fetch.node_id}")
    if m.failures:
        f = m.failures[0]
        words.append(f"last failure {_age(f.ago_s)} on {f.node_id}: {f.reason}")
    return "; ".join(words) or "-"


def render_models(models: list[ModelView]) -> str:
    rows = [["MODEL", "WANTED", "READY", "STARTING", "FAILED", "NODES", "PROBLEMS"]]
    for m in models:
        sc = m.scaling
        rows.append(
            [
                m.model,
                str(m.wanted) if sc is None else f"{m.wanted} ({sc.min}-{sc.max})",
                str(m.ready),
                str(m.starting),
                str(m.failed),
                ",".join(m.nodes) or "-",
                _model_state(m),
            ]
        )
    lines = [table(rows)]
    ranged = [m for m in models if m.scaling is not None]
    if ranged:
        lines += ["", "Scaling on demand:"]
    for m in ranged:
        sc = m.scaling
        assert sc is not None
        said = f"{m.model}: {sc.min}-{sc.max} replicas, {sc.target:g} requests at once each"
        said += f"; now {sc.in_flight} in flight, {sc.waiting} waiting"
        if sc.pinned is not None:
            said += f"; pinned at {sc.pinned} (llmgw ctl scale {m.model} --release)"
        if sc.start_s is not None:
            said += f"; a start takes {sc.start_s:.0f} s"
        if sc.wake_s is not None:
            said += f", a wake {sc.wake_s:.1f} s"
        if m.sleeping:
            said += f"; {m.sleeping} asleep"
        lines.append("  " + said)
        if sc.yielding:
            lines.append(f"    held back: {sc.yielding}")
        if sc.last_change:
            ago = "" if sc.last_change_ago_s is None else f" ({_age(sc.last_change_ago_s)} ago)"
            lines.append(f"    last change{ago}: {sc.last_change}")
    return "\n".join(lines)


def render_failures(models: list[ModelView]) -> str:
    """Every model's last few engine failures, newest first, with the engine's last lines."""
    failures = sorted((f for m in models for f in m.failures), key=lambda f: f.ago_s)
    if not failures:
        return "no engine failures kept"
    rows = [["AGE", "MODEL", "REPLICA", "NODE", "EXIT", "REASON"]]
    for f in failures:
        rows.append([_age(f.ago_s), f.model, f.replica_id, f.node_id, _exit(f), f.reason])
    lines = [table(rows)]
    for f in failures:
        if f.output_tail:
            lines.append("")
            lines.append(f"{f.replica_id} on {f.node_id} ({_age(f.ago_s)}), last lines:")
            lines.extend(f"    {line}" for line in f.output_tail[-10:])
    return "\n".join(lines)


def render_placement(d: PlacementView) -> str:
    """Two things apart: where the model's replicas run now, and where a new one
    would go (placement's decision, with every node it considered)."""
    running = d.running
    lines = [f"Running now: {len(running)} replica{'' if len(running) == 1 else 's'}"]
    if running:
        rows = [["REPLICA", "PROFILE", "STATE", "NODES"]]
        for r in running:
            state = r.state + (" (leaving)" if r.leaving and r.state != "Draining" else "")
            rows.append([r.replica_id, r.profile, state, ",".join(r.nodes) or "-"])
        lines.append(table(rows))
    lines.append("")
    if d.profile is not None:
        lines.append(f"A new replica would go: {d.summary.removeprefix('placed ')}")
    else:
        lines.append(f"A new replica would go: nowhere; {d.summary}")
    rows = [["NODE", "PROFILE", "FITS", "WHY"]]
    for c in d.candidates:
        rows.append([c.node_id, c.profile, "yes" if c.ok else "no", c.reason])
    lines.append(table(rows) if len(rows) > 1 else "no nodes have registered")
    for profile, words in d.needs.items():
        lines.append(f"A replica of profile {profile} needs of each node's memory: {words}")
    return "\n".join(lines)


def render_console(d: ConsoleInfo) -> str:
    if not d.on:
        return (
            "the web console is off: set [console] listen in the server's config (and"
            " console.tls = true beyond loopback), then restart the server"
        )
    return "\n".join(
        [
            "web console: " + ", ".join(d.urls) + (" (TLS)" if d.tls else ""),
            f"sign in with the viewer token (in {d.viewer_token_file} on the server's machine)"
            " to see the fleet, or with the admin token to act on it",
        ]
    )


def render_reload(d: ReloadAnswer) -> str:
    return "\n".join([d.message, *(f"warning: {w}" for w in d.warnings)])

"""``llmgw ctl``: see and steer the fleet through the management API."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cyclopts
import httpx
import msgspec

from llmgw.addr import url_host
from llmgw.admin.views import NodeView
from llmgw.cli.defaults import not_found, server_config
from llmgw.cli.runtime import fail
from llmgw.config import ConfigError, ServerConfig, load_config, parse_hostport
from llmgw.config.loader import read_text
from llmgw.config.schema import resolve
from llmgw.controlplane import moves
from llmgw.controlplane.fabrics import FleetStatus, describe_copies

ctl_app = cyclopts.App(
    name="ctl",
    help="See and steer the fleet through the control plane's management API.",
)

DEFAULT_ADMIN_URL = "http://127.0.0.1:7444"
TIMEOUT_S = 10.0
# `drain --wait` without --timeout: the server's longest drain (its drain_bound_s) plus this
DRAIN_WAIT_MARGIN_S = 60.0
DEFAULT_DRAIN_BOUND_S = 480.0  # drain grace 300 + drain timeout 120 + stop timeout 60


class CtlError(Exception):
    pass


@cyclopts.Parameter(name="*")
@dataclass
class Target:
    """Which control plane to talk to, and how to prove we may.

    Parameters
    ----------
    config
        The server's config file: the admin address and token are read from it.
        [env: LLMGW_SERVER_CONFIG; default /etc/llmgw/server.toml if it exists and
        no token is given]
    admin_url
        The management API's URL. [env: LLMGW_ADMIN_URL; default http://127.0.0.1:7444]
    token
        Admin bearer token; avoid it: a command line is visible to every user of
        the machine (prefer --token-file or LLMGW_ADMIN_TOKEN). [env: LLMGW_ADMIN_TOKEN]
    token_file
        File holding the admin token. [env: LLMGW_ADMIN_TOKEN_FILE]
    """

    config: Path | None = None
    admin_url: str | None = None
    token: str | None = None
    token_file: Path | None = None

    def server_config(self) -> tuple[Path | None, bool]:
        """The server's config: --config, LLMGW_SERVER_CONFIG, or /etc/llmgw/server.toml
        if it exists; and whether it is that default."""
        return server_config(self.config, os.environ)

    def resolve(self) -> tuple[str, str]:
        url = self.admin_url or os.environ.get("LLMGW_ADMIN_URL")
        if self.token:
            print(
                "llmgw ctl: warning: --token is visible to every user of this machine"
                " (ps, /proc/PID/cmdline); use --token-file FILE or LLMGW_ADMIN_TOKEN",
                file=sys.stderr,
                flush=True,
            )
        token = self.token or os.environ.get("LLMGW_ADMIN_TOKEN")
        token_file = self.token_file or _env_path("LLMGW_ADMIN_TOKEN_FILE")
        config, default = self.server_config()
        if default and (token or token_file):
            config = None  # a token given outright needs no file that may be root's
        if config is not None:
            try:
                cfg, base = load_config(ServerConfig, config)
            except ConfigError as exc:
                if not default:
                    raise
                raise CtlError(
                    f"{exc} (read by default: run ctl with sudo, or pass --config SERVER.toml"
                    " or --token-file FILE)"
                ) from None
            if url is None:
                host, port = parse_hostport(cfg.admin.listen, key="admin.listen")
                url = f"http://{url_host(host)}:{port}"
            if token is None and token_file is None:
                token = cfg.admin.token or None
                if token is None:
                    token_file = resolve(
                        base, cfg.admin.token_file or f"{cfg.state_dir}/admin-token"
                    )
        if token is None and token_file is not None:
            try:
                token = read_text(token_file).strip()
            except ConfigError as exc:
                raise CtlError(f"admin token file {exc}") from None
        if not token:
            if token_file is not None:
                raise CtlError(f"admin token file {token_file} is empty")
            raise CtlError(
                f"no admin token: {not_found()} (or give --token-file FILE or LLMGW_ADMIN_TOKEN)"
            )
        return (url or DEFAULT_ADMIN_URL).rstrip("/"), token


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def get(target: Target, path: str) -> Any:
    return call(target, "GET", path)


def call(target: Target, method: str, path: str, body: object = None) -> Any:
    url, token = target.resolve()
    try:
        response = httpx.request(
            method,
            url + path,
            headers={"authorization": f"Bearer {token}"},
            json=body,
            timeout=TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        raise CtlError(f"cannot reach the management API at {url}: {exc}") from None
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text.strip()[:200]
        raise CtlError(f"{url}{path}: HTTP {response.status_code}: {message}")
    return response.json()


def _ago(wall: float, now: float) -> str:
    s = max(0.0, now - wall)
    if s < 60:
        return f"{s:.0f}s ago"
    if s < 3600:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


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


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


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


def _run(program: str, fn: Any) -> int:
    try:
        fn()
    except (CtlError, ConfigError) as exc:
        return fail(program, str(exc))
    return 0


@ctl_app.command
def nodes(*, target: Target | None = None, json: bool = False) -> int:
    """List the nodes the control plane knows: state, address, when last seen, GPUs, memory.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """

    def run() -> None:
        data = get(target or Target(), "/v1/nodes")
        views = msgspec.convert(data["nodes"], list[NodeView])
        if json:
            sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
        else:
            print(render_nodes(views, time.time(), data.get("server_version", "")))

    return _run("llmgw ctl nodes", run)


@ctl_app.command
def status(*, target: Target | None = None, json: bool = False) -> int:
    """Per fabric: which models its nodes hold, and on what (a shared filer, or N local
    copies); warns when a model is held in one fabric only.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """

    def run() -> None:
        data = get(target or Target(), "/v1/status")
        if json:
            sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
        else:
            print(render_status(msgspec.convert(data, FleetStatus)))

    return _run("llmgw ctl status", run)


def _print(data: object, as_json: bool, render: Any) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
    else:
        print(render(data))


def render_traffic(t: dict[str, Any] | None) -> str:
    """The router's view of a replica, in a few words ("-": no router here)."""
    if t is None:
        return "-"
    words = [f"{t['in_flight']} in flight"]
    if t.get("wedged"):
        words.append(f"WEDGED: {t['wedged']}")
    if t["breaker"] != "closed":
        words.append(f"breaker {t['breaker']}")
    if t.get("load_age_s") is None:
        words.append("no engine gauges yet")
    else:
        gauges = [f"{t[k]:g} {k}" for k in ("waiting", "running") if t.get(k) is not None]
        if t.get("kv_usage") is not None:
            gauges.append(f"kv {t['kv_usage']:.0%}")
        words.extend(gauges)
        if t["load_age_s"] > 5:
            words.append(f"gauges {t['load_age_s']:.0f}s old")
    if t.get("cache_hit_rate") is not None:
        cached = f"cache hits {t['cache_hit_rate']:.0%}"
        if t.get("estimated_hit_rate") is not None:
            cached += f" (router estimated {t['estimated_hit_rate']:.0%})"
        words.append(cached)
    if t.get("affinity_overruled") is not None:
        words.append(f"affinity overruled by load {t['affinity_overruled']:.0%}")
    return ", ".join(words)


def render_replicas(data: dict[str, Any]) -> str:
    routed = any(r.get("traffic") is not None for r in data["replicas"])
    rows = [["REPLICA", "MODEL", "PROFILE", "STATE", "FOR", "SHARDS", *(["TRAFFIC"] * routed)]]
    problems: list[str] = []
    for r in data["replicas"]:
        shards = ", ".join(
            f"{s['node_id']}:{s['port']}{'/gpu' + ','.join(map(str, s['gpus'])) if s['gpus'] else ''}"
            f" {s['state']}"
            for s in r["shards"]
        )
        state = r["state"] + (",unhealthy" if not r.get("healthy", True) else "")
        state += ",unverified" if not r.get("verified", True) else ""
        state += ",outdated" if r.get("outdated") else ""
        if r["leaving"] and r["state"] not in ("Draining", "Failed", "Stopping"):
            why = moves.words(r.get("leaving_why", ""))
            state += f" (leaving{': ' + why if why else ''})"
        rows.append(
            [
                r["replica_id"],
                r["model"],
                r["profile"],
                state,
                f"{r['state_since']:.0f}s",
                shards or "-",
                *([render_traffic(r.get("traffic"))] * routed),
            ]
        )
        if r["why"] and r["state"] in ("Failed", "Stopping"):
            problems.append(f"{r['replica_id']}: {r['why']}")
        for s in r["shards"]:
            if not s.get("healthy", True):
                problems.append(
                    f"{r['replica_id']} shard {s['shard_id']} on {s['node_id']} "
                    f"is not routed: {s['detail']}"
                )
            if not s.get("verified", True):
                why = s.get("unverified_why") or "is not checked yet (learned from a report)"
                problems.append(
                    f"{r['replica_id']} shard {s['shard_id']} on {s['node_id']} "
                    f"is not routed: its engine {why}"
                )
            if s["detail"] and s["state"] == "failed":
                problems.append(
                    f"{r['replica_id']} shard {s['shard_id']} on {s['node_id']}: {s['detail']}"
                )
                problems.extend(f"    {line}" for line in s["output_tail"][-5:])
    return "\n".join([table(rows), *([""] + problems if problems else [])])


def _exit(f: dict[str, Any]) -> str:
    if f.get("signal"):
        return f"signal {f['signal']}"
    if f.get("exit_code") is not None:
        return f"exit {f['exit_code']}"
    return "-"


def _age(seconds: float) -> str:
    return _ago(0.0, seconds)


def _model_state(m: dict[str, Any]) -> str:
    """What an operator most needs to know about a model, in words."""
    words = []
    if m.get("outdated"):
        words.append(f"rolling out a profile change, {m['outdated']} to replace")
    retry = m.get("retry_in_s")
    if m.get("cannot_place"):
        words.append(f"cannot place: {m['cannot_place']}")
        if retry is not None:
            words.append(f"next try in {retry:.0f} s")
    elif retry is not None:
        words.append(f"crash loop, next try in {retry:.0f} s")
    if m.get("weights_missing"):
        words.append("no node reports its weights")
    if m["failures"]:
        f = m["failures"][0]
        words.append(f"last failure {_age(f['ago_s'])} on {f['node_id']}: {f['reason']}")
    return "; ".join(words) or "-"


def render_models(data: dict[str, Any]) -> str:
    rows = [["MODEL", "WANTED", "READY", "STARTING", "FAILED", "NODES", "PROBLEMS"]]
    for m in data["models"]:
        rows.append(
            [
                m["model"],
                str(m["wanted"]),
                str(m["ready"]),
                str(m["starting"]),
                str(m["failed"]),
                ",".join(m["nodes"]) or "-",
                _model_state(m),
            ]
        )
    return table(rows)


def render_failures(data: dict[str, Any]) -> str:
    """Every model's last few engine failures, newest first, with the engine's last lines."""
    failures = sorted((f for m in data["models"] for f in m["failures"]), key=lambda f: f["ago_s"])
    if not failures:
        return "no engine failures kept"
    rows = [["AGE", "MODEL", "REPLICA", "NODE", "EXIT", "REASON"]]
    for f in failures:
        rows.append(
            [_age(f["ago_s"]), f["model"], f["replica_id"], f["node_id"], _exit(f), f["reason"]]
        )
    lines = [table(rows)]
    for f in failures:
        if f["output_tail"]:
            lines.append("")
            lines.append(f"{f['replica_id']} on {f['node_id']} ({_age(f['ago_s'])}), last lines:")
            lines.extend(f"    {line}" for line in f["output_tail"][-10:])
    return "\n".join(lines)


def render_placement(d: dict[str, Any]) -> str:
    """Two things apart: where the model's replicas run now, and where a new one
    would go (placement's decision, with every node it considered)."""
    running = d.get("running", [])
    lines = [f"Running now: {len(running)} replica{'' if len(running) == 1 else 's'}"]
    if running:
        rows = [["REPLICA", "PROFILE", "STATE", "NODES"]]
        for r in running:
            state = r["state"] + (" (leaving)" if r["leaving"] and r["state"] != "Draining" else "")
            rows.append([r["replica_id"], r["profile"], state, ",".join(r["nodes"]) or "-"])
        lines.append(table(rows))
    lines.append("")
    if d["profile"] is not None:
        lines.append(f"A new replica would go: {d['summary'].removeprefix('placed ')}")
    else:
        lines.append(f"A new replica would go: nowhere; {d['summary']}")
    rows = [["NODE", "PROFILE", "FITS", "WHY"]]
    for c in d["candidates"]:
        rows.append([c["node_id"], c["profile"], "yes" if c["ok"] else "no", c["reason"]])
    lines.append(table(rows) if len(rows) > 1 else "no nodes have registered")
    for profile, words in d.get("needs", {}).items():
        lines.append(f"A replica of profile {profile} needs of each node's memory: {words}")
    return "\n".join(lines)


@ctl_app.command
def replicas(*, target: Target | None = None, json: bool = False, failures: bool = False) -> int:
    """List replicas with their shards (node, port, GPUs, state) and per-shard errors.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    failures
        Show the last few engine failures of each model instead (kept after their
        replicas are gone): when, where, the exit and the engine's last lines.
    """
    if failures:
        return _run(
            "llmgw ctl replicas",
            lambda: _print(get(target or Target(), "/v1/models"), json, render_failures),
        )
    return _run(
        "llmgw ctl replicas",
        lambda: _print(get(target or Target(), "/v1/replicas"), json, render_replicas),
    )


@ctl_app.command
def models(*, target: Target | None = None, json: bool = False) -> int:
    """One row per catalog model: replicas wanted, ready, starting and failed, where they
    run, and what is wrong (cannot place, a crash loop, the last failure).

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return _run(
        "llmgw ctl models",
        lambda: _print(get(target or Target(), "/v1/models"), json, render_models),
    )


def _intent(name: str, node: str, target: Target | None, json: bool) -> int:
    def run() -> None:
        data = call(target or Target(), "POST", f"/v1/nodes/{node}", {"intent": name})
        _print(data, json, lambda d: d["message"])

    return _run(f"llmgw ctl {name}", run)


@ctl_app.command
def cordon(node: str, *, target: Target | None = None, json: bool = False) -> int:
    """Stop placing new replicas on NODE; what runs there keeps running."""
    return _intent("cordon", node, target, json)


@ctl_app.command
def uncordon(node: str, *, target: Target | None = None, json: bool = False) -> int:
    """Let placement use NODE again (also ends a drain)."""
    return _intent("uncordon", node, target, json)


@ctl_app.command
def drain(
    node: str,
    *,
    wait: bool = False,
    timeout: float | None = None,
    target: Target | None = None,
    json: bool = False,
) -> int:
    """Move every replica off NODE as a rolling move: a replacement is placed elsewhere
    first, and the original is stopped once the replacement is Ready (or the drain
    grace is over, so draining the only node that can host a model still finishes).
    The node stays cordoned until `uncordon`; once nothing runs there it reads Drained.

    Parameters
    ----------
    wait
        Wait until NODE is drained, with a line of progress each time it changes;
        exit 0 once nothing runs there, non-zero (saying what still runs) on --timeout.
    timeout
        How long --wait waits, in seconds; default: the longest the server's drain
        takes (its drain grace, drain timeout and stop timeout, as it says) plus a
        minute, so a drain that will finish is not called failed.
    json
        Print the API's JSON instead of words (progress then goes to stderr).
    """
    if not wait:
        return _intent("drain", node, target, json)

    def run() -> None:
        t = target or Target()
        data = call(t, "POST", f"/v1/nodes/{node}", {"intent": "drain"})
        _print(data, json, lambda d: d["message"])
        out = sys.stderr if json else sys.stdout
        wait_s = timeout
        if wait_s is None:
            bound = data.get("drain_bound_s")
            # a server that does not say: the longest drain of the default settings
            bound = float(bound) if isinstance(bound, int | float) else DEFAULT_DRAIN_BOUND_S
            wait_s = bound + DRAIN_WAIT_MARGIN_S
            print(
                f"waiting up to {wait_s:g} s for {node} to drain (the server's drain takes at"
                f" most {bound:g} s, plus {DRAIN_WAIT_MARGIN_S:g} s; --timeout to change)",
                file=out,
                flush=True,
            )
        _wait_drained(t, node, wait_s, out)

    return _run("llmgw ctl drain", run)


def _wait_drained(target: Target, node: str, timeout: float, out: Any) -> None:
    """Poll until NODE reads drained; one line of progress each time the numbers change."""
    deadline = time.monotonic() + timeout
    first: set[str] | None = None
    said = ""
    while True:
        view = next((n for n in get(target, "/v1/nodes")["nodes"] if n["node_id"] == node), None)
        if view is not None and view.get("drained"):
            print(f"node {node} drained: nothing runs there", file=out, flush=True)
            return
        here = [
            r
            for r in get(target, "/v1/replicas")["replicas"]
            if any(s["node_id"] == node for s in r["shards"])
        ]
        ids = {r["replica_id"] for r in here}
        first = ids if first is None else first
        draining = sum(1 for r in here if r["state"] == "Draining")
        line = (
            f"{node}: {len(here)} replicas left, {len(first - ids)} moved, "
            f"{draining} draining, {len(here) - draining} waiting for a replacement "
            "or the drain grace"
        )
        if line != said:
            print(line, file=out, flush=True)
            said = line
        if time.monotonic() >= deadline:
            what = "; ".join(
                f"replica {r['replica_id']} ({r['model']}, {r['state']}"
                + (f": {r['why']}" if r["why"] else "")
                + ")"
                for r in here
            )
            raise CtlError(
                f"node {node} is not drained after {timeout:g} s; still there: "
                + (what or "no replica (the node is not connected?)")
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


@ctl_app.command(name="explain-placement")
def explain_placement(model: str, *, target: Target | None = None, json: bool = False) -> int:
    """Where MODEL's replicas run now, and where a new one would go: every node
    placement would consider, and why each fits or not (memory in GiB: what the node
    has, what the replicas there hold, what one more needs), and what a replica of
    each profile needs of a node's memory, and why.

    Parameters
    ----------
    json
        Print the API's JSON instead: the decision's fields (each candidate with
        ``memory_bytes``, ``held_bytes``, ``held_by``, ``need_bytes``; ``needs`` by
        profile), and ``running``, a list.
    """
    return _run(
        "llmgw ctl explain-placement",
        lambda: _print(
            get(target or Target(), f"/v1/models/{model}/placement"), json, render_placement
        ),
    )


@ctl_app.command
def reload(*, target: Target | None = None, json: bool = False) -> int:
    """Read the catalog and the API keys again (as SIGHUP does); a bad config or
    catalog file changes nothing. Then warn, one line each, about a model that no
    node can hold now and an engine setting its engine does not know.

    Parameters
    ----------
    json
        Print the API's JSON instead (``message``, and ``warnings``, a list).
    """
    return _run(
        "llmgw ctl reload",
        lambda: _print(call(target or Target(), "POST", "/v1/catalog/reload"), json, render_reload),
    )


def render_reload(d: dict[str, Any]) -> str:
    return "\n".join([d["message"], *(f"warning: {w}" for w in d.get("warnings", []))])


@ctl_app.command
def key(name: str, *, models: list[str] | None = None) -> int:
    """Make an API key for the OpenAI-compatible endpoint. Prints the key (shown this
    once: give it to the client) and the lines to add to the server's config, which
    hold only its SHA-256.

    Parameters
    ----------
    models
        Limit the key to these models (repeatable); default: every model.
    """
    from llmgw.router.keys import hash_key, new_key

    secret = new_key()
    allowed = ", ".join(f'"{m}"' for m in models or [])
    print(f"key: {secret}")
    print(
        "\n# add to the server's config (the key itself is not stored), then llmgw ctl"
        " reload:\n# every llmgw router that follows the server takes it within moments"
    )
    print(f'[[router.keys]]\nname = "{name}"\nsha256 = "{hash_key(secret)}"\nmodels = [{allowed}]')
    return 0

"""``llmgw ctl``: see and steer the fleet through the management API.

Each command is a few lines: ask the management API (``admin_client``), and
print what it answered (``render``: a table, or the API's JSON with
``--json``). What is decided here is what a command waits for: ``drain
--wait`` polls the nodes and replicas views until the node reads drained, or
says what still runs there when its time is up.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO, TypeVar
from urllib.parse import quote

import cyclopts

from llmgw.admin.views import (
    ConsoleInfo,
    IntentAnswer,
    ModelList,
    NodeList,
    PlacementView,
    ReloadAnswer,
    ReplicaList,
    ScaleAnswer,
)
from llmgw.cli.admin_client import AdminClient, CtlError, Target, run_command
from llmgw.cli.render import (
    emit,
    render_console,
    render_failures,
    render_models,
    render_nodes,
    render_placement,
    render_reload,
    render_replicas,
    render_status,
)
from llmgw.cli.runtime import fail
from llmgw.controlplane.fabrics import FleetStatus

ctl_app = cyclopts.App(
    name="ctl",
    help="See and steer the fleet through the control plane's management API.",
)

# `drain --wait` without --timeout: the server's longest drain (its drain_bound_s) plus this
DRAIN_WAIT_MARGIN_S = 60.0
DEFAULT_DRAIN_BOUND_S = 480.0  # drain grace 300 + drain timeout 120 + stop timeout 60

T = TypeVar("T")


def _show(
    program: str,
    target: Target | None,
    path: str,
    kind: type[T],
    as_json: bool,
    render: Callable[[T], str],
    method: str = "GET",
    body: object = None,
) -> int:
    """One call of the API, printed: the command ``program`` of most of ctl."""
    return run_command(
        f"llmgw ctl {program}",
        lambda: emit(AdminClient(target).request(method, path, kind, body), as_json, render),
    )


@ctl_app.command
def nodes(*, target: Target | None = None, json: bool = False) -> int:
    """List the nodes the control plane knows: state, address, when last seen, GPUs, memory.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return _show(
        "nodes",
        target,
        "/v1/nodes",
        NodeList,
        json,
        lambda d: render_nodes(d.nodes, time.time(), d.server_version),
    )


@ctl_app.command
def status(*, target: Target | None = None, json: bool = False) -> int:
    """Per fabric: which models its nodes hold, and on what (a shared filer, or N local
    copies); warns when a model is held in one fabric only.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return _show("status", target, "/v1/status", FleetStatus, json, render_status)


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
        return _show(
            "replicas", target, "/v1/models", ModelList, json, lambda d: render_failures(d.models)
        )
    return _show(
        "replicas", target, "/v1/replicas", ReplicaList, json, lambda d: render_replicas(d.replicas)
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
    return _show("models", target, "/v1/models", ModelList, json, lambda d: render_models(d.models))


@ctl_app.command
def scale(
    model: str,
    replicas: int | None = None,
    *,
    release: bool = False,
    target: Target | None = None,
    json: bool = False,
) -> int:
    """Pin MODEL (one with a range of replicas) at REPLICAS until released, whatever its
    demand says; with --release, its replicas follow demand again.

    Parameters
    ----------
    replicas
        How many to run (0 to the range's max).
    release
        Release the pin: the count follows demand again.
    json
        Print the API's JSON instead of a line.
    """
    if (replicas is None) != release:
        return fail(
            "llmgw ctl scale", f"give a count (llmgw ctl scale {model} 2) or --release, one of them"
        )
    path = f"/v1/models/{quote(model, safe='')}/scale"
    body = {"replicas": None if release else replicas}
    return _show("scale", target, path, ScaleAnswer, json, _message, method="POST", body=body)


def _intent(name: str, node: str, target: Target | None, json: bool) -> int:
    body = {"intent": name}
    path = f"/v1/nodes/{node}"
    return _show(name, target, path, IntentAnswer, json, _message, method="POST", body=body)


def _message(answer: IntentAnswer | ScaleAnswer) -> str:
    return answer.message


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

    def drain_and_wait() -> None:
        client = AdminClient(target)
        answer = client.request("POST", f"/v1/nodes/{node}", IntentAnswer, {"intent": "drain"})
        emit(answer, json, _message)
        out = sys.stderr if json else sys.stdout
        wait_s = timeout
        if wait_s is None:
            bound = answer.view.drain_bound_s
            # a server that does not say: the longest drain of the default settings
            bound = DEFAULT_DRAIN_BOUND_S if bound is None else float(bound)
            wait_s = bound + DRAIN_WAIT_MARGIN_S
            print(
                f"waiting up to {wait_s:g} s for {node} to drain (the server's drain takes at"
                f" most {bound:g} s, plus {DRAIN_WAIT_MARGIN_S:g} s; --timeout to change)",
                file=out,
                flush=True,
            )
        _wait_drained(client, node, wait_s, out)

    return run_command("llmgw ctl drain", drain_and_wait)


def _wait_drained(client: AdminClient, node: str, timeout: float, out: TextIO) -> None:
    """Poll until NODE reads drained; one line of progress each time the numbers change."""
    deadline = time.monotonic() + timeout
    first: set[str] | None = None
    said = ""
    while True:
        nodes = client.get("/v1/nodes", NodeList).nodes
        view = next((n for n in nodes if n.node_id == node), None)
        if view is not None and view.drained:
            print(f"node {node} drained: nothing runs there", file=out, flush=True)
            return
        here = [
            r
            for r in client.get("/v1/replicas", ReplicaList).replicas
            if any(s.node_id == node for s in r.shards)
        ]
        ids = {r.replica_id for r in here}
        first = ids if first is None else first
        draining = sum(1 for r in here if r.state == "Draining")
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
                f"replica {r.replica_id} ({r.model}, {r.state}"
                + (f": {r.why}" if r.why else "")
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
    path = f"/v1/models/{model}/placement"
    return _show("explain-placement", target, path, PlacementView, json, render_placement)


@ctl_app.command
def console(*, target: Target | None = None, json: bool = False) -> int:
    """Where the web console listens, and which token signs in to it.

    Parameters
    ----------
    json
        Print the API's JSON instead (``on``, ``urls``, ``tls``, ``viewer_token_file``).
    """
    return _show("console", target, "/v1/console", ConsoleInfo, json, render_console)


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
    path = "/v1/catalog/reload"
    return _show("reload", target, path, ReloadAnswer, json, render_reload, method="POST")

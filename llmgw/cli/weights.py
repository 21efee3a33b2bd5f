"""``llmgw ctl weights``: what each node holds of weights and what it is fetching, and
``ctl weights prefetch``: warm nodes with a model's weights before a rollout."""

from __future__ import annotations

import time
from urllib.parse import quote

import cyclopts

from llmgw.admin.views import NodeWeights, PrefetchAnswer, WeightsList
from llmgw.cli.admin_client import Target
from llmgw.cli.ctl import _show as show
from llmgw.cli.render import table
from llmgw.weights.part import human
from llmgw.weights.progress import fetching_words

weights_app = cyclopts.App(
    name="weights",
    help="Weights on the nodes: what each holds and fetches; prefetch a model's.",
)


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "?"
    s = max(0.0, now - at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def render_weights(nodes: list[NodeWeights], now: float) -> str:
    rows = [["NODE", "FABRIC", "WEIGHTS", "SIZE", "LAST USED", "STORAGE", "FROM", "PATH"]]
    notes: list[str] = []
    for n in nodes:
        for c in sorted(n.copies, key=lambda c: c.path):
            rows.append(
                [
                    n.node_id,
                    n.fabric or "-",
                    c.model,
                    human(c.size_bytes) if c.size_bytes is not None else "?",
                    _ago(c.last_used, now),
                    c.storage,
                    c.source or "-",
                    c.path,
                ]
            )
        if not n.copies:
            rows.append([n.node_id, n.fabric or "-", *["-"] * 6])
        if n.budget_bytes is not None:
            inside = n.weights_dir.rstrip("/") + "/"
            held = sum(c.size_bytes or 0 for c in n.copies if c.path.startswith(inside))
            notes.append(
                f"{n.node_id}: {human(held)} of weights in {n.weights_dir}, budget "
                f"{human(n.budget_bytes)} (the longest unused go first)"
            )
        for f in n.fetching:
            how = fetching_words(f.source, f.done_bytes, f.total_bytes, f.rate_bps, f.peer)
            notes.append(f"{n.node_id}: {how}")
    return "\n".join([table(rows), *([""] + notes if notes else [])])


def render_prefetch(a: PrefetchAnswer) -> str:
    told = ", ".join(a.nodes) if a.nodes else "no node"
    lines = [
        f"prefetching {a.model}'s weights ({a.source}, profile {a.profile}) on {told}; "
        "llmgw ctl weights shows how far each has come"
    ]
    lines += [f"  not on {s.node_id}: {s.why}" for s in a.skipped]
    return "\n".join(lines)


@weights_app.default
def weights(*, target: Target | None = None, json: bool = False) -> int:
    """What each node holds of weights (name, size, when an engine last used it, storage,
    the source it was fetched from, path), each node's disk budget, and the fetches
    under way with how far each has come.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return show(
        "weights",
        target,
        "/v1/weights",
        WeightsList,
        json,
        lambda d: render_weights(d.nodes, time.time()),
    )


@weights_app.command
def prefetch(
    model: str,
    *,
    fabric: str = "",
    node: list[str] | None = None,
    target: Target | None = None,
    json: bool = False,
) -> int:
    """Fetch MODEL's weights (its first profile with a source) onto nodes now, before a
    rollout needs them: every node that could run that profile, or those of one fabric,
    or the nodes named. Nodes that hold them already are left alone.

    Parameters
    ----------
    fabric
        Only the nodes of this fabric.
    node
        Only this node (repeat for more).
    json
        Print the API's JSON instead of a summary.
    """
    return show(
        "weights prefetch",
        target,
        f"/v1/models/{quote(model, safe='')}/prefetch",
        PrefetchAnswer,
        json,
        render_prefetch,
        method="POST",
        body={"fabric": fabric, "nodes": node or []},
    )

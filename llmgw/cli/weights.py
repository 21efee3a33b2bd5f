"""``llmgw ctl weights``: what each node holds of weights and what it is fetching, and
``ctl weights prefetch``: warm nodes with a model's weights before a rollout."""

from __future__ import annotations

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


def render_weights(nodes: list[NodeWeights]) -> str:
    rows = [["NODE", "FABRIC", "WEIGHTS", "SIZE", "STORAGE", "FROM", "PATH"]]
    fetching: list[str] = []
    for n in nodes:
        for c in sorted(n.copies, key=lambda c: c.path):
            rows.append(
                [
                    n.node_id,
                    n.fabric or "-",
                    c.model,
                    human(c.size_bytes) if c.size_bytes is not None else "?",
                    c.storage,
                    c.source or "-",
                    c.path,
                ]
            )
        if not n.copies:
            rows.append([n.node_id, n.fabric or "-", "-", "-", "-", "-", "-"])
        for f in n.fetching:
            how = fetching_words(f.source, f.done_bytes, f.total_bytes, f.rate_bps, f.peer)
            fetching.append(f"{n.node_id}: {how}")
    return "\n".join([table(rows), *([""] + fetching if fetching else [])])


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
    """What each node holds of weights (name, size, storage, the source it was fetched
    from, path), and the fetches under way with how far each has come.

    Parameters
    ----------
    json
        Print the API's JSON instead of a table.
    """
    return show(
        "weights", target, "/v1/weights", WeightsList, json, lambda d: render_weights(d.nodes)
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

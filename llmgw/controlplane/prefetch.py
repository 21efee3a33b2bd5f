"""``ctl weights prefetch``: which nodes fetch a model's weights before a rollout, and
where each lands them.

Theory of operation
-------------------
A model's weights are named by its profiles' sources (``Profile.source``); the
first profile with one that is fetched (not a path on a shared mount) is the
one warmed, since it is the one placement tries first. The nodes are those
given by name, else every node of the fabric given, else every node: of them,
those that are up, whose agent can fetch (``Register.can``), whose labels
match the profile's selector and that have its engine. A node that already
holds the source (``WeightCopy.source``) or is fetching it is skipped and
said so; the others are each sent a ``Fetch`` (``plan.Fetch``) of the file to
where its source lands under that node's ``weights_dir`` (the profile's
``model_path`` where it names one), exactly where a replica placed there
would look (``starts.model_path``), with the agents to take it from
(``peers``): those that hold it or fetch it, then the node told just before
(and the ones before that, should it go), so that the nodes told together
form a chain and the source is read once.

This module is pure: it decides and says, the fleet manager sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from llmgw.controlplane.catalog import Model, Profile
from llmgw.controlplane.filters import NodeView, hardware
from llmgw.controlplane.nodes import Node, NodeState
from llmgw.controlplane.peers import weights_peers
from llmgw.controlplane.plan import Fetch
from llmgw.controlplane.starts import model_path
from llmgw.engines import installed
from llmgw.protocol.messages import FETCH


@attrs.frozen
class Prefetch:
    """What a prefetch does: the fetches to send, and each node left out with why."""

    profile: str
    fetches: list[Fetch]
    skipped: list[tuple[str, str]]  # (node, why)


def fetched_profile(model: Model) -> Profile | None:
    """The profile whose weights a prefetch warms: the first that fetches any."""
    return next((p for p in model.profiles if model.weights_source(p)), None)


def plan_prefetch(
    model: Model, nodes: Mapping[str, Node], *, fabric: str = "", only: Iterable[str] = ()
) -> Prefetch:
    """The fetches that warm ``model``'s weights on ``only`` (by node id), else on the
    nodes of ``fabric``, else on every node.

    Raises:
        ValueError: the model fetches nothing, or a node named is not known; the
            message says what to do.
    """
    profile = fetched_profile(model)
    if profile is None:
        raise ValueError(
            f"{model.name} has no profile with a source to fetch from: give one a source "
            "(hf://ORG/REPO/FILE or https://...)"
        )
    source = model.weights_source(profile)
    named = list(dict.fromkeys(only))
    unknown = [n for n in named if n not in nodes]
    if unknown:
        raise ValueError(f"no node {', '.join(unknown)} is known: see llmgw ctl nodes")
    chosen = (
        [nodes[n] for n in named]
        if named
        else [n for n in nodes.values() if not fabric or n.inventory.fabric == fabric]
    )
    if fabric and not chosen:
        raise ValueError(f"no node is in fabric {fabric!r}: see llmgw ctl nodes")
    fetches: list[Fetch] = []
    skipped: list[tuple[str, str]] = []
    for node in sorted(chosen, key=lambda n: n.node_id):
        why = _why_not(node, profile, source)
        if why:
            skipped.append((node.node_id, why))
            continue
        path = model_path(profile, node.inventory.weights_dir)
        # a chain: each takes from the one told before it, and should that one go,
        # from the one before that (peers serve only where a source lands, not a
        # profile's own model_path)
        before = [f.node for f in reversed(fetches)]
        peers = [] if profile.model_path else weights_peers(source, node.node_id, nodes, before)
        fetches.append(
            Fetch(
                node.node_id,
                profile.source,
                path,
                profile.sha256.lower(),
                profile.fetch_stall_s,
                peers,
            )
        )
    return Prefetch(profile.name, fetches, skipped)


def _why_not(node: Node, profile: Profile, source: str) -> str:
    """Why ``node`` is not sent a fetch of ``source`` ("": it is)."""
    inv = node.inventory
    if node.state is not NodeState.READY or not node.connected:
        return f"it is {node.state.value}"
    if FETCH not in node.can:
        return "its agent is too old to fetch weights: upgrade it"
    if any(c.source == source for c in inv.weights):
        return "it holds them already"
    if any(f.source == source for f in inv.fetching):
        return "it is fetching them already"
    # placement's own rule for whether the node could run the profile at all
    selector = list(profile.selector.items())
    refused = hardware(NodeView(inv), selector, installed(profile.engine), profile.nodes > 1)
    return f"it cannot run profile {profile.name}: {refused[1]}" if refused else ""

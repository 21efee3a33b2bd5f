"""Who takes weights from whom: the agents of a fabric that a node fetching a file
asks before the file's source.

Theory of operation
-------------------
A node that must fetch a profile's weights (a replica placed there, or a
prefetch) is given the agents it may take them from (``WeightsPeer``), in the
order to ask: those of its own fabric that hold the file (``WeightCopy.source``),
then those fetching it (``Inventory.fetching``), then those just told to
fetch it and not yet heard from (``also``, in the order they were told). Only
agents that serve (a transfer listener: ``Inventory.weights_port``), are up,
and are not the node itself. Nodes with no fabric are one fabric: a fleet
without InfiniBand labels is usually one network.

A prefetch of many nodes at once is a chain: the first is told to fetch from
the source (no peer has it yet), each next one to take from the one before
it, which serves each chunk as soon as it has it checked; each link carries
the file once, so the source is read once and no node's uplink carries more
than one copy at a time (``prefetch``).

This module is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.controlplane.nodes import Node, NodeState
from llmgw.protocol.messages import WeightsPeer
from llmgw.weights.source import parse_source


def weights_peers(
    source: str, taker: str, nodes: Mapping[str, Node], also: Iterable[str] = ()
) -> list[WeightsPeer]:
    """The agents ``taker`` may take ``source`` from, in the order to ask them."""
    me = nodes.get(taker)
    if not source or me is None:
        return []
    fabric = me.inventory.fabric
    holding: list[str] = []
    fetching: list[str] = []
    for node in sorted(nodes.values(), key=lambda n: n.node_id):
        if node.node_id == taker or not _serves(node, fabric):
            continue
        inv = node.inventory
        if any(c.source == source for c in inv.weights):
            holding.append(node.node_id)
        elif any(f.source == source for f in inv.fetching):
            fetching.append(node.node_id)
    told = [n for n in also if n != taker and n in nodes and _serves(nodes[n], fabric)]
    order = list(dict.fromkeys([*holding, *fetching, *told]))
    return [_peer(nodes[n]) for n in order]


def same_source(text: str, source: str) -> bool:
    """Whether ``text`` (as a spec carries it) names ``source`` (written one way)."""
    try:
        return str(parse_source(text)) == source
    except ValueError:
        return False


def _serves(node: Node, fabric: str) -> bool:
    return (
        node.state is NodeState.READY
        and node.connected
        and node.inventory.weights_port > 0
        and node.inventory.fabric == fabric
    )


def _peer(node: Node) -> WeightsPeer:
    return WeightsPeer(node_id=node.node_id, host=node.address, port=node.inventory.weights_port)

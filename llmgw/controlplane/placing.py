"""Placement within one pass: what every model's placements share, built once.

Theory of operation
-------------------
``placement.place`` is a function of the node facts, what is handed out
(``Allocations``) and what each shard needs of a node's memory (``Needs``).
A pass asks it for many models, and for a few what-ifs (where would this
replica go if it held nothing: a spread; would the replacement fit in what
the moving replicas hold: a rollout that may be forced). ``PassPlacement``
builds the facts, the allocations and the open nodes on first use only and
shares them among the pass's questions; a placement made during the pass
takes its GPUs and port from the shared allocations, so the next one sees
them taken. A what-if builds its own allocations without the replicas it
leaves out.

``allocated`` is what the replicas hold, derived from them every time (never
stored): a failed replica stops counting towards its model at once, but its
shards hold their GPUs, ports and memory until they report stopped (or their
node is lost, or the stop timeout is over): a new engine started on a GPU the
dying one still holds would fail to load.

This module is pure.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from llmgw.controlplane import moves
from llmgw.controlplane.allocations import Allocations
from llmgw.controlplane.catalog import Catalog, Model
from llmgw.controlplane.filters import NodeFacts, PlacementCache
from llmgw.controlplane.memory import Needs
from llmgw.controlplane.nodes import Node, NodeState
from llmgw.controlplane.placement import Decision, place
from llmgw.controlplane.replicas import Replica, ReplicaState


def allocated(
    replicas: Mapping[str, Replica],
    catalog: Catalog,
    *,
    without: Collection[str] = (),
    nodes: Mapping[str, Node] | None = None,
    needs: Needs | None = None,
) -> Allocations:
    """What the replicas hold (``without``: replica ids left out, to ask where a replica
    would go if they held nothing), and the ports something else holds on ``nodes``
    (``needs``: the pass's)."""
    needs = needs or Needs()
    a = Allocations()
    for replica in replicas.values():
        if replica.replica_id in without:
            continue
        for shard in replica.shards:
            a.take(
                shard.node_id,
                replica.model,
                shard.spec.gpus,
                shard.spec.port,
                # a sleeping one holds its room, but crowds no node: it serves nothing
                counts=replica.leaving is None and replica.state is not ReplicaState.SLEEPING,
                memory=needs.of_shard(catalog, shard.spec),
            )
    for node in (nodes or {}).values():  # what else holds engine ports there
        a.hold(node.node_id, node.inventory.busy_ports)
    return a


class PassPlacement:
    """What every model's placement in one pass shares, built on first use only."""

    def __init__(
        self,
        nodes: Mapping[str, Node],
        replicas: Mapping[str, Replica],
        catalog: Catalog,
        *,
        cordoned: Collection[str],
        draining: Collection[str],
        cache: PlacementCache,
    ) -> None:
        self.nodes = nodes
        self.replicas = replicas  # live: what the pass places is in it
        self.catalog = catalog
        self.cordoned = cordoned
        self.draining = draining
        self.cache = cache
        self.placed = 0  # replicas placed in this pass
        self._facts: list[NodeFacts] | None = None
        self._allocations: Allocations | None = None
        self._open: frozenset[str] | None = None
        self.needs = Needs(lambda: [n.inventory for n in nodes.values()])

    def facts(self) -> list[NodeFacts]:
        if self._facts is None:
            self._facts = [
                NodeFacts(
                    node=n, cordoned=n.node_id in self.cordoned, draining=n.node_id in self.draining
                )
                for n in self.nodes.values()
            ]
        return self._facts

    def open_nodes(self) -> frozenset[str]:
        """Nodes placement may use: Ready, neither cordoned nor draining."""
        if self._open is None:
            self._open = frozenset(
                n
                for n, node in self.nodes.items()
                if node.state is NodeState.READY and n not in self.cordoned
            )
        return self._open

    def allocations(self) -> Allocations:
        if self._allocations is None:
            self._allocations = self._allocated()
        return self._allocations

    def place(self, model: Model, now: float, without: Collection[str] = ()) -> Decision:
        """Placement over this pass's nodes, allocations (less ``without``) and needs."""
        a = self._allocated(without) if without else self.allocations()
        return place(
            model,
            self.facts(),
            a,
            now,
            avoid=frozenset(self.draining),
            cache=self.cache,
            needs=self.needs,
        )

    def fits_in_place(self, model: Model, now: float) -> bool:
        """Whether a replacement that cannot be placed would fit in what the model's
        moving replicas (a rollout, a spread) hold. Asked of placement itself, not read
        off the failure's most common reason: with two nodes cordoned and one short of
        a GPU, the reason most nodes gave is "cordoned", yet the old replica's GPU is
        all the new one needs."""
        moving = moves.forcible_by_room(self.replicas, model.name)
        if not moving:
            return False
        return self.place(model, now, without=moving).profile is not None

    def _allocated(self, without: Collection[str] = ()) -> Allocations:
        return allocated(
            self.replicas, self.catalog, without=without, nodes=self.nodes, needs=self.needs
        )

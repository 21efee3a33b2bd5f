"""Spread: which replica of a crowded model to move, and where placement would put it.

Theory of operation
-------------------
Placement spreads a model's replicas over nodes as it places them, but what
it placed stays where it is: a node uncordoned or back after a loss finds
every replica of a model still crowded on the one node that was open. A
model crowds a node when two or more of its replicas run there; the newest
of them there (an adopted one has served longest) is asked about: where
would placement put it now, if it held nothing? Placement's answer is a
move only when it is another node with at least two fewer of the model's
replicas (one fewer would only move the crowd).

The move itself (``MoveKind.SPREAD`` in ``moves.py``) is a rolling one: the
replacement is Ready before the old one drains, and it is called off if the
replacement keeps failing.

Placement costs O(nodes), and a model that cannot spread would be asked
again every pass: a model is looked at only when all its replicas serve and
the open nodes or its replicas changed since the last look (``Spreads``
remembers what it saw). Single-node replicas only: a multi-node one is
placed as a group.

This module is pure: placement is handed in as a function.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from llmgw.controlplane.moves import Relocation
from llmgw.controlplane.placement import Decision
from llmgw.controlplane.replicas import Replica, ReplicaState


class Spreads:
    """Per model, the open nodes and its replicas when a spread was last looked at."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    def forget_all_but(self, models: Collection[str]) -> None:
        """Models that left the catalog are forgotten."""
        for model in [m for m in self._seen if m not in models]:
            del self._seen[model]

    def relocation(
        self,
        model: str,
        wanted: int,
        counting: Sequence[Replica],
        open_nodes: Callable[[], frozenset[str]],
        place: Callable[[Collection[str]], Decision],
    ) -> Relocation | None:
        """A replica to move, where to and how crowded its node is, when the model's
        ``counting`` replicas crowd one node and placement (``place``, asked where a
        replica would go without the ones named) would now put one elsewhere with at
        least two fewer of them."""
        if (
            wanted < 2
            or len(counting) < 2
            or any(r.state is not ReplicaState.READY or r.world_size != 1 for r in counting)
        ):
            return None
        seen = (open_nodes(), frozenset(r.replica_id for r in counting))
        if self._seen.get(model) == seen:
            return None
        self._seen[model] = seen
        per_node: dict[str, int] = {}
        for r in counting:
            per_node[r.nodes[0]] = per_node.get(r.nodes[0], 0) + 1
        crowded, most = max(per_node.items(), key=lambda kv: (kv[1], kv[0]))
        if most < 2:
            return None
        # the newest there goes: an adopted one has served longest
        replica = max(
            (r for r in counting if r.nodes[0] == crowded),
            key=lambda r: (not r.adopted, r.created_at, r.replica_id),
        )
        decision = place({replica.replica_id})
        if decision.profile is None or len(decision.shards) != 1:
            return None
        target = decision.shards[0].node_id
        if per_node.get(target, 0) + 2 > most:
            return None
        return Relocation(replica, target, most)

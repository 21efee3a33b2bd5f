"""Placement's filters: what it reads of each node, and why a node does not fit, in words.

``placement.place`` asks every node, for every profile it tries, the same
questions in the same order (its module docstring lists them); this module
holds what those questions are asked of and the answers' words.

What a node is. ``NodeView`` is what placement reads from one inventory: its
fabric and labels, the engines installed, the healthy GPUs and each card's
memory, the weights it holds (by name and by path, and which of them are on
shared storage), its memory, and the engine ports the agent allows. It is
derived once per inventory object and kept in a ``PlacementCache`` that the
caller owns across passes; checked by identity, so never stale. A heartbeat
that replaced only the memory reading updates the view in place instead of
reading the rest again, and nodes that left the fleet are forgotten once they
are many.

What a refusal says. Each filter answers None (passes) or a ``Refusal``: a
``Kind`` and the words. The kind is the fixed word code counts (the
placement-failure metric's reason label, ``placement.failure_kind``); the
words are for the operator, so nothing parses them. The words are built to
be cheap in a busy fleet, where most nodes are full and each pass asks them
again for every replica it places: the fixed refusals are constants, the
memory reason is cached by its numbers, and a node's GPU reason is remembered
on its view per (GPUs needed, GPUs in use). What a node has is rounded down
and what is needed up, so a shortfall never reads as enough.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Sequence
from enum import StrEnum

import attrs

from llmgw.controlplane.memory import MIB, gib, gib_up
from llmgw.controlplane.nodes import Node, NodeState
from llmgw.protocol.messages import Gpu, Inventory


@attrs.frozen
class NodeFacts:
    """What placement needs about one node."""

    node: Node
    cordoned: bool = False
    draining: bool = False


class Kind(StrEnum):
    """What a candidate is, as one of a few fixed words (the placement-failure metric's
    reason label): it fits, or the filter it failed."""

    FITS = "fits"
    UNREACHABLE = "unreachable"  # not Ready: Unreachable or Lost
    CORDONED = "cordoned"
    DRAINING = "draining"  # draining, or a replica is being moved off it
    SELECTOR = "selector"  # lacks a label the profile needs (a fabric label included)
    ENGINE = "engine"
    MEMORY = "memory"
    GPUS = "gpus"
    PORTS = "ports"
    FABRIC = "fabric"  # its fabric has too few fitting nodes
    DISK = "disk"  # its last fetch of the profile's weights found no room on its disk


# the failures that are want of room (what replicas already hold), not of a fitting node
ROOM = frozenset({Kind.GPUS.value, Kind.MEMORY.value, Kind.PORTS.value})


class NodeView:
    """What placement reads from one inventory, derived once per inventory object."""

    __slots__ = (
        "fabric",
        "fetching",
        "gpu_mib",
        "gpu_reasons",
        "gpus",
        "healthy",
        "healthy_set",
        "held",
        "held_paths",
        "held_sources",
        "installed",
        "inv",
        "labels",
        "memory",
        "no_room",
        "port_range",
        "shared",
    )

    def __init__(self, inv: Inventory) -> None:
        self.inv = inv
        self.fabric = inv.fabric
        self.labels = inv.labels
        self.memory = inv.memory.total_bytes
        self.installed = frozenset(e.name for e in inv.engines)
        self.healthy_set = frozenset(g.index for g in inv.gpus if g.healthy)
        self.healthy = sorted(self.healthy_set)
        # (index, "GPU 2 unhealthy: pending retired pages" or ""), by index
        self.gpus = [(g.index, _unhealthy(g)) for g in sorted(inv.gpus, key=_index)]
        self.gpu_mib = {g.index: g.memory_total_mib for g in inv.gpus}
        self.held = frozenset(c.model for c in inv.weights)
        self.held_paths = frozenset(posixpath.normpath(c.path) for c in inv.weights)
        self.held_sources = frozenset(c.source for c in inv.weights if c.source)
        self.fetching = frozenset(f.source for f in inv.fetching)
        self.no_room = frozenset(inv.weights_no_room)
        # storage the agent could not classify is local, never shared
        self.shared = frozenset(c.model for c in inv.weights if c.storage == "shared")
        self.gpu_reasons: dict[tuple[int, frozenset[int]], str] = {}
        # the agent says which ports its engines may use; older agents say nothing
        pr = inv.port_range
        self.port_range: tuple[int, int] | None = (pr[0], pr[1]) if len(pr) == 2 else None

    def gpu_reason(self, need: int, used: set[int] | None) -> str:
        """Why too few GPUs are free, remembered: in a busy fleet most nodes are full,
        and each pass asks the same question of them for every replica it places."""
        key = (need, frozenset(used) if used else frozenset())
        reason = self.gpu_reasons.get(key)
        if reason is None:
            if len(self.gpu_reasons) >= 32:
                self.gpu_reasons.clear()
            reason = self.gpu_reasons[key] = _gpu_reason(need, self, used)
        return reason


def _index(gpu: Gpu) -> int:
    return gpu.index


def _unhealthy(gpu: Gpu) -> str:
    if gpu.healthy:
        return ""
    problems = ", ".join(gpu.problems)
    return f"GPU {gpu.index} unhealthy" + (f": {problems}" if problems else "")


class PlacementCache:
    """What placement read from each node's inventory, while that inventory object is
    current. Derived data only (checked by identity, so never stale): a caller that
    keeps one across its passes has each inventory read once, not once a pass, even
    though every pass builds fresh NodeFacts."""

    def __init__(self) -> None:
        self._statics: dict[str, NodeView] = {}  # node id -> its inventory, as read

    def static(self, node: Node) -> NodeView:
        inv = node.inventory
        cached = self._statics.get(node.node_id)
        if cached is not None and cached.inv is not inv:
            old = cached.inv
            if (
                old.gpus is inv.gpus
                and old.engines is inv.engines
                and old.weights is inv.weights
                and old.labels is inv.labels
                and old.fabric == inv.fabric
                and old.port_range is inv.port_range
            ):  # a heartbeat replaced only the memory reading
                cached.inv = inv
                cached.memory = inv.memory.total_bytes
            else:
                cached = None
        if cached is None:
            cached = self._statics[node.node_id] = NodeView(inv)
        return cached

    def prune(self, nodes: Sequence[NodeFacts]) -> None:
        """Forget nodes that left the fleet, once they are many."""
        if len(self._statics) > 2 * len(nodes) + 64:
            keep = {f.node.node_id for f in nodes}
            for node_id in [n for n in self._statics if n not in keep]:
                del self._statics[node_id]


# a filter's verdict: its kind and its words
Refusal = tuple[Kind, str]
_CORDONED: Refusal = (Kind.CORDONED, "cordoned")
_DRAINING: Refusal = (Kind.DRAINING, "draining")
_MOVING_OFF: Refusal = (Kind.DRAINING, "being moved off this node")


def unavailable(facts: NodeFacts, avoid: frozenset[str]) -> Refusal | None:
    """Why no profile may use this node now (not Ready, cordoned, draining, being moved
    off); None: it is open to placement."""
    node = facts.node
    if node.state is not NodeState.READY:
        return Kind.UNREACHABLE, str(node.state.value)
    if facts.cordoned:
        return _CORDONED
    if facts.draining:
        return _DRAINING
    if node.node_id in avoid:
        return _MOVING_OFF
    return None


def hardware(
    st: NodeView,
    selector: list[tuple[str, str]],
    required: tuple[str, ...],
    multi: bool,
) -> Refusal | None:
    """Why this node cannot run the profile, short of memory, GPUs and ports; None: it can."""
    if multi and not st.fabric:
        return Kind.SELECTOR, "multi-node profile needs a fabric label"
    if selector:
        labels = st.labels
        for label, value in selector:
            have = labels.get(label)
            if have is None:
                return Kind.SELECTOR, f"label {label}={value} required, node has no label {label}"
            if have != value:
                return Kind.SELECTOR, f"label {label}={value} required, node has {label}={have}"
    installed = st.installed
    if not installed.issuperset(required):
        missing = " and ".join(e for e in required if e not in installed)
        return Kind.ENGINE, f"{missing} not installed"
    return None


@functools.lru_cache(maxsize=1024)  # a full fleet's nodes say the same few things
def memory_reason(total: int, held: int, by: int, need: int) -> str:
    """ "has 8 GiB of memory, needs 24 GiB", or when the shards there already are why
    "has 32 GiB, 24 GiB held by 1 replica, needs 24 GiB" (what a node has rounded down,
    what is needed up, so a shortfall never reads as enough)."""
    if not held or total < need:  # it would not fit on the node empty either
        return f"has {gib(total)} GiB of memory, needs {gib_up(need)} GiB"
    return (
        f"has {gib(total)} GiB, {gib_up(held)} GiB held by {by} replica{'' if by == 1 else 's'}, "
        f"needs {gib_up(need)} GiB"
    )


def cards_short(st: NodeView, need: int, used: set[int] | None, need_bytes: int) -> str:
    """Why the cards a shard would get (the lowest free healthy ones, as placement
    picks them) cannot hold what its engine puts on them; "" when they can, or when a
    card does not say its memory."""
    cards = [i for i in st.healthy if not used or i not in used][:need]
    sizes = [st.gpu_mib.get(i) for i in cards]
    if not cards or any(s is None for s in sizes):
        return ""
    have = sum(s or 0 for s in sizes) * MIB
    if have >= need_bytes:
        return ""
    which = f"GPU {cards[0]} has" if len(cards) == 1 else f"GPUs {', '.join(map(str, cards))} have"
    return f"{which} {gib(have)} GiB of memory, needs {gib_up(need_bytes)} GiB on them"


def _gpu_reason(need: int, st: NodeView, used: set[int] | None) -> str:
    plural = "" if need == 1 else "s"
    if not st.gpus:
        return f"needs {need} GPU{plural}, has none"
    notes: list[str] = []
    in_use: list[int] = []
    free = 0
    for index, unhealthy in st.gpus:
        if unhealthy:
            notes.append(unhealthy)
        elif used and index in used:
            in_use.append(index)
        else:
            free += 1
    if in_use:
        many = len(in_use) > 1
        notes.append(f"GPU{'s' if many else ''} {', '.join(map(str, in_use))} in use")
    detail = f" ({'; '.join(notes)})" if notes else ""
    return f"needs {need} GPU{plural}, has {free} free{detail}"

"""The node table and node liveness, as pure code over an explicit clock.

Liveness: a node is Ready while its stream is up and it heartbeats; it is
Unreachable as soon as its stream drops or it has been silent for
``unreachable_after``; it is Lost once silent for ``lost_after`` (connected
or not). Both bounds are finite, so no node stays in limbo. The stream layer
calls ``register``/``heartbeat``/``disconnected``; a periodic ``sweep`` moves
silent nodes along. Each returns the changes it made, for logs and metrics.

A control plane that restarts knows, from its state directory, which nodes
were in its fleet before (``expect``): each is in the table from the start,
Unreachable and ``awaited`` until it registers, and Lost once silent for
``lost_after`` counted from that start, as any other node.

``now`` is a monotonic clock (trio's); ``wall`` is the wall clock, kept only
for display ("last seen 3 s ago" must survive a reader on another machine).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

import attrs
import msgspec

from llmgw.addr import join_hostport
from llmgw.protocol.messages import Heartbeat, Inventory


class NodeState(StrEnum):
    READY = "Ready"
    UNREACHABLE = "Unreachable"
    LOST = "Lost"


@attrs.frozen
class LivenessPolicy:
    unreachable_after: float
    lost_after: float


@attrs.frozen
class Change:
    node_id: str
    old: NodeState | None  # None: first seen
    new: NodeState
    why: str


@attrs.define
class Node:
    node_id: str
    inventory: Inventory
    peer: str  # where its stream came from
    connection: int  # generation of the stream that owns this node now
    connected: bool
    state: NodeState
    last_seen: float
    last_seen_wall: float
    registered_at_wall: float
    last_heartbeat_seq: int = -1
    agent_version: str = ""  # as its agent said at registration ("0.1.0 (build …)")
    metrics_address: str = ""  # its agent's metrics listener, as said at registration
    can: frozenset[str] = frozenset()  # what its agent does beyond the base ("sleep")
    # known from before this control plane started, and not registered with it since
    awaited: bool = False

    @property
    def metrics_target(self) -> str:
        """Where Prometheus reaches its agent's metrics: a wildcard host is the node's
        address; empty when the agent serves none."""
        if not self.metrics_address:
            return ""
        host, _, port = self.metrics_address.rpartition(":")
        host = host.strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = self.address
        return join_hostport(host, int(port))

    @property
    def address(self) -> str:
        return self.inventory.address or self.peer.rsplit(":", 1)[0].strip("[]")


def liveness(node: Node, now: float, policy: LivenessPolicy) -> tuple[NodeState, str]:
    silent = now - node.last_seen
    if silent >= policy.lost_after:
        return NodeState.LOST, f"silent for {silent:.0f} s (lost after {policy.lost_after:g} s)"
    if not node.connected:
        return NodeState.UNREACHABLE, "agent stream closed"
    if silent >= policy.unreachable_after:
        return (
            NodeState.UNREACHABLE,
            f"no heartbeat for {silent:.1f} s (unreachable after {policy.unreachable_after:g} s)",
        )
    return NodeState.READY, "heartbeating"


def awaited(nodes: Iterable[Node]) -> list[str]:
    """The nodes known from before this control plane started that have neither come
    back nor been declared Lost: until then, what they run is not known."""
    return sorted(n.node_id for n in nodes if n.awaited and n.state is not NodeState.LOST)


def inventory_changes(old: Inventory, new: Inventory) -> list[str]:
    """What changed that an operator would want to read about, in words."""
    out: list[str] = []
    before = {e.name: e.version for e in old.engines}
    after = {e.name: e.version for e in new.engines}
    for name, version in after.items():
        if name not in before:
            out.append(f"now has {name} {version}".rstrip())
        elif before[name] != version:
            out.append(f"now has {name} {version} (was {before[name]})")
    out.extend(f"no longer has {name}" for name in before.keys() - after.keys())
    if old.memory.total_bytes != new.memory.total_bytes and new.memory.total_bytes is not None:
        out.append(f"now has {new.memory.total_bytes / 2**30:.1f} GiB of memory")
    if len(old.gpus) != len(new.gpus):
        out.append(f"now has {len(new.gpus)} GPUs (was {len(old.gpus)})")
    if old.labels != new.labels:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(new.labels.items()))
        out.append(f"now has labels {labels or 'none'}")
    if old.fabric != new.fabric:
        out.append(f"now is on fabric {new.fabric or 'none'}")
    if old.busy_ports != new.busy_ports:
        out.append(_busy_words(new.busy_ports))
    return out


def _busy_words(ports: list[int]) -> str:
    if not ports:
        return "has no engine port held by a process it does not run any more"
    return (
        f"has engine ports held by processes it does not run: {', '.join(map(str, ports))}; "
        "nothing is placed on them (ctl nodes says who holds them)"
    )


@attrs.define
class NodeTable:
    policy: LivenessPolicy
    nodes: dict[str, Node] = attrs.Factory(dict)

    def register(
        self,
        node_id: str,
        inventory: Inventory,
        *,
        peer: str,
        connection: int,
        now: float,
        wall: float,
    ) -> tuple[list[Change], list[str]]:
        """A node registered on a fresh stream; returns state changes and inventory news."""
        node = self.nodes.get(node_id)
        news: list[str] = []
        if node is None:
            node = Node(
                node_id=node_id,
                inventory=inventory,
                peer=peer,
                connection=connection,
                connected=True,
                state=NodeState.READY,
                last_seen=now,
                last_seen_wall=wall,
                registered_at_wall=wall,
            )
            self.nodes[node_id] = node
            if inventory.busy_ports:
                news.append(_busy_words(inventory.busy_ports))
            return [Change(node_id, None, NodeState.READY, "registered")], news
        # a node known from before has no inventory here yet: nothing to compare
        news = [] if node.awaited else inventory_changes(node.inventory, inventory)
        node.inventory = inventory
        node.peer = peer
        node.connection = connection
        node.connected = True
        node.last_seen = now
        node.last_seen_wall = wall
        node.registered_at_wall = wall
        node.last_heartbeat_seq = -1
        node.awaited = False
        return self._set(node, NodeState.READY, "registered"), news

    def expect(self, node_ids: Iterable[str], *, now: float, wall: float) -> list[str]:
        """Nodes known from before a restart: in the table, Unreachable and awaited,
        silent from ``now`` on (Lost ``lost_after`` later unless they register).
        Returns those added (a node already in the table is left as it is)."""
        added = []
        for node_id in node_ids:
            if node_id in self.nodes:
                continue
            self.nodes[node_id] = Node(
                node_id=node_id,
                inventory=Inventory(),
                peer="",
                connection=0,
                connected=False,
                state=NodeState.UNREACHABLE,
                last_seen=now,
                last_seen_wall=wall,
                registered_at_wall=0.0,
                awaited=True,
            )
            added.append(node_id)
        return added

    def heartbeat(
        self, node_id: str, connection: int, hb: Heartbeat, *, now: float, wall: float
    ) -> tuple[list[Change], list[str]]:
        node = self.nodes.get(node_id)
        if node is None or node.connection != connection or not node.connected:
            return [], []  # from a stream that has since closed or been replaced
        node.last_seen = now
        node.last_seen_wall = wall
        node.last_heartbeat_seq = hb.seq
        inventory = hb.inventory if hb.inventory is not None else node.inventory
        if hb.memory.total_bytes is not None or hb.memory.available_bytes is not None:
            inventory = msgspec.structs.replace(inventory, memory=hb.memory)
        if hb.fetching is not None and hb.inventory is None:  # the latest figures
            inventory = msgspec.structs.replace(inventory, fetching=hb.fetching)
        news: list[str] = []
        if inventory != node.inventory:
            news = inventory_changes(node.inventory, inventory)
            node.inventory = inventory
        return self._set(node, NodeState.READY, "heartbeating"), news

    def disconnected(self, node_id: str, connection: int, *, now: float) -> list[Change]:
        node = self.nodes.get(node_id)
        if node is None or node.connection != connection:
            return []
        node.connected = False
        state, why = liveness(node, now, self.policy)
        return self._set(node, state, why)

    def sweep(self, now: float) -> list[Change]:
        changes: list[Change] = []
        for node in self.nodes.values():
            if node.state is NodeState.LOST:
                continue
            state, why = liveness(node, now, self.policy)
            if state is not node.state:
                changes.extend(self._set(node, state, why))
        return changes

    def counts(self) -> dict[NodeState, int]:
        out = dict.fromkeys(NodeState, 0)
        for node in self.nodes.values():
            out[node.state] += 1
        return out

    @staticmethod
    def _set(node: Node, state: NodeState, why: str) -> list[Change]:
        if node.state is state:
            return []
        old, node.state = node.state, state
        return [Change(node.node_id, old, state, why)]


def scrape_targets(
    nodes: Iterable[Node],
    server: str,
    engines: Iterable[tuple[str, str, str, str]] = (),
    routers: Iterable[str] = (),
) -> list[dict[str, object]]:
    """Prometheus HTTP service discovery (``http_sd_configs``): this control plane's
    own metrics listener (``server``: host:port, an address to reach it at; left out
    when it is still a wildcard, which names none), every agent that serves metrics on a node that is
    not Lost, labelled by role and node, and each engine in ``engines`` (node, model,
    replica, shard), read through its agent, which holds the engine's key, and each
    standalone router's metrics listener in ``routers`` (host:port)."""
    reachable = {n.node_id: n for n in nodes if n.metrics_target and n.state is not NodeState.LOST}
    groups: list[dict[str, object]] = []
    if server and not server.startswith(("0.0.0.0:", "[::]:")):
        groups.append({"targets": [server], "labels": {"llmgw_role": "server"}})
    for node_id in sorted(reachable):
        groups.append(
            {
                "targets": [reachable[node_id].metrics_target],
                "labels": {"llmgw_role": "agent", "node": node_id},
            }
        )
    for node_id, model, replica, shard in engines:
        node = reachable.get(node_id)
        if node is None:
            continue
        groups.append(
            {
                "targets": [node.metrics_target],
                "labels": {
                    "llmgw_role": "engine",
                    "node": node_id,
                    "model": model,
                    "replica": replica,
                    "__metrics_path__": f"/engines/{shard}/metrics",
                },
            }
        )
    for router in routers:
        groups.append({"targets": [router], "labels": {"llmgw_role": "router"}})
    return groups

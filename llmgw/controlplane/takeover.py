"""Whether a registration may take a node's stream over: pure code over what is known.

One stream per node, and a newer one used to replace the older at once. With
two agents for one node (a copied certificate on a second host, a second agent
on the same host in another network namespace) that was a fight: each
reconnect replaced the other, tens of times a minute, and each agent, accepted
in turn, killed the other's engines as strays. So a registration for a node
whose stream is live (heard from within ``bound_s``, the unreachable timeout)
is refused, and the live one keeps the node. A genuine reconnect still wins at
once: the same agent process (``Register.agent_instance``, random per process,
equal), or a stream gone silent past the bound (its agent died with its host,
or lost its network). An agent too old to send an instance cannot be told
from the node's own, so its registration wins as before.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class LiveStream:
    """What the control plane knows of a node's current stream."""

    peer: str  # where it comes from, host:port
    instance: str  # its agent's ``agent_instance`` ("" from an older agent)
    silent_s: float  # since anything was last heard on it


def refusal(node_id: str, current: LiveStream | None, instance: str, bound_s: float) -> str | None:
    """Why a registration from agent ``instance`` must be refused, in words; None when it
    wins (replacing ``current``, if any)."""
    if current is None or not instance or not current.instance:
        return None
    if instance == current.instance or current.silent_s >= bound_s:
        return None
    return f"node {node_id} is already connected from {current.peer}, and heartbeating"


def close_reason(node_id: str, current: LiveStream) -> str:
    """The close frame's reason (at most 123 bytes: the node id is left out when long)."""
    reason = f"node {node_id} is live from {current.peer}; stop the second agent for it"
    if len(reason.encode()) <= 123:
        return reason
    return f"this node is live from {current.peer}; stop the second agent for it"

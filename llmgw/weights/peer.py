"""Weights between the agents of a fleet: a node takes a file from the nodes that
hold it, or are fetching it, instead of from its source.

Theory of operation
-------------------
Three pieces, each in its own module:

- ``chunks``: a file's manifest, the sha256 of each of its chunks, kept
  beside it, and beside a ``.part`` a peer fetch fills;
- ``peerserve``: the agent's transfer listener (``PeerServer``), serving over
  mutual TLS the manifests and the checked chunks of what the node holds,
  whole or still being fetched;
- ``peerfetch``: the taker (``fetch_from_peer``), into the same ``.part`` and
  to the same landed file and record as a fetch from the source.

``peerwire`` is what the two say to each other, and how each knows the other
is an agent of the fleet (``PeerTrust``). The bytes go from agent to agent;
the control plane only says who takes from whom.
"""

from __future__ import annotations

from llmgw.weights.peerfetch import Peer, fetch_from_peer
from llmgw.weights.peerserve import PeerServer, ServeLimits
from llmgw.weights.peerwire import PeerRefused, PeerTrust

__all__ = ["Peer", "PeerRefused", "PeerServer", "PeerTrust", "ServeLimits", "fetch_from_peer"]

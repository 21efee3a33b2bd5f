"""Protocol version negotiation, carried in the WebSocket subprotocol name.

The version lives in the subprotocol so that a mismatch is refused during the
HTTP upgrade, before either side decodes a single message it might misread.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.protocol.errors import VersionMismatch

PROTOCOL_VERSION = 1
SUBPROTOCOL = f"llmgw.agent.v{PROTOCOL_VERSION}"
_PREFIX = "llmgw.agent.v"


def negotiate(offered: Iterable[str]) -> str:
    """Pick our subprotocol from what the agent offered.

    Raises:
        VersionMismatch: the agent offered no version this side speaks; the
            reason names both so the operator knows which side to upgrade.
    """
    offered = list(offered)
    if SUBPROTOCOL in offered:
        return SUBPROTOCOL
    ours = [p for p in offered if p.startswith(_PREFIX)]
    if ours:
        what = ", ".join(ours)
        return _refuse(f"agent speaks {what}; this control plane speaks {SUBPROTOCOL}")
    what = ", ".join(offered) if offered else "no subprotocol"
    return _refuse(f"agent offered {what}; this control plane speaks {SUBPROTOCOL}")


def _refuse(reason: str) -> str:
    raise VersionMismatch(reason)

"""InfiniBand adapters and port states from /sys/class/infiniband.

Which fabric an adapter is on cannot be found out (OpenSM's default subnet
prefix is the same on every fabric), so the fabric label comes from the
agent's configuration and is attached here, to travel with the inventory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from llmgw.protocol.messages import IbAdapter, IbPort

SYS_INFINIBAND = Path("/sys/class/infiniband")
MAX_ADAPTERS = 64
MAX_PORTS = 16


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _state(text: str) -> str:
    """'4: ACTIVE' -> 'ACTIVE'."""
    return text.split(":", 1)[-1].strip() if text else ""


def read_adapters(
    root: Path = SYS_INFINIBAND, fabrics: Mapping[str, str] | None = None
) -> list[IbAdapter]:
    """Every adapter under ``root``; a missing directory means none (not an error)."""
    fabrics = fabrics or {}
    try:
        names = sorted(p.name for p in root.iterdir())[:MAX_ADAPTERS]
    except OSError:
        return []
    adapters = []
    for name in names:
        ports = []
        try:
            port_dirs = sorted((root / name / "ports").iterdir(), key=lambda p: p.name)
        except OSError:
            port_dirs = []
        for port_dir in port_dirs[:MAX_PORTS]:
            if not port_dir.name.isdigit():
                continue
            ports.append(
                IbPort(
                    port=int(port_dir.name),
                    state=_state(_read(port_dir / "state")),
                    rate=_read(port_dir / "rate"),
                )
            )
        adapters.append(IbAdapter(name=name, ports=ports, fabric=fabrics.get(name, "")))
    return adapters

"""Memory from /proc/meminfo, read on every heartbeat."""

from __future__ import annotations

from pathlib import Path

from llmgw.protocol.messages import Memory

MEMINFO = Path("/proc/meminfo")


def parse_meminfo(text: str) -> Memory:
    """MemTotal and MemAvailable in bytes; a field that is missing stays unknown (None)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
        values[key.strip()] = int(parts[0]) * scale
    return Memory(total_bytes=values.get("MemTotal"), available_bytes=values.get("MemAvailable"))


def read_memory(path: Path = MEMINFO) -> Memory:
    try:
        return parse_meminfo(path.read_text())
    except OSError:
        return Memory()

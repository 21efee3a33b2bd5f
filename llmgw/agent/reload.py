"""What a reload of the agent's config file (SIGHUP, ``systemctl reload``) changes.

Pure code: ``plan`` compares the config the agent runs with the one just read
and says what it takes now, in words, and what waits for a restart. What is
taken is what the agent only reads as it goes: the inventory overrides
(labels, fabric, memory, ...), discovery's settings, the weights dirs, which
llama-server to report and launch, the stop grace and the log level; the
daemon applies them and runs discovery again, so the control plane hears the
new inventory on the next heartbeat. The rest (the control plane's addresses,
the certificates, the node id, the state dir, the ports, the metrics listener,
...) is wired into connections and locks made at start, and needs a restart.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgspec

from llmgw.config import AgentConfig

# sections taken whole, and keys taken alone; everything else needs a restart
RELOADABLE_SECTIONS = ("inventory", "discovery", "weights")
RELOADABLE_KEYS = ("log_level", "engines.llama_server", "engines.stop_grace_s")
# keys of those sections that are not: a listener opened at start
RESTART_KEYS = ("weights.peer_listen",)


@attrs.frozen
class Reload:
    """The config to run from now on (the file's, less what waits for a restart),
    and one line saying what changed."""

    running: AgentConfig
    taken: list[str]  # what changed and is taken now, in words
    restart: list[str]  # keys that changed and wait for a restart

    def line(self, source: str) -> str:
        taken = ", ".join(self.taken) if self.taken else "nothing to take now"
        if not self.taken and not self.restart:
            return f"reloaded {source}: nothing changed"
        out = f"reloaded {source}: {taken}"
        if self.restart:
            out += f"; {', '.join(self.restart)} changes need a restart"
        return out


def _flat(config: AgentConfig) -> dict[str, Any]:
    """Every key of a config, dotted (``engines.port_range``), with its value."""
    out: dict[str, Any] = {}
    for key, value in msgspec.to_builtins(config).items():
        if isinstance(value, dict):  # a section
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def _reloadable(key: str) -> bool:
    if key in RESTART_KEYS:
        return False
    return key in RELOADABLE_KEYS or key.split(".", 1)[0] in RELOADABLE_SECTIONS


def _words(key: str, value: Any) -> str:
    if key == "inventory.labels":
        labels = ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
        return f"labels changed ({labels or 'none'})"
    if key == "inventory.fabric":
        return f"fabric changed ({value or 'none'})"
    if key == "log_level":
        return f"log_level changed ({value})"
    return f"{key} changed"


def plan(running: AgentConfig, read: AgentConfig) -> Reload:
    """What to take from ``read`` now, and what of it waits for a restart."""
    before, after = _flat(running), _flat(read)
    changed = [k for k in after if before.get(k) != after[k]]
    taken = [_words(k, after[k]) for k in changed if _reloadable(k)]
    restart = [k for k in changed if not _reloadable(k)]
    e = read.engines
    new = msgspec.structs.replace(
        running,
        inventory=read.inventory,
        discovery=read.discovery,
        weights=msgspec.structs.replace(read.weights, peer_listen=running.weights.peer_listen),
        log_level=read.log_level,
        engines=msgspec.structs.replace(
            running.engines, llama_server=e.llama_server, stop_grace_s=e.stop_grace_s
        ),
    )
    return Reload(new, taken, restart)

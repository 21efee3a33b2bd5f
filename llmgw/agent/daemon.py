"""``llmgw agent``: resolve the configuration and keep the stream up."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import trio

from llmgw.agent.inventory import InventorySource
from llmgw.agent.stream import AgentStream, StreamSettings
from llmgw.config import AgentConfig, parse_hostport
from llmgw.config.schema import resolve
from llmgw.tls.contexts import client_context

log = logging.getLogger("llmgw.agent")


def node_id(config: AgentConfig) -> str:
    """The node id: written in config, or the hostname (the certificate's common name)."""
    return config.node_id or socket.gethostname()


def build(config: AgentConfig, base: Path) -> AgentStream:
    nid = node_id(config)
    cert = resolve(base, config.cert or f"pki/{nid}.pem")
    key = resolve(base, config.key or f"pki/{nid}-key.pem")
    ssl_context = client_context(resolve(base, config.ca), cert, key)
    addresses = [
        parse_hostport(a, key=f"control_plane[{i}]") for i, a in enumerate(config.control_plane)
    ]
    settings = StreamSettings(
        node_id=nid,
        control_plane=addresses,
        ssl_context=ssl_context,
        connect_timeout=config.connect_timeout_s,
        handshake_timeout=config.handshake_timeout_s,
        backoff_initial=config.backoff.initial_s,
        backoff_max=config.backoff.max_s,
    )
    source = InventorySource(
        config.inventory,
        addresses[0],
        discovery=config.discovery,
        weights=config.weights,
        base=base,
    )
    return AgentStream(settings, source)


async def serve(config: AgentConfig, base: Path) -> None:
    stream = build(config, base)
    log.info(
        "agent %s starting; control plane %s",
        stream.settings.node_id,
        ", ".join(config.control_plane),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(stream.source.run)
        inv = stream.source.inventory()
        log.info(
            "discovered: %d GPUs, %s of memory, engines: %s, %d weight copies",
            len(inv.gpus),
            f"{inv.memory.total_bytes / 2**30:.1f} GiB" if inv.memory.total_bytes else "unknown",
            ", ".join(f"{e.name} {e.version}".strip() for e in inv.engines) or "none",
            len(inv.weights),
        )
        await stream.run()

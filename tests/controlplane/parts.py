"""What the control plane's tests are given: a catalog of one small model, and node
tables whose nodes registered at time 0."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.controlplane.nodes import LivenessPolicy, NodeTable
from llmgw.protocol.messages import Engine, Gpu, Inventory, Memory

TINY = """
[models.tiny]
replicas = 1
[[models.tiny.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/models/tiny.gguf"
startup_timeout_s = 60
"""


def node_table(inventories: Mapping[str, Inventory]) -> NodeTable:
    """Each node registered at time 0 with its inventory, in the order given, each over
    a connection of its own from 10.0.0.1, 10.0.0.2, ... (its address, unless its
    inventory says one)."""
    table = NodeTable(LivenessPolicy(15, 60))
    for i, (node, inventory) in enumerate(inventories.items()):
        table.register(node, inventory, peer=f"10.0.0.{i + 1}:1", connection=i, now=0, wall=0)
    return table


def fleet(*names: str, gpus: int = 0, memory_gb: int = 64) -> NodeTable:
    """Alike nodes, each with ``gpus`` GPUs, ``memory_gb`` of memory, llama.cpp and vLLM."""
    return node_table(
        {
            name: Inventory(
                memory=Memory(total_bytes=memory_gb << 30),
                gpus=[Gpu(index=g, name="H100") for g in range(gpus)],
                engines=[
                    Engine(name="llama.cpp", version="b1"),
                    Engine(name="vllm", version="0.11"),
                ],
            )
            for name in names
        }
    )

"""Engine adapters: llama.cpp's llama-server, vLLM, and multi-node vLLM over Ray.

``adapters()`` is where everyone finds them: the agent to launch and health-check
an engine, the router to read its load gauges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.engines.base import EngineAdapter


def adapters() -> dict[str, EngineAdapter]:
    """Every engine adapter, by the name a profile's ``engine`` gives."""
    from llmgw.engines.llamacpp import LLAMA_CPP
    from llmgw.engines.vllm import VLLM, VLLM_RAY

    return {a.name: a for a in (LLAMA_CPP, VLLM, VLLM_RAY)}

"""What one shard of a profile holds in memory, as its engine's adapter reckons it.

Placement (``llmgw.controlplane.memory``) subtracts what the shards on a node
need from what the node has; where a profile does not say its need
(``min_memory_gb``), the adapter's ``sizing`` estimates it from the profile and
the weights a node reports, in bytes and in words, and says how many tokens of
prompts a replica can keep (what the router's affinity weighs a replica's cache
by). An engine without ``sizing`` is not counted: an unknown is not a zero.

Pure: no I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from llmgw.protocol.messages import WeightCopy

GIB = 2**30
MIB = 2**20


@attrs.frozen
class Shape:
    """A profile as its engine is given it, before it is placed: its settings,
    environment and arguments, and the GPUs of one shard."""

    settings: Mapping[str, str | int | float | bool]
    env: Mapping[str, str]
    engine_args: Sequence[str]
    gpus: int


@attrs.frozen
class Need:
    """What one shard needs: ``host`` bytes of its node's memory (None: not known, and
    not counted), ``gpu`` bytes of memory on its cards together (None: none, or not
    known), and how that was reckoned, in words."""

    host: int | None
    gpu: int | None
    words: str


class Sizing(Protocol):
    def need(self, shape: Shape, weights: WeightCopy | None) -> Need:
        """What one shard holds; ``weights``: the copy of its weights a node reports."""
        ...

    def cache_tokens(self, shape: Shape, weights: WeightCopy | None) -> int | None:
        """Tokens of prompts a replica can keep for reuse; None when not known."""
        ...


@functools.lru_cache(maxsize=4096)  # placement says the same few sizes of every node
def gib(n: float) -> str:
    """Bytes as GiB, one decimal, rounded down (what a node has): "8", "7.7"."""
    shown = math.floor(n / GIB * 10) / 10
    return f"{shown:.1f}".removesuffix(".0")


@functools.lru_cache(maxsize=4096)
def gib_up(n: float) -> str:
    """Bytes as GiB, one decimal, rounded up (what is needed), so that a shortfall
    never reads as enough: "has 24 GiB, needs 24.1 GiB"."""
    shown = math.ceil(round(n / GIB * 10, 6)) / 10
    return f"{shown:.1f}".removesuffix(".0")

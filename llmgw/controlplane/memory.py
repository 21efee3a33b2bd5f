"""What one shard of a replica needs of its node's memory, reckoned before it is placed.

Placement subtracts what the shards already on a node need from the memory
the node has, so that two 24 GiB replicas do not land on a 32 GiB node; this
module says what a shard needs, and in what words.

A profile's ``min_memory_gb`` is its need, when set: what is written wins.
Otherwise its engine's adapter estimates it (``sizing``; llama.cpp's from
what llama-server will hold: weights, KV cache and prompt cache, see
``llmgw.engines.llamacpp_memory``), from the weights a node reports.

An unknown is not a zero: what cannot be known (weights no node reports, an
engine that does not estimate, e.g. a vLLM profile without ``min_memory_gb``)
is not counted, and the words say what was left out; what is known is still
counted.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable

from llmgw import engines
from llmgw.controlplane.catalog import Catalog, Model, Profile
from llmgw.engines.sizing import GIB as GIB
from llmgw.engines.sizing import MIB as MIB
from llmgw.engines.sizing import Need as Need
from llmgw.engines.sizing import Shape
from llmgw.engines.sizing import gib as gib
from llmgw.engines.sizing import gib_up as gib_up
from llmgw.protocol.messages import Inventory, ShardSpec, WeightCopy


def shape(profile: Profile) -> Shape:
    """The profile as its engine's adapter reckons it."""
    return Shape(
        settings=profile.settings,
        env=profile.env,
        engine_args=profile.engine_args,
        gpus=profile.gpus,
    )


def need(profile: Profile, weights: WeightCopy | None) -> Need:
    """What one shard of ``profile`` needs; ``weights``: the copy of its weights a node
    reports, if any."""
    sizing = engines.sizing(profile.engine)
    estimate = sizing.need(shape(profile), weights) if sizing is not None else None
    if profile.min_memory_gb is not None:
        host = int(profile.min_memory_gb * GIB)
        return Need(host, estimate.gpu if estimate else None, f"{gib_up(host)} GiB (min_memory_gb)")
    if estimate is None:
        return Need(None, None, f"not known: {profile.engine} without min_memory_gb")
    return estimate


def cache_tokens(profile: Profile, weights: WeightCopy | None) -> int | None:
    """Tokens of prompts a replica of ``profile`` can keep: what its engine's adapter
    says (llama.cpp: its context and what its prompt cache holds); None when not known
    (an engine that does not say, the model's shape not reported, a prompt cache
    without a limit)."""
    sizing = engines.sizing(profile.engine)
    return sizing.cache_tokens(shape(profile), weights) if sizing is not None else None


class Needs:
    """Each profile's need in one pass, with the weights the nodes report found once.

    ``inventories`` gives every node's inventory when first needed (a Lost node's
    copies still describe the file). The same file is reported by every node that
    holds it; the copy at a profile's ``model_path`` is preferred over one under its
    weights name, a copy that says its KV shape over one that does not, and then
    the largest."""

    def __init__(self, inventories: Callable[[], Iterable[Inventory]] = tuple) -> None:
        self._inventories = inventories
        self._by_path: dict[str, WeightCopy] | None = None
        self._by_name: dict[str, WeightCopy] = {}
        self._needs: dict[tuple[str, str], Need] = {}
        self._shards: dict[tuple[str, str], int | None] = {}  # (model, profile) -> host

    def _index(self) -> tuple[dict[str, WeightCopy], dict[str, WeightCopy]]:
        if self._by_path is None:
            self._by_path = {}
            for inv in self._inventories():
                for copy in inv.weights:
                    path = posixpath.normpath(copy.path)
                    if _better(copy, self._by_path.get(path)):
                        self._by_path[path] = copy
                    if _better(copy, self._by_name.get(copy.model)):
                        self._by_name[copy.model] = copy
        return self._by_path, self._by_name

    def weights(self, model: Model, profile: Profile) -> WeightCopy | None:
        by_path, by_name = self._index()
        path = model.weights_path(profile)
        return (by_path.get(path) if path else None) or by_name.get(model.weights_name(profile))

    def of(self, model: Model, profile: Profile) -> Need:
        key = (model.name, profile.name)
        found = self._needs.get(key)
        if found is None:
            copy = self.weights(model, profile) if engines.sizing(profile.engine) else None
            found = self._needs[key] = need(profile, copy)
        return found

    def cache_tokens(self, model: Model, profile: Profile) -> int | None:
        """``cache_tokens`` of ``profile``, with the weights the nodes report (looked
        for only where its engine reckons with them)."""
        if engines.sizing(profile.engine) is None:
            return None
        return cache_tokens(profile, self.weights(model, profile))

    def of_shard(self, catalog: Catalog, spec: ShardSpec) -> int | None:
        """Host bytes a running shard holds: its profile's need, or, for a profile that
        left the catalog, what its own spec says (its model_path, settings, args)."""
        key = (spec.model, spec.profile)
        if key in self._shards:  # asked of every shard of every replica on each pass
            return self._shards[key]
        host = self._shards[key] = self._of_shard(catalog, spec)
        return host

    def _of_shard(self, catalog: Catalog, spec: ShardSpec) -> int | None:
        model = catalog.models.get(spec.model)
        profile = model.profile(spec.profile) if model is not None else None
        if model is not None and profile is not None:
            return self.of(model, profile).host
        gone = Profile(
            name=spec.profile,
            engine=spec.engine,
            gpus=len(spec.gpus),
            model_path=spec.model_path,
            engine_args=list(spec.engine_args),
            settings=dict(spec.settings),
            env=dict(spec.env),
        )
        return need(gone, self.weights(Model(name=spec.model), gone)).host


def _better(copy: WeightCopy, than: WeightCopy | None) -> bool:
    if than is None:
        return True
    return (copy.kv_k_per_token is not None, copy.size_bytes or 0) > (
        than.kv_k_per_token is not None,
        than.size_bytes or 0,
    )

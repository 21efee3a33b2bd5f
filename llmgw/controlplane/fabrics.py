"""Which fabric holds which model weights, and on what storage.

Fabrics are not connected to one another: weights in ib-a are not weights in
ib-b (the only path between them is the management network). So the question
is asked per fabric, and one shared filer seen from twenty nodes counts once,
the same as any number of local copies: "can this fabric serve it".
Storage the agent could not classify counts as local, never as shared: local
read as shared would make a model look present everywhere when it is on one
node.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

import msgspec

from llmgw.controlplane.nodes import Node, NodeState

NO_FABRIC = ""


class ModelCopies(msgspec.Struct, kw_only=True):
    model: str
    shared: list[str]  # storage ids of shared filesystems holding it
    local_nodes: list[str]  # nodes holding a local (or unclassified) copy
    nodes: list[str]  # every node in the fabric that can read it


class FabricStatus(msgspec.Struct, kw_only=True):
    fabric: str
    nodes: list[str]
    models: list[ModelCopies]


class CannotPlace(msgspec.Struct, kw_only=True):
    model: str
    why: str  # placement's words
    since: float  # wall clock of the pass that said so


class FleetStatus(msgspec.Struct, kw_only=True):
    fabrics: list[FabricStatus]
    warnings: list[str]
    nodes_not_scanning: list[str]  # never asked to look for weights (not: looked, found none)
    # catalog models below their count that placement cannot place now (the control plane's)
    cannot_place: list[CannotPlace] = []


# what a profile's weights are looked for by: its weights name, and its model_path
# ("" when it has none), normalised (``Model.weights_name``, ``Model.weights_path``)
WeightsWanted = tuple[str, str]


def missing_weights(
    nodes: Iterable[Node], wanted: Iterable[tuple[str, list[WeightsWanted]]]
) -> dict[str, str]:
    """A warning, by model, for each model (name, what each of its profiles looks for)
    whose weights no node reports, when nodes look where they would be. A copy holds a
    profile's weights when discovery named it so or found it at the profile's
    model_path. Nobody looking is no evidence (an unknown is not a zero): a node never
    asked to look, or one whose agent does not say where it looks, says nothing; and a
    profile whose model_path lies outside every node's weights dirs is not looked for,
    so a model with such a profile is not warned about."""
    names: set[str] = set()
    paths: set[str] = set()
    dirs: set[str] = set()
    looking = False
    for node in nodes:
        if node.state is NodeState.LOST:
            continue
        inv = node.inventory
        for copy in inv.weights:
            names.add(copy.model)
            paths.add(posixpath.normpath(copy.path))
        if inv.weights_scanned:
            looking = True
            dirs.update(posixpath.normpath(d) for d in inv.weights_dirs)
    if not looking:
        return {}
    out: dict[str, str] = {}
    for model, profiles in wanted:
        if any(name in names or (path and path in paths) for name, path in profiles):
            continue
        if not all(not path or _inside(path, dirs) for _, path in profiles):
            continue
        said = ", ".join(sorted({name for name, _ in profiles}))
        out[model] = (
            f"no node reports the weights of {model} ({said}) in its weights dirs: its "
            "engines must find them at their model_path, fetch them, or fail to start"
        )
    return out


def _inside(path: str, dirs: set[str]) -> bool:
    """Whether ``path`` (normalised) lies in one of ``dirs`` (normalised), at any depth."""
    return any(path.startswith(d.rstrip("/") + "/") for d in dirs)


def fleet_status(nodes: Iterable[Node]) -> FleetStatus:
    fabrics: dict[str, dict[str, tuple[set[str], set[str], set[str]]]] = {}
    members: dict[str, list[str]] = {}
    not_scanning: list[str] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        if node.state is NodeState.LOST:
            continue
        inv = node.inventory
        fabric = inv.fabric or NO_FABRIC
        members.setdefault(fabric, []).append(node.node_id)
        models = fabrics.setdefault(fabric, {})
        if not inv.weights_scanned:
            not_scanning.append(node.node_id)
        for copy in inv.weights:
            shared, local, readers = models.setdefault(copy.model, (set(), set(), set()))
            if copy.storage == "shared":
                shared.add(copy.storage_id or copy.path)
            else:
                local.add(node.node_id)
            readers.add(node.node_id)
    out = [
        FabricStatus(
            fabric=fabric,
            nodes=members[fabric],
            models=[
                ModelCopies(
                    model=model,
                    shared=sorted(shared),
                    local_nodes=sorted(local),
                    nodes=sorted(readers),
                )
                for model, (shared, local, readers) in sorted(fabrics[fabric].items())
            ],
        )
        for fabric in sorted(members)
    ]
    return FleetStatus(fabrics=out, warnings=_warnings(out), nodes_not_scanning=not_scanning)


def _warnings(fabrics: list[FabricStatus]) -> list[str]:
    if len(fabrics) < 2:
        return []
    held: dict[str, list[str]] = {}
    for f in fabrics:
        for m in f.models:
            held.setdefault(m.model, []).append(f.fabric)
    names = [f.fabric or "(no fabric)" for f in fabrics]
    out = []
    for model, where in sorted(held.items()):
        if len(where) == 1:
            here = where[0] or "(no fabric)"
            others = ", ".join(n for n in names if n != here)
            out.append(
                f"{model} is held in fabric {here} only: {others} cannot serve it "
                "without a copy over the management network"
            )
    return out


def describe_copies(m: ModelCopies) -> str:
    parts = []
    for storage_id in m.shared:
        parts.append(f"shared filer {storage_id}")
    if m.local_nodes:
        n = len(m.local_nodes)
        parts.append(f"{n} local cop{'y' if n == 1 else 'ies'} ({', '.join(m.local_nodes)})")
    return "; ".join(parts)

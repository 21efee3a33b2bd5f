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


def missing_weights(status: FleetStatus, wanted: Iterable[tuple[str, set[str]]]) -> dict[str, str]:
    """A warning, by model, for each model (name, the weights names its profiles look
    for) that no node holds, when some node looks for weights at all (one that never
    looked is no evidence)."""
    nodes = {n for f in status.fabrics for n in f.nodes}
    if not nodes - set(status.nodes_not_scanning):
        return {}
    held = {m.model for f in status.fabrics for m in f.models}
    return {
        model: f"no node reports the weights of {model} ({', '.join(sorted(names))}) in "
        "its weights dirs: its engines must find them at their model_path, fetch them, "
        "or fail to start"
        for model, names in wanted
        if not names & held
    }


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

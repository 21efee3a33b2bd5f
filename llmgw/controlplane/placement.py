"""Placement: which node(s) get the next replica of a model, and why, in words.

``place`` is a pure function of the model, the nodes and what is already
allocated. It never mutates the allocations: a caller placing several
replicas in one pass calls ``Allocations.take`` for each shard of a decision
before asking for the next one.

Profiles are tried in order of preference; the first one that fits anywhere
wins. For each profile every node is a candidate, and every candidate says
why: a rejected one names the first filter it failed ("has 8 GiB of memory,
needs 24 GiB"), an accepted one how it scored.

Filters, in the order they are checked (the first failure is the reason):

1. the node is not Ready ("Unreachable", "Lost"), is cordoned, is draining,
   or is the node a replica is being moved off;
2. a multi-node profile needs a fabric label on the node;
3. the profile's label selector (before hardware: a node that is not meant
   for this model should say so, not that it lacks a GPU);
4. the engine is installed: every program its adapter requires (vllm-ray needs
   both vllm and ray);
5. memory: what one shard needs (``memory.Needs``: ``min_memory_gb``, else for
   llama.cpp an estimate of its weights, KV cache and prompt cache) within what
   the node has less what the shards already there need ("has 32 GiB, 24 GiB
   held by 1 replica, needs 24 GiB"), only when both the need and the node's
   memory are known: a need that cannot be known is not counted, and a node
   that reports no memory is still usable (an unknown is not a zero);
6. enough healthy GPUs that no shard holds, each missing one named; and when
   the shard's engine fills its cards with a known size (llama.cpp offloaded),
   cards that can hold it, as far as they report their memory;
7. a free engine port.

Preferences, never filters (the score; higher is better):

1. weights locality: the node holds the weights (discovery named them so, or
   found them at the profile's model_path), or its fabric does on shared
   storage, over a node that must fetch them. A node never asked to look for
   weights ranks exactly like one that looked and found none.
2. spreading: fewer shards of this model already on the node.
3. packing, as the tie-breaker: fewer free GPUs left after placement. Packing
   keeps whole nodes free for the profiles that need many GPUs at once, and it
   steers GPU-less profiles to the nodes with the fewest free GPUs.
4. the node id, so that the same inputs always give the same decision.

A multi-node profile (vllm-ray) places every shard inside one fabric: fabrics
are not connected to one another. Each fabric with enough fitting nodes takes
its best ones; the fabric whose chosen nodes score best in sum (weights, then
shards, then GPUs left, then the fabric's name) wins, and rank 0 is its best
node. Every shard gets a port, Ray workers included, so that one rule holds
for all shards.

Weights on shared storage count fabric-wide (a filer seen from one node of a
fabric is readable from the fabric); a node with no fabric label shares with
nobody, so its shared copies count for itself only. Storage the agent could
not classify counts as local, never as shared. A Lost node's view is no
evidence (as in ``ctl status``).

Every candidate carries a ``Kind`` beside its words: the words are for the
operator, the kind is what code counts (``failure_kind``, a bounded metric
label), so nothing parses the words. What each filter reads of a node, and
its words, are in ``filters.py``; the order they are asked in, the scoring
and the choice are here.

Cost: O(nodes) per profile tried, a few dictionary and set operations per
node. What placement reads from an inventory is derived once per inventory
object and kept in a ``PlacementCache`` that the caller owns and hands to
each call (the reconciler keeps one across its passes); reasons are short
f-strings, and a full node's GPU explanation is remembered for the next
replica of the pass.
Measured on a 2-core dev VM with 1,000 8-GPU nodes and 2,000 replicas: about
2 ms per call for a one-profile model, about 2 ms more for each profile that
fits nowhere first.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from llmgw.controlplane.allocations import PORT_RANGE, Allocations
from llmgw.controlplane.catalog import Model, Profile
from llmgw.controlplane.filters import (
    Kind,
    NodeFacts,
    NodeView,
    PlacementCache,
    Refusal,
    cards_short,
    hardware,
    memory_reason,
    unavailable,
)
from llmgw.controlplane.memory import Needs, gib
from llmgw.controlplane.nodes import NodeState
from llmgw.engines import installed

GIB = 2**30
_SUMMARY_GROUPS = 6  # distinct reasons shown per profile in a failure summary
_SUMMARY_NODES = 4  # node ids shown per reason


@attrs.frozen
class Candidate:
    node_id: str
    profile: str
    ok: bool
    reason: str  # rejected: why, in words; accepted: how it scored, in words
    kind: Kind  # the same, as a fixed word: FITS, or the filter it failed
    # accepted: the ranking as one number, higher is better (1e6 for the weights,
    # 1e3 per shard of the model fewer, 1 per GPU left fewer); rejected: 0
    score: float = 0.0
    # the memory accounting, where it was made (None: not known or not reached)
    memory_bytes: int | None = None  # what the node has
    held_bytes: int | None = None  # what the shards already there need
    held_by: int | None = None  # how many shards that is
    need_bytes: int | None = None  # what one shard of this profile needs


@attrs.frozen
class ShardPlacement:
    node_id: str
    gpus: list[int]
    port: int
    rank: int


@attrs.frozen
class Decision:
    model: str
    profile: str | None  # None: nothing fits
    shards: list[ShardPlacement]  # rank order; empty when profile is None
    candidates: list[Candidate]  # every node considered, for every profile tried
    summary: str  # "placed on n2 (profile cpu)" / "no node can hold qwen-coder: ..."
    # each profile tried -> what one shard of it needs of a node's memory, in words
    needs: dict[str, str] = attrs.Factory(dict)
    memory: int | None = None  # bytes one shard of the chosen profile needs; None: not known

    @property
    def placed(self) -> bool:
        return self.profile is not None


# sort key of a fitting node: smaller is better
_Key = tuple[float, int, int, str]


# a fitting node: (key, index into the candidates, its facts)
_Fit = tuple[_Key, int, NodeView]


def place(
    model: Model,
    nodes: Sequence[NodeFacts],
    allocations: Allocations,
    now: float,
    *,
    avoid: frozenset[str] = frozenset(),
    port_range: tuple[int, int] = PORT_RANGE,
    cache: PlacementCache | None = None,
    needs: Needs | None = None,
) -> Decision:
    """Where the next replica of ``model`` goes, with every candidate's reason.

    ``now`` is the monotonic clock of the pass; nothing here depends on time
    yet (liveness arrives already judged, in ``Node.state``), it is taken so
    that callers need not change when something does. ``avoid`` lists nodes a
    replica is being moved off. ``cache`` keeps what was read from each
    inventory for the next call (a fresh one when not given); ``needs``, what
    each profile needs of a node's memory (reckoned from these nodes' weights
    when not given: the caller that built ``allocations`` should pass its own).
    Nothing else is mutated.
    """
    del now
    name = model.name
    if not model.profiles:
        return Decision(
            name, None, [], [], f"{name} has no profiles: it is served by static endpoints"
        )
    if not nodes:
        return Decision(name, None, [], [], f"no node can hold {name}: no node has registered")
    if needs is None:
        needs = Needs(lambda: [f.node.inventory for f in nodes])
    pass_ = _Pass(model, nodes, allocations, avoid, port_range, cache or PlacementCache(), needs)
    candidates: list[Candidate] = []
    failed: list[tuple[Profile, list[Candidate]]] = []
    said: dict[str, str] = {}
    for profile in model.profiles:
        need = needs.of(model, profile)
        said[profile.name] = need.words
        considered, shards, where = pass_.try_profile(profile)
        candidates.extend(considered)
        if shards:
            summary = f"placed on {where} (profile {profile.name}"
            if failed:
                summary += "; " + ", ".join(f"{p.name} fits nowhere" for p, _ in failed)
            return Decision(name, profile.name, shards, candidates, summary + ")", said, need.host)
        failed.append((profile, considered))
    return Decision(name, None, [], candidates, _failure_summary(name, failed), said)


class _Pass:
    """One call's facts, computed once per node and shared by the profiles tried."""

    def __init__(
        self,
        model: Model,
        nodes: Sequence[NodeFacts],
        allocations: Allocations,
        avoid: frozenset[str],
        port_range: tuple[int, int],
        cache: PlacementCache,
        needs: Needs,
    ) -> None:
        self.model = model
        self.needs = needs
        self.nodes = nodes
        cache.prune(nodes)
        static = cache.static
        self.statics = [static(f.node) for f in nodes]
        self.allocations = allocations
        self.port_range = port_range
        # None: open to placement; otherwise why not (the same for every profile)
        self.blocked: list[Refusal | None] = [unavailable(f, avoid) for f in nodes]
        self._shared_in: dict[str, set[str]] = {}

    def shared_in(self, weights: str) -> set[str]:
        """Fabrics that hold ``weights`` on shared storage (a node without a fabric
        label shares with nobody, so its filer counts for itself only)."""
        found = self._shared_in.get(weights)
        if found is None:
            found = self._shared_in[weights] = {
                st.fabric
                for facts, st in zip(self.nodes, self.statics, strict=True)
                if st.fabric and weights in st.shared and facts.node.state is not NodeState.LOST
            }
        return found

    def try_profile(self, profile: Profile) -> tuple[list[Candidate], list[ShardPlacement], str]:
        model = self.model.name
        pname = profile.name
        need = profile.gpus
        multi = profile.nodes > 1
        required = installed(profile.engine)
        selector = list(profile.selector.items())
        need_of = self.needs.of(self.model, profile)
        need_host, need_gpu = need_of.host, need_of.gpu
        mem_held = self.allocations.memory
        mem_by = self.allocations.holders
        weights = self.model.weights_name(profile)
        path = self.model.weights_path(profile)
        source = self.model.weights_source(profile)
        fabrics = self.shared_in(weights)
        replicas = self.allocations.replicas
        gpus_used = self.allocations.gpus
        ports_used = self.allocations.ports
        free_port = self.allocations.free_port
        port_range = self.port_range
        range_size = port_range[1] - port_range[0] + 1
        out: list[Candidate] = []
        fits: list[_Fit] = []
        append = out.append
        for facts, st, blocked in zip(self.nodes, self.statics, self.blocked, strict=True):
            node_id = facts.node.node_id
            if blocked is not None:
                append(Candidate(node_id, pname, False, blocked[1], blocked[0]))
                continue
            refused = hardware(st, selector, required, multi)
            if refused is not None:
                append(Candidate(node_id, pname, False, refused[1], refused[0]))
                continue
            total = st.memory
            held = mem_held.get(node_id, 0)
            if need_host is not None and total is not None and total - held < need_host:
                n = mem_by.get(node_id, 0)
                why = memory_reason(total, held, n, need_host)
                append(
                    Candidate(
                        node_id, pname, False, why, Kind.MEMORY, 0.0, total, held, n, need_host
                    )
                )
                continue
            used = gpus_used.get(node_id)
            free = len(st.healthy) - len(st.healthy_set & used) if used else len(st.healthy)
            if free < need:
                append(Candidate(node_id, pname, False, st.gpu_reason(need, used), Kind.GPUS))
                continue
            if need_gpu is not None and need:
                short = cards_short(st, need, used, need_gpu)
                if short:
                    append(Candidate(node_id, pname, False, short, Kind.MEMORY))
                    continue
            ports = ports_used.get(node_id)
            node_range = st.port_range or port_range
            size = range_size if st.port_range is None else node_range[1] - node_range[0] + 1
            # fewer ports in use than the range holds: one of them is free (found once chosen)
            if ports and len(ports) >= size and free_port(node_id, node_range) is None:
                append(Candidate(node_id, pname, False, "no free engine port", Kind.PORTS))
                continue
            if source and source in st.no_room:
                why = "no room on its disk for the weights (its last fetch of them said so)"
                append(Candidate(node_id, pname, False, why, Kind.DISK))
                continue
            has: float
            if (
                weights in st.held
                or (path and path in st.held_paths)
                or (source and source in st.held_sources)
            ):
                has, where = 1, "weights here"
            elif st.fabric in fabrics:
                has, where = 1, f"weights on fabric {st.fabric}'s shared storage"
            elif source and source in st.fetching:
                has, where = 0.5, "fetching weights here"
            else:
                has, where = 0, "must fetch weights"
            shards = replicas.get((model, node_id), 0)
            left = free - need
            key = (-has, shards, left, node_id)
            fits.append((key, len(out), st))
            why = f"{where}, {shards} shards of {model} here, {left} GPUs left after"
            score = has * 1e6 + (999 - min(shards, 999)) * 1e3 + 999 - min(left, 999)
            if need_host is not None and total is not None:
                why += f", {gib(total - held - need_host)} GiB of memory left after"
                fit = Candidate(
                    node_id, pname, True, why, Kind.FITS, score,
                    total, held, mem_by.get(node_id, 0), need_host,
                )  # fmt: skip
            else:
                fit = Candidate(
                    node_id, pname, True, why, Kind.FITS, score, total, None, None, need_host
                )
            append(fit)
        if not fits:
            return out, [], ""
        if not multi:
            best = min(fits)
            return out, [self._shard(best, need, 0)], best[0][3]
        return self._multi(profile, out, fits)

    def _shard(self, fit: _Fit, need: int, rank: int) -> ShardPlacement:
        """The lowest free healthy GPUs and the lowest free port of a chosen node."""
        node_id = fit[0][3]
        used = self.allocations.gpus.get(node_id) or set()
        gpus = [i for i in fit[2].healthy if i not in used][:need]
        port = self.allocations.free_port(node_id, fit[2].port_range or self.port_range)
        assert port is not None and len(gpus) == need  # both checked when it was a candidate
        return ShardPlacement(node_id, gpus, port, rank)

    def _multi(
        self, profile: Profile, out: list[Candidate], fits: list[_Fit]
    ) -> tuple[list[Candidate], list[ShardPlacement], str]:
        """All shards inside one fabric: the best-scoring one with enough fitting nodes."""
        want = profile.nodes
        by_fabric: dict[str, list[_Fit]] = {}
        for fit in fits:
            by_fabric.setdefault(fit[2].fabric, []).append(fit)
        best: tuple[_Key, list[_Fit]] | None = None
        for fabric, members in by_fabric.items():
            if len(members) < want:
                why = (
                    f"fabric {fabric} has {len(members)} fitting node"
                    f"{'' if len(members) == 1 else 's'}, needs {want}"
                )
                for fit in members:
                    out[fit[1]] = Candidate(fit[0][3], profile.name, False, why, Kind.FABRIC)
                continue
            members.sort()
            chosen = members[:want]
            key = (
                sum(f[0][0] for f in chosen),
                sum(f[0][1] for f in chosen),
                sum(f[0][2] for f in chosen),
                fabric,
            )
            if best is None or key < best[0]:
                best = (key, chosen)
        if best is None:
            return out, [], ""
        fabric_key, chosen = best
        shards = [self._shard(f, profile.gpus, rank) for rank, f in enumerate(chosen)]
        return out, shards, f"{', '.join(s.node_id for s in shards)} in fabric {fabric_key[3]}"


def _failure_summary(model: str, failed: list[tuple[Profile, list[Candidate]]]) -> str:
    """Like "no node can hold M: n1: reason; n2, n3: reason", per profile when several,
    grouped by reason and bounded in length (the candidates carry the detail)."""
    sections: list[str] = []
    for profile, considered in failed:
        groups: dict[str, list[str]] = {}
        for c in sorted(considered, key=lambda c: c.node_id):
            groups.setdefault(c.reason, []).append(c.node_id)
        parts: list[str] = []
        for reason, node_ids in list(groups.items())[:_SUMMARY_GROUPS]:
            shown = ", ".join(node_ids[:_SUMMARY_NODES])
            if len(node_ids) > _SUMMARY_NODES:
                shown += f" and {len(node_ids) - _SUMMARY_NODES} more"
            parts.append(f"{shown}: {reason}")
        if len(groups) > _SUMMARY_GROUPS:
            rest = sum(len(ids) for ids in list(groups.values())[_SUMMARY_GROUPS:])
            parts.append(f"{rest} more node{'' if rest == 1 else 's'} for other reasons")
        text = "; ".join(parts)
        sections.append(text if len(failed) == 1 else f"with profile {profile.name}, {text}")
    return f"no node can hold {model}: " + " / ".join(sections)


def failure_kind(decision: Decision) -> str:
    """The most common reason nodes were refused, as one of a few fixed words (a
    ``Kind``'s value, or ``no_nodes``): the placement-failure metric's label."""
    if not decision.candidates:
        return "no_nodes"
    counts: dict[Kind, int] = {}
    for c in decision.candidates:
        if not c.ok:
            counts[c.kind] = counts.get(c.kind, 0) + 1
    return str(max(counts, key=lambda k: counts[k])) if counts else "other"

"""Placement: filters that always say why, preferences that never filter, one fabric per replica."""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmgw.controlplane.allocations import Allocations
from llmgw.controlplane.catalog import Model, Profile
from llmgw.controlplane.filters import Kind, NodeFacts
from llmgw.controlplane.nodes import Node, NodeState
from llmgw.controlplane.placement import Decision, failure_kind, place
from llmgw.protocol.messages import Engine, FetchProgress, Gpu, Inventory, Memory, WeightCopy

GIB = 2**30
VLLM = [Engine(name="vllm")]
ALL_ENGINES = [Engine(name="vllm"), Engine(name="ray"), Engine(name="llama.cpp")]


def inventory(
    *,
    gpus: int = 8,
    unhealthy: dict[int, list[str]] | None = None,
    engines: Sequence[Engine] = ALL_ENGINES,
    memory_gb: float | None = None,
    labels: dict[str, str] | None = None,
    fabric: str = "",
    weights: Sequence[WeightCopy] = (),
    scanned: bool = False,
) -> Inventory:
    bad = unhealthy or {}
    return Inventory(
        gpus=[Gpu(index=i, healthy=i not in bad, problems=bad.get(i, [])) for i in range(gpus)],
        engines=list(engines),
        memory=Memory(total_bytes=None if memory_gb is None else int(memory_gb * GIB)),
        labels=labels or {},
        fabric=fabric,
        weights=list(weights),
        weights_scanned=scanned or bool(weights),
    )


def facts(
    node_id: str,
    inv: Inventory | None = None,
    *,
    state: NodeState = NodeState.READY,
    cordoned: bool = False,
    draining: bool = False,
) -> NodeFacts:
    node = Node(
        node_id=node_id,
        inventory=inv if inv is not None else inventory(),
        peer="10.0.0.1:5000",
        connection=1,
        connected=state is NodeState.READY,
        state=state,
        last_seen=0.0,
        last_seen_wall=0.0,
        registered_at_wall=0.0,
    )
    return NodeFacts(node, cordoned=cordoned, draining=draining)


def profile(name: str = "p", **kw: object) -> Profile:
    kw.setdefault("engine", "vllm")
    kw.setdefault("gpus", 1)
    return msgspec.convert({"name": name, **kw}, Profile)


def model(*profiles: Profile, name: str = "qwen-coder") -> Model:
    return Model(name=name, replicas=1, profiles=list(profiles or [profile()]))


def local(name: str = "qwen-coder") -> WeightCopy:
    return WeightCopy(model=name, path=f"/w/{name}", storage="local", filesystem="ext4")


def shared(name: str = "qwen-coder") -> WeightCopy:
    return WeightCopy(
        model=name, path=f"/mnt/{name}", storage="shared", filesystem="nfs4", storage_id="filer:/x"
    )


def decide(
    m: Model,
    nodes: Sequence[NodeFacts],
    alloc: Allocations | None = None,
    **kw: object,
) -> Decision:
    return place(m, nodes, alloc if alloc is not None else Allocations(), 0.0, **kw)  # type: ignore[arg-type]


def reasons(d: Decision, profile_name: str | None = None) -> dict[str, str]:
    return {
        c.node_id: c.reason
        for c in d.candidates
        if profile_name is None or c.profile == profile_name
    }


def only(d: Decision) -> tuple[str, list[int], int]:
    [shard] = d.shards
    return shard.node_id, shard.gpus, shard.port


# --- filters ------------------------------------------------------------------------


def busy(node: str, gpus: list[int], ports: Sequence[int] = (20000,)) -> Allocations:
    a = Allocations()
    for i, port in enumerate(ports):
        a.take(node, "other", gpus if i == 0 else [], port)
    return a


@pytest.mark.parametrize(
    ("node", "prof", "alloc", "avoid", "reason", "kind"),
    [
        (
            facts("n", state=NodeState.UNREACHABLE),
            profile(),
            None,
            (),
            "Unreachable",
            Kind.UNREACHABLE,
        ),
        (facts("n", state=NodeState.LOST), profile(), None, (), "Lost", Kind.UNREACHABLE),
        (facts("n", cordoned=True), profile(), None, (), "cordoned", Kind.CORDONED),
        (facts("n", draining=True), profile(), None, (), "draining", Kind.DRAINING),
        (facts("n"), profile(), None, ("n",), "being moved off this node", Kind.DRAINING),
        (
            facts("n", inventory(engines=[Engine(name="llama.cpp")])),
            profile(),
            None,
            (),
            "vllm not installed",
            Kind.ENGINE,
        ),
        (
            facts("n", inventory(engines=VLLM, fabric="ib-a")),
            profile(engine="vllm-ray", nodes=2),
            None,
            (),
            "ray not installed",
            Kind.ENGINE,
        ),
        (
            facts("n", inventory(engines=[], fabric="ib-a")),
            profile(engine="vllm-ray", nodes=2),
            None,
            (),
            "vllm and ray not installed",
            Kind.ENGINE,
        ),
        (
            facts("n", inventory(engines=VLLM)),
            profile(engine="llama.cpp", gpus=0, model_path="/m.gguf"),
            None,
            (),
            "llama.cpp not installed",
            Kind.ENGINE,
        ),
        (
            facts("n", inventory(gpus=3, unhealthy={2: ["pending retired pages"]})),
            profile(gpus=2),
            busy("n", [0]),
            (),
            "needs 2 GPUs, has 1 free (GPU 2 unhealthy: pending retired pages; GPU 0 in use)",
            Kind.GPUS,
        ),
        (
            facts("n", inventory(gpus=4, unhealthy={1: ["xid 79", "ecc errors"], 3: []})),
            profile(gpus=3),
            busy("n", [0, 2]),
            (),
            "needs 3 GPUs, has 0 free (GPU 1 unhealthy: xid 79, ecc errors; GPU 3 unhealthy; "
            "GPUs 0, 2 in use)",
            Kind.GPUS,
        ),
        (
            facts("n", inventory(gpus=0)),
            profile(gpus=1),
            None,
            (),
            "needs 1 GPU, has none",
            Kind.GPUS,
        ),
        (
            facts("n", inventory(memory_gb=8)),
            profile(min_memory_gb=24),
            None,
            (),
            "has 8 GiB of memory, needs 24 GiB",
            Kind.MEMORY,
        ),
        (
            facts("n", inventory(memory_gb=23.96)),
            profile(min_memory_gb=24),
            None,
            (),
            "has 23.9 GiB of memory, needs 24 GiB",  # rounded down: a shortfall never reads as enough
            Kind.MEMORY,
        ),
        (
            facts("n", inventory(labels={"role": "chat"})),
            profile(selector={"role": "coding"}),
            None,
            (),
            "label role=coding required, node has role=chat",
            Kind.SELECTOR,
        ),
        (
            facts("n", inventory(labels={"zone": "a"})),
            profile(selector={"role": "coding"}),
            None,
            (),
            "label role=coding required, node has no label role",
            Kind.SELECTOR,
        ),
        (
            facts("n"),
            profile(),
            busy("n", [], ports=[20000, 20001]),
            (),
            "no free engine port",
            Kind.PORTS,
        ),
        (
            facts("n"),
            profile(engine="vllm-ray", nodes=2),
            None,
            (),
            "multi-node profile needs a fabric label",
            Kind.SELECTOR,
        ),
        (
            facts("n", inventory(fabric="ib-a")),
            profile(engine="vllm-ray", nodes=2),
            None,
            (),
            "fabric ib-a has 1 fitting node, needs 2",
            Kind.FABRIC,
        ),
    ],
)
def test_each_filter_says_why(
    node: NodeFacts,
    prof: Profile,
    alloc: Allocations | None,
    avoid: tuple[str, ...],
    reason: str,
    kind: Kind,
) -> None:
    d = decide(model(prof), [node], alloc, avoid=frozenset(avoid), port_range=(20000, 20001))
    assert d.profile is None and d.shards == []
    [c] = d.candidates
    assert (c.node_id, c.profile, c.ok, c.reason, c.kind) == ("n", prof.name, False, reason, kind)
    assert failure_kind(d) == kind.value  # the metric's label
    assert d.summary == f"no node can hold qwen-coder: n: {reason}"


def test_the_same_nodes_pass_every_filter_when_nothing_is_wrong() -> None:
    d = decide(model(profile(gpus=2)), [facts("n")], port_range=(20000, 20001))
    assert only(d) == ("n", [0, 1], 20000)
    [c] = d.candidates
    assert c.ok and c.reason


def test_a_node_that_reports_no_memory_is_still_usable() -> None:
    d = decide(model(profile(min_memory_gb=24)), [facts("old-agent", inventory(memory_gb=None))])
    assert only(d)[0] == "old-agent"


def test_a_profile_with_no_memory_requirement_fits_anywhere() -> None:
    d = decide(model(profile()), [facts("small", inventory(memory_gb=8))])
    assert only(d)[0] == "small"


def test_memory_is_a_filter_between_nodes() -> None:
    nodes = [facts("a8", inventory(memory_gb=8)), facts("b64", inventory(memory_gb=64))]
    d = decide(model(profile(min_memory_gb=24)), nodes)
    assert only(d)[0] == "b64"
    assert reasons(d)["a8"] == "has 8 GiB of memory, needs 24 GiB"


def test_allocated_and_unhealthy_gpus_are_never_handed_out() -> None:
    node = facts("n", inventory(gpus=6, unhealthy={1: ["pending retired pages"]}))
    alloc = busy("n", [0, 3])
    d = decide(model(profile(gpus=2)), [node], alloc)
    assert only(d) == ("n", [2, 4], 20001)  # the lowest free healthy GPUs; the next free port
    d = decide(model(profile(gpus=4)), [node], alloc)
    assert d.profile is None
    assert reasons(d)["n"] == (
        "needs 4 GPUs, has 3 free (GPU 1 unhealthy: pending retired pages; GPUs 0, 3 in use)"
    )


def test_placement_does_not_change_the_allocations() -> None:
    alloc = busy("n", [0])
    before = (dict(alloc.gpus), dict(alloc.ports), dict(alloc.replicas))
    decide(model(profile()), [facts("n")], alloc)
    assert (alloc.gpus, alloc.ports, alloc.replicas) == before


def test_taking_each_decision_fills_a_node_then_moves_on() -> None:
    nodes = [facts("a", inventory(gpus=2)), facts("b", inventory(gpus=2))]
    alloc = Allocations()
    placed = []
    for _ in range(4):
        d = decide(model(profile()), nodes, alloc)
        for s in d.shards:
            alloc.take(s.node_id, "qwen-coder", s.gpus, s.port)
            placed.append((s.node_id, s.gpus, s.port))
    # spread first (a, then b), then the lowest free GPU and port on each
    assert placed == [("a", [0], 20000), ("b", [0], 20000), ("a", [1], 20001), ("b", [1], 20001)]
    d = decide(model(profile()), nodes, alloc)
    assert d.profile is None
    assert d.summary == (
        "no node can hold qwen-coder: a, b: needs 1 GPU, has 0 free (GPUs 0, 1 in use)"
    )


# --- preferences --------------------------------------------------------------------


def test_a_node_holding_the_weights_is_preferred() -> None:
    nodes = [facts("a"), facts("b", inventory(weights=[local()]))]
    d = decide(model(profile()), nodes)
    assert only(d)[0] == "b"
    r = reasons(d)
    assert r["b"].startswith("weights here")
    assert r["a"].startswith("must fetch weights")
    scores = {c.node_id: c.score for c in d.candidates}
    assert scores["b"] > scores["a"] > 0


def test_weights_are_a_preference_never_a_filter() -> None:
    """The node with the weights is full: the node without them still gets the replica."""
    nodes = [facts("a"), facts("b", inventory(gpus=1, weights=[local()]))]
    d = decide(model(profile()), nodes, busy("b", [0]))
    assert only(d)[0] == "a"
    assert reasons(d)["b"].startswith("needs 1 GPU, has 0 free")


def test_the_profile_weights_name_is_what_is_looked_for() -> None:
    nodes = [facts("a", inventory(weights=[local("qwen-coder")])), facts("b", inventory())]
    nodes.append(facts("c", inventory(weights=[local("Qwen2.5-Coder")])))
    d = decide(model(profile(weights="Qwen2.5-Coder")), nodes)
    assert only(d)[0] == "c"


def test_a_copy_at_the_profiles_model_path_holds_its_weights_whatever_its_name() -> None:
    """Discovery names a GGUF file by its stem; the profile's model_path is the file."""
    gguf = WeightCopy(model="qwen2.5-0.5b-q4_k_m", path="/w/qwen2.5-0.5b-q4_k_m.gguf")
    nodes = [facts("a"), facts("b", inventory(weights=[gguf]))]
    d = decide(model(profile(model_path="/w/./qwen2.5-0.5b-q4_k_m.gguf")), nodes)
    assert only(d)[0] == "b"
    assert reasons(d)["b"].startswith("weights here")


def test_a_node_holding_a_fetched_source_then_one_fetching_it_are_preferred() -> None:
    """A copy a fetch landed names its source, whatever its path; a fetch under way is
    partial locality: better than nothing, not as good as the file."""
    source = "hf://acme/coder-GGUF/coder-q4.gguf"
    landed = WeightCopy(model="coder-q4", path="/srv/w/hf/acme/x.gguf", source=source)
    under_way = FetchProgress(source=source, path="/srv/w/hf/acme/x.gguf", done_bytes=5)
    fetching = msgspec.structs.replace(inventory(), fetching=[under_way])
    nodes = [facts("a"), facts("b", fetching), facts("c", inventory(weights=[landed]))]
    p = profile(engine="llama.cpp", gpus=0, source=source)
    d = decide(model(p), nodes)
    assert only(d)[0] == "c"
    r = reasons(d)
    assert r["c"].startswith("weights here"), r
    assert r["b"].startswith("fetching weights here"), r
    assert r["a"].startswith("must fetch weights"), r
    scores = {c.node_id: c.score for c in d.candidates}
    assert scores["c"] > scores["b"] > scores["a"] > 0
    d = decide(model(p), nodes[:2])
    assert only(d)[0] == "b"
    # written another way (an explicit main), the same source
    same = profile(engine="llama.cpp", gpus=0, source="hf://acme/coder-GGUF@main/coder-q4.gguf")
    assert only(decide(model(same), nodes))[0] == "c"


def test_shared_weights_count_fabric_wide_and_local_ones_do_not() -> None:
    # z1 sees the filer but is cordoned; z2 shares its fabric, a3 is elsewhere
    nodes = [
        facts("z1", inventory(fabric="ib-z", weights=[shared()]), cordoned=True),
        facts("z2", inventory(fabric="ib-z")),
        facts("a3", inventory(fabric="ib-a")),
    ]
    d = decide(model(profile()), nodes)
    assert only(d)[0] == "z2"
    assert reasons(d)["z2"].startswith("weights on fabric ib-z's shared storage")
    # the same copy on local disk (or storage nobody could classify) is z1's alone
    for storage in ("local", "unknown"):
        copy = msgspec.structs.replace(shared(), storage=storage)
        nodes[0] = facts("z1", inventory(fabric="ib-z", weights=[copy]), cordoned=True)
        assert only(decide(model(profile()), nodes))[0] == "a3"  # a tie, broken by id


def test_a_node_without_a_fabric_shares_with_nobody() -> None:
    nodes = [
        facts("z1", inventory(weights=[shared()]), cordoned=True),
        facts("z2", inventory()),
        facts("a3", inventory()),
    ]
    assert only(decide(model(profile()), nodes))[0] == "a3"


def test_a_lost_nodes_filer_is_no_evidence() -> None:
    nodes = [
        facts("z1", inventory(fabric="ib-z", weights=[shared()]), state=NodeState.LOST),
        facts("z2", inventory(fabric="ib-z")),
        facts("a3", inventory(fabric="ib-a")),
    ]
    assert only(decide(model(profile()), nodes))[0] == "a3"


@pytest.mark.parametrize("names", [("a", "b"), ("b", "a")])
def test_never_scanned_ranks_exactly_like_scanned_and_found_nothing(names: tuple[str, str]) -> None:
    never, empty = names
    nodes = [facts(never, inventory(scanned=False)), facts(empty, inventory(scanned=True))]
    d = decide(model(profile()), nodes)
    assert only(d)[0] == "a"  # by id alone, whichever of the two it is
    scores = {c.node_id: (c.score, c.reason) for c in d.candidates}
    assert scores[never] == scores[empty]


def test_replicas_of_one_model_spread_across_nodes() -> None:
    nodes = [facts("a"), facts("b")]
    alloc = Allocations()
    alloc.take("a", "qwen-coder", [0], 20000)
    alloc.take("b", "other", [0, 1, 2, 3], 20000)
    # b has more shards in all and fewer GPUs left, but none of this model
    d = decide(model(profile()), nodes, alloc)
    assert only(d)[0] == "b"
    assert "1 shards of qwen-coder here" in reasons(d)["a"]


def test_weights_outrank_spreading() -> None:
    nodes = [facts("a", inventory(weights=[local()])), facts("b")]
    alloc = Allocations()
    alloc.take("a", "qwen-coder", [0], 20000)
    assert only(decide(model(profile()), nodes, alloc))[0] == "a"


def test_ties_pack_onto_the_node_with_fewer_gpus_left() -> None:
    nodes = [facts("a", inventory(gpus=8)), facts("b", inventory(gpus=4))]
    d = decide(model(profile(gpus=2)), nodes)
    assert only(d)[0] == "b"
    assert reasons(d)["b"].endswith("2 GPUs left after")
    # a CPU profile packs too, so it keeps the GPU-rich node free
    cpu = profile("cpu", engine="llama.cpp", gpus=0, model_path="/m.gguf")
    nodes.append(facts("c", inventory(gpus=0)))
    assert only(decide(model(cpu), nodes))[0] == "c"


# --- multi-node ---------------------------------------------------------------------

RAY = profile("ray", engine="vllm-ray", gpus=4, nodes=2)


def test_a_multi_node_replica_is_placed_inside_one_fabric() -> None:
    nodes = [
        facts("a1", inventory(fabric="ib-a")),
        facts("b1", inventory(fabric="ib-b")),
        facts("b2", inventory(fabric="ib-b", gpus=4)),
        facts("c1", inventory(fabric="")),
    ]
    d = decide(model(RAY), nodes)
    assert d.profile == "ray"
    assert [(s.node_id, s.gpus, s.rank) for s in d.shards] == [
        ("b2", [0, 1, 2, 3], 0),  # rank 0: the best node (packing: no GPUs left)
        ("b1", [0, 1, 2, 3], 1),
    ]
    assert d.summary == "placed on b2, b1 in fabric ib-b (profile ray)"
    r = reasons(d)
    assert r["a1"] == "fabric ib-a has 1 fitting node, needs 2"
    assert r["c1"] == "multi-node profile needs a fabric label"


def test_a_multi_node_replica_never_spans_fabrics() -> None:
    nodes = [facts("a1", inventory(fabric="ib-a")), facts("b1", inventory(fabric="ib-b"))]
    d = decide(model(RAY), nodes)
    assert d.profile is None
    assert d.summary == (
        "no node can hold qwen-coder: a1: fabric ib-a has 1 fitting node, needs 2; "
        "b1: fabric ib-b has 1 fitting node, needs 2"
    )


def test_nodes_without_a_fabric_label_are_not_one_fabric() -> None:
    d = decide(model(RAY), [facts("a"), facts("b")])
    assert d.profile is None
    assert set(reasons(d).values()) == {"multi-node profile needs a fabric label"}


def test_the_fabric_holding_the_weights_is_chosen() -> None:
    nodes = [
        facts("a1", inventory(fabric="ib-a")),
        facts("a2", inventory(fabric="ib-a")),
        facts("b1", inventory(fabric="ib-b", weights=[shared()])),
        facts("b2", inventory(fabric="ib-b")),
    ]
    d = decide(model(RAY), nodes)
    assert {s.node_id for s in d.shards} == {"b1", "b2"}


def test_a_filtered_node_does_not_count_towards_its_fabric() -> None:
    nodes = [
        facts("a1", inventory(fabric="ib-a")),
        facts("a2", inventory(fabric="ib-a", memory_gb=8)),
        facts("b1", inventory(fabric="ib-b")),
        facts("b2", inventory(fabric="ib-b")),
        facts("b3", inventory(fabric="ib-b")),
    ]
    prof = profile("ray", engine="vllm-ray", gpus=4, nodes=2, min_memory_gb=24)
    d = decide(model(prof), nodes, busy("b2", [0, 1, 2, 3, 4]))
    assert [s.node_id for s in d.shards] == ["b1", "b3"]
    r = reasons(d)
    assert r["a1"] == "fabric ib-a has 1 fitting node, needs 2"
    assert r["a2"] == "has 8 GiB of memory, needs 24 GiB"
    assert r["b2"].startswith("needs 4 GPUs, has 3 free")


# --- profiles, summaries, determinism -------------------------------------------------


def test_profiles_are_tried_in_order() -> None:
    gpu = profile("h100", gpus=1, selector={"gpu": "h100"})
    cpu = profile("cpu", engine="llama.cpp", gpus=0, model_path="/m.gguf")
    nodes = [facts("n1", inventory(gpus=0)), facts("n2", inventory(labels={"gpu": "h100"}))]
    d = decide(model(gpu, cpu), nodes)
    assert (d.profile, only(d)[0]) == ("h100", "n2")
    assert {c.profile for c in d.candidates} == {"h100"}  # the second was never needed
    nodes[1] = facts("n2", inventory(labels={"gpu": "a100"}))
    d = decide(model(gpu, cpu), nodes)
    assert d.profile == "cpu"
    assert d.summary == f"placed on {only(d)[0]} (profile cpu; h100 fits nowhere)"
    assert [(c.profile, c.node_id) for c in d.candidates] == [
        ("h100", "n1"),
        ("h100", "n2"),
        ("cpu", "n1"),
        ("cpu", "n2"),
    ]


def test_the_summary_says_why_nothing_fits_node_by_node() -> None:
    nodes = [facts("n1", inventory(memory_gb=8)), facts("n2", cordoned=True)]
    d = decide(model(profile("h100", min_memory_gb=24)), nodes)
    assert (
        d.summary
        == "no node can hold qwen-coder: n1: has 8 GiB of memory, needs 24 GiB; n2: cordoned"
    )


def test_the_summary_covers_every_profile_tried() -> None:
    gpu = profile("h100", gpus=1)
    cpu = profile("cpu", engine="llama.cpp", gpus=0, model_path="/m.gguf", min_memory_gb=24)
    d = decide(model(gpu, cpu), [facts("n1", inventory(gpus=0, memory_gb=8))])
    assert d.summary == (
        "no node can hold qwen-coder: with profile h100, n1: needs 1 GPU, has none"
        " / with profile cpu, n1: has 8 GiB of memory, needs 24 GiB"
    )


def test_the_summary_stays_readable_for_a_thousand_nodes() -> None:
    nodes = [facts(f"n{i:04d}", cordoned=True) for i in range(1000)]
    nodes += [facts(f"m{i}", inventory(memory_gb=i + 1)) for i in range(20)]
    d = decide(model(profile(min_memory_gb=24)), nodes)
    assert len(d.candidates) == 1020
    assert len(d.summary) < 600, d.summary
    assert d.summary.startswith(
        "no node can hold qwen-coder: m0: has 1 GiB of memory, needs 24 GiB;"
    )
    assert "more nodes for other reasons" in d.summary
    d = decide(model(profile()), nodes[:1000])
    assert (
        d.summary
        == "no node can hold qwen-coder: n0000, n0001, n0002, n0003 and 996 more: cordoned"
    )


def test_nothing_to_place_on() -> None:
    assert decide(model(profile()), []).summary == (
        "no node can hold qwen-coder: no node has registered"
    )
    static = Model(name="embed", static_endpoints=["http://h:1"])
    d = decide(static, [facts("n")])
    assert (d.profile, d.shards, d.candidates) == (None, [], [])


def test_the_same_inputs_give_the_same_decision_in_any_order() -> None:
    rng = random.Random(7)
    nodes = [
        facts(f"n{i}", inventory(gpus=rng.choice([2, 4, 8]), fabric=rng.choice(["ib-a", "ib-b"])))
        for i in range(40)
    ]
    alloc = Allocations()
    for f in nodes[:20]:
        alloc.take(f.node.node_id, rng.choice(["qwen-coder", "x"]), [0], 20000)
    for prof in (profile(gpus=2), RAY):
        first = decide(model(prof), nodes, alloc)
        for _ in range(5):
            shuffled = nodes[:]
            rng.shuffle(shuffled)
            again = decide(model(prof), shuffled, alloc)
            assert again.shards == first.shards
            assert again.summary == first.summary
            assert sorted(again.candidates, key=lambda c: c.node_id) == sorted(
                first.candidates, key=lambda c: c.node_id
            )


def test_a_replaced_inventory_is_seen_at_once() -> None:
    f = facts("n", inventory(gpus=0))
    assert decide(model(profile()), [f]).profile is None
    f.node.inventory = inventory(gpus=1)  # a heartbeat brought news
    assert only(decide(model(profile()), [f]))[0] == "n"
    # a heartbeat replaces only the memory reading (the rest is the same objects)
    big = profile(min_memory_gb=24)
    f.node.inventory = msgspec.structs.replace(f.node.inventory, memory=Memory(total_bytes=GIB))
    assert reasons(decide(model(big), [f]))["n"] == "has 1 GiB of memory, needs 24 GiB"
    f.node.inventory = msgspec.structs.replace(
        f.node.inventory, memory=Memory(total_bytes=32 * GIB)
    )
    assert only(decide(model(big), [f]))[0] == "n"
    f.node.inventory = msgspec.structs.replace(f.node.inventory, labels={"role": "chat"})
    d = decide(model(profile(selector={"role": "coding"})), [f])
    assert reasons(d)["n"] == "label role=coding required, node has role=chat"


# --- property -----------------------------------------------------------------------

PORTS = (20000, 20003)
MOSTLY_TRUE = st.sampled_from([True, True, True, False])
ENGINE_SETS = [["vllm", "ray", "llama.cpp"]] * 4 + [["vllm"], ["llama.cpp"], ["ray"], []]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[NodeFacts], Allocations, Model, frozenset[str]]:
    """Small fleets, most nodes healthy, so that decisions are made and checked."""
    nodes: list[NodeFacts] = []
    alloc = Allocations()
    for i in range(draw(st.integers(1, 8))):
        node_id = f"n{i}"
        trouble = draw(st.sampled_from([False, False, True]))  # something may be wrong
        healthy = [
            not trouble or draw(MOSTLY_TRUE)
            for _ in range(draw(st.integers(0 if trouble else 2, 8)))
        ]
        inv = Inventory(
            gpus=[
                Gpu(index=g, healthy=ok, problems=[] if ok else ["xid 79"])
                for g, ok in enumerate(healthy)
            ],
            engines=[
                Engine(name=e)
                for e in (draw(st.sampled_from(ENGINE_SETS)) if trouble else ENGINE_SETS[0])
            ],
            memory=Memory(
                total_bytes=draw(st.sampled_from([None, 8 * GIB, 32 * GIB, 64 * GIB]))
                if trouble
                else None
            ),
            labels=draw(st.sampled_from([{}, {"role": "coding"}, {"role": "chat"}])),
            fabric=draw(st.sampled_from(["", "ib-a", "ib-a", "ib-b"])),
            weights=draw(st.sampled_from([[], [local()], [shared()]])),
            weights_scanned=draw(st.booleans()),
        )
        nodes.append(
            facts(
                node_id,
                inv,
                state=draw(st.sampled_from(NodeState)) if trouble else NodeState.READY,
                cordoned=trouble and not draw(MOSTLY_TRUE),
                draining=trouble and not draw(MOSTLY_TRUE),
            )
        )
        used_gpus = draw(st.sets(st.integers(0, 9), max_size=3))  # 9: a GPU that went away
        used_ports = draw(st.sets(st.integers(PORTS[0], PORTS[1] + 1), max_size=2))
        if trouble and not draw(MOSTLY_TRUE):
            used_ports = set(range(PORTS[0], PORTS[1] + 1))  # every port in use
        for port in used_ports or [0]:
            alloc.take(node_id, draw(st.sampled_from(["qwen-coder", "x"])), used_gpus, port)
    profiles = []
    for j in range(draw(st.integers(1, 3))):
        engine = draw(st.sampled_from(["llama.cpp", "vllm", "vllm-ray"]))
        profiles.append(
            profile(
                f"p{j}",
                engine=engine,
                gpus=draw(st.integers(0, 3)),
                nodes=draw(st.integers(2, 3)) if engine == "vllm-ray" else 1,
                min_memory_gb=draw(st.sampled_from([None, None, 0.5, 24.0, 48.0])),
                selector=draw(st.sampled_from([{}, {}, {"role": "coding"}])),
            )
        )
    avoid = frozenset(draw(st.sets(st.sampled_from([f.node.node_id for f in nodes]), max_size=1)))
    return nodes, alloc, model(*profiles), avoid


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_a_decision_never_hands_out_what_is_not_there(
    fleet: tuple[list[NodeFacts], Allocations, Model, frozenset[str]],
) -> None:
    nodes, alloc, m, avoid = fleet
    d = place(m, nodes, alloc, 0.0, avoid=avoid, port_range=PORTS)
    by_id = {f.node.node_id: f for f in nodes}
    assert all(c.reason for c in d.candidates)
    tried = [p.name for p in m.profiles]
    if d.profile is not None:
        tried = tried[: tried.index(d.profile) + 1]
    for name in tried:  # every node considered once for every profile tried
        assert sorted(c.node_id for c in d.candidates if c.profile == name) == sorted(by_id)
    for name in tried[:-1] if d.profile is not None else tried:
        assert not any(c.ok for c in d.candidates if c.profile == name)
    if d.profile is None:
        event("nothing fits")
        assert d.shards == [] and d.summary.startswith("no node can hold qwen-coder: ")
        return
    prof = m.profile(d.profile)
    assert prof is not None
    event(f"placed on {prof.nodes} node(s), {'with' if prof.gpus else 'without'} GPUs")
    ok = {c.node_id for c in d.candidates if c.profile == d.profile and c.ok}
    assert len(d.shards) == prof.nodes
    assert [s.rank for s in d.shards] == list(range(prof.nodes))
    assert len({s.node_id for s in d.shards}) == prof.nodes
    if prof.nodes > 1:
        fabrics = {by_id[s.node_id].node.inventory.fabric for s in d.shards}
        assert len(fabrics) == 1 and "" not in fabrics
    for s in d.shards:
        f = by_id[s.node_id]
        assert s.node_id in ok  # never on a rejected node
        assert f.node.state is NodeState.READY and not f.cordoned and not f.draining
        assert s.node_id not in avoid
        healthy = {g.index for g in f.node.inventory.gpus if g.healthy}
        assert len(s.gpus) == len(set(s.gpus)) == prof.gpus
        assert set(s.gpus) <= healthy  # never unhealthy, never out of range
        assert not set(s.gpus) & alloc.gpus.get(s.node_id, set())  # never allocated
        assert PORTS[0] <= s.port <= PORTS[1]
        assert s.port not in alloc.ports.get(s.node_id, set())


# --- memory is accounted ----------------------------------------------------------------


def cpu(gb: float) -> Profile:
    return profile(engine="llama.cpp", gpus=0, min_memory_gb=gb, model_path="/w/m.gguf")


def test_what_shards_on_a_node_need_is_subtracted_and_said() -> None:
    """Two 24 GiB replicas do not both land on a 32 GiB node, and the words say why."""
    nodes = [facts(n, inventory(gpus=0, memory_gb=32)) for n in ("a", "b")]
    alloc = Allocations()
    first = decide(model(cpu(24), name="m1"), nodes, alloc)
    assert only(first)[0] == "a" and first.memory == 24 * GIB
    assert reasons(first)["a"].endswith("8 GiB of memory left after"), reasons(first)
    alloc.take("a", "m1", [], only(first)[2], memory=first.memory)
    second = decide(model(cpu(24), name="m2"), nodes, alloc)
    assert only(second)[0] == "b"  # not "a", which packing alone would pick
    assert reasons(second)["a"] == "has 32 GiB, 24 GiB held by 1 replica, needs 24 GiB"
    [held] = [c for c in second.candidates if c.node_id == "a"]
    assert (held.kind, held.memory_bytes, held.held_bytes, held.held_by, held.need_bytes) == (
        Kind.MEMORY,
        32 * GIB,
        24 * GIB,
        1,
        24 * GIB,
    )
    assert second.needs == {"p": "24 GiB (min_memory_gb)"}
    alloc.take("b", "m2", [], only(second)[2], memory=second.memory)
    third = decide(model(cpu(24), name="m3"), nodes, alloc)
    assert third.profile is None
    assert "a, b: has 32 GiB, 24 GiB held by 1 replica, needs 24 GiB" in third.summary
    # what is not known is not counted: a node that says nothing, a need nobody knows
    assert decide(model(cpu(24), name="m4"), [facts("c", inventory(gpus=0))], alloc).placed
    unknown = profile(engine="vllm", gpus=1)
    assert decide(model(unknown), [facts("a", inventory(memory_gb=32))], alloc).placed


def test_an_offloaded_llama_needs_cards_that_hold_it() -> None:
    gguf = WeightCopy(model="m", path="/w/m.gguf", size_bytes=20 * GIB, layers=2)
    small = [Gpu(index=0, memory_total_mib=16 * 1024), Gpu(index=1, memory_total_mib=80 * 1024)]
    inv = Inventory(gpus=small, engines=ALL_ENGINES, weights=[gguf], weights_scanned=True)
    p = profile(engine="llama.cpp", gpus=1, model_path="/w/m.gguf", engine_args=["-cram", "0"])
    d = decide(model(p, name="m"), [facts("a", inv)], Allocations())
    assert d.profile is None
    assert reasons(d)["a"] == "GPU 0 has 16 GiB of memory, needs 20 GiB on them"
    # with GPU 0 taken, GPU 1 is the one it would get, and it holds it
    d = decide(model(p, name="m"), [facts("a", inv)], busy("a", [0]))
    assert only(d)[:2] == ("a", [1])


@settings(max_examples=200, deadline=None)
@given(
    memory=st.lists(st.integers(4, 64), min_size=1, max_size=4),
    asks=st.lists(st.integers(1, 40), min_size=1, max_size=20),
)
def test_the_needs_placed_on_a_node_never_exceed_what_it_has(
    memory: list[int], asks: list[int]
) -> None:
    nodes = [facts(f"n{i}", inventory(gpus=0, memory_gb=m)) for i, m in enumerate(memory)]
    alloc = Allocations()
    placed: dict[str, int] = {}  # the naive model: GiB asked, by node
    for i, gb in enumerate(asks):
        d = decide(model(cpu(gb), name=f"m{i}"), nodes, alloc)
        room = [m - placed.get(f"n{j}", 0) for j, m in enumerate(memory)]
        if not d.placed:
            assert max(room) < gb, (room, gb, d.summary)  # refused only when nothing fits
            event("refused")
            continue
        node, gpus, port = only(d)
        alloc.take(node, f"m{i}", gpus, port, memory=d.memory)
        placed[node] = placed.get(node, 0) + gb
    for j, m in enumerate(memory):
        assert placed.get(f"n{j}", 0) <= m, (placed, memory)


def test_an_h200_as_nvidia_smi_reports_it_holds_what_fits_in_its_memory() -> None:
    """The card's memory as the real H200's nvidia-smi output gives it (143,771 MiB)."""
    from llmgw.agent.discovery.gpus import parse_gpu_csv
    from tests.agent.discovery.test_gpus import fixture_query

    fields, output = fixture_query(must_have="memory.total")
    h200 = Inventory(gpus=parse_gpu_csv(output, fields), engines=ALL_ENGINES)
    p = profile(engine="llama.cpp", gpus=1, model_path="/w/m.gguf")
    for gib_, fits in ((150, False), (130, True)):
        gguf = WeightCopy(model="m", path="/w/m.gguf", size_bytes=gib_ * GIB)
        inv = msgspec.structs.replace(h200, weights=[gguf], weights_scanned=True)
        d = decide(model(p, name="m"), [facts("gpu-07", inv)], Allocations())
        assert d.placed is fits, d.summary
        if not fits:
            assert reasons(d)["gpu-07"] == "GPU 0 has 140.4 GiB of memory, needs 150 GiB on them"

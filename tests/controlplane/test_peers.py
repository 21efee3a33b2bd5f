"""Whom a node takes weights from (``peers.weights_peers``) and the chain a prefetch of
many nodes makes (``prefetch.plan_prefetch``)."""

from __future__ import annotations

import msgspec

from llmgw.controlplane.catalog import Model, Profile
from llmgw.controlplane.nodes import Node, NodeState
from llmgw.controlplane.peers import weights_peers
from llmgw.controlplane.prefetch import plan_prefetch
from llmgw.protocol.messages import FETCH, Engine, FetchProgress, Inventory, WeightCopy

SOURCE = "hf://acme/m-GGUF/m.gguf"


def node(
    node_id: str,
    *,
    fabric: str = "ib0",
    port: int = 7445,
    holds: bool = False,
    fetching: bool = False,
    state: NodeState = NodeState.READY,
) -> Node:
    inv = Inventory(
        address=f"10.0.0.{node_id[1:]}",
        fabric=fabric,
        engines=[Engine(name="llama.cpp")],
        weights_dir="/srv/w",
        weights_port=port,
        weights=[WeightCopy(model="m", path="/srv/w/m.gguf", source=SOURCE)] if holds else [],
        fetching=[FetchProgress(source=SOURCE, path="/srv/w/m.gguf")] if fetching else [],
    )
    return Node(
        node_id=node_id,
        inventory=inv,
        peer=f"10.0.0.{node_id[1:]}:5000",
        connection=1,
        connected=state is NodeState.READY,
        state=state,
        last_seen=0.0,
        last_seen_wall=0.0,
        registered_at_wall=0.0,
        can=frozenset({FETCH}),
    )


def table(*nodes: Node) -> dict[str, Node]:
    return {n.node_id: n for n in nodes}


def test_holders_first_then_fetchers_then_those_just_told_all_of_the_takers_fabric() -> None:
    nodes = table(
        node("n1"),
        node("n2", fetching=True),
        node("n3", holds=True),
        node("n4", holds=True, fabric="ib1"),  # another fabric
        node("n5", holds=True, port=0),  # serves nothing
        node("n6", holds=True, state=NodeState.UNREACHABLE),
        node("n7"),
    )
    peers = weights_peers(SOURCE, "n1", nodes, also=["n7", "n2", "n1"])
    assert [p.node_id for p in peers] == ["n3", "n2", "n7"]
    assert (peers[0].host, peers[0].port) == ("10.0.0.3", 7445)
    assert weights_peers(SOURCE, "n4", nodes) == []  # alone in its fabric
    assert weights_peers("", "n1", nodes) == []


def test_a_prefetch_of_many_nodes_is_a_chain_unless_one_holds_the_file() -> None:
    profile = msgspec.convert({"name": "cpu", "engine": "llama.cpp", "source": SOURCE}, Profile)
    model = Model(name="m", replicas=0, profiles=[profile])
    nodes = table(node("n1"), node("n2"), node("n3"), node("n4"))
    done = plan_prefetch(model, nodes)
    chain = {f.node: [p.node_id for p in f.peers] for f in done.fetches}
    # each from the one before it, then (should it go) the ones before that
    assert chain == {"n1": [], "n2": ["n1"], "n3": ["n2", "n1"], "n4": ["n3", "n2", "n1"]}
    assert done.fetches[0].path == "/srv/w/hf/acme/m-GGUF/main/m.gguf"
    nodes["n4"] = node("n4", holds=True)
    done = plan_prefetch(model, nodes)
    chain = {f.node: [p.node_id for p in f.peers] for f in done.fetches}
    assert chain == {"n1": ["n4"], "n2": ["n4", "n1"], "n3": ["n4", "n2", "n1"]}
    assert done.skipped == [("n4", "it holds them already")]

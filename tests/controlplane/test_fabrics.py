"""ctl status's view: per fabric, which models are held, on a filer or in local copies."""

from __future__ import annotations

from llmgw.controlplane.fabrics import describe_copies, fleet_status, missing_weights
from llmgw.protocol.messages import Inventory, WeightCopy
from tests.controlplane.parts import node_table

NFS = WeightCopy(
    model="llama-8b",
    path="/mnt/m/llama-8b",
    storage="shared",
    filesystem="nfs4",
    storage_id="filer:/export",
)


def local(model: str, storage: str = "local", path: str = "") -> WeightCopy:
    return WeightCopy(model=model, path=path or f"/data/{model}", storage=storage)  # type: ignore[arg-type]


def test_one_filer_seen_from_many_nodes_counts_once_and_local_copies_count_per_node() -> None:
    t = node_table(
        {
            f"n{i}": Inventory(
                fabric="ib-a", weights=[NFS, local("qwen-14b")], weights_scanned=True
            )
            for i in range(1, 4)
        }
    )
    [fabric] = fleet_status(t.nodes.values()).fabrics
    llama, qwen = fabric.models
    assert llama.shared == ["filer:/export"]
    assert llama.local_nodes == []
    assert describe_copies(llama) == "shared filer filer:/export"
    assert describe_copies(qwen) == "3 local copies (n1, n2, n3)"


def test_a_model_in_one_fabric_only_is_said_plainly() -> None:
    t = node_table(
        {
            "a1": Inventory(fabric="ib-a", weights=[NFS], weights_scanned=True),
            "b1": Inventory(fabric="ib-b", weights=[local("qwen-14b")], weights_scanned=True),
            "b2": Inventory(fabric="ib-b", weights=[NFS], weights_scanned=True),
        }
    )
    status = fleet_status(t.nodes.values())
    assert [f.fabric for f in status.fabrics] == ["ib-a", "ib-b"]
    assert status.warnings == [
        "qwen-14b is held in fabric ib-b only: ib-a cannot serve it without a copy over "
        "the management network"
    ]


def test_unclassified_storage_is_never_counted_as_shared() -> None:
    t = node_table({"n1": Inventory(weights=[local("m", storage="unknown")], weights_scanned=True)})
    [model] = fleet_status(t.nodes.values()).fabrics[0].models
    assert model.shared == []
    assert model.local_nodes == ["n1"]


def test_nodes_never_asked_to_look_are_named_not_counted_as_empty() -> None:
    t = node_table({"n1": Inventory(), "n2": Inventory(weights_scanned=True)})
    status = fleet_status(t.nodes.values())
    assert status.nodes_not_scanning == ["n1"]
    assert status.fabrics[0].nodes == ["n1", "n2"]


def test_lost_nodes_hold_nothing() -> None:
    t = node_table({"n1": Inventory(fabric="ib-a", weights=[local("m")], weights_scanned=True)})
    t.sweep(61)
    assert fleet_status(t.nodes.values()).fabrics == []


def test_a_catalog_model_no_node_holds_is_warned_about_only_when_nodes_look() -> None:
    looking = node_table({"n1": Inventory(weights=[local("qwen-14b")], weights_scanned=True)})
    wanted = [("qwen", [("qwen-14b", "")]), ("llama", [("llama-8b", ""), ("llama-8b-q4", "")])]
    missing = missing_weights(looking.nodes.values(), wanted)
    assert list(missing) == ["llama"]
    assert missing["llama"].startswith(
        "no node reports the weights of llama (llama-8b, llama-8b-q4)"
    )
    # a node never asked to look is no evidence that the weights are missing
    blind = node_table({"n1": Inventory(weights_scanned=False)})
    assert missing_weights(blind.nodes.values(), wanted) == {}


def test_a_model_path_nobody_looks_in_is_no_evidence_and_one_found_there_is_held() -> None:
    dirs = ["/var/lib/llmgw-weights", "/models/"]
    t = node_table(
        {
            "n1": Inventory(
                weights=[local("qwen2.5-0.5b-q4", path="/models/qwen2.5-0.5b-q4.gguf")],
                weights_scanned=True,
                weights_dirs=dirs,
            )
        }
    )
    nodes = t.nodes.values()
    outside = [("elsewhere", [("elsewhere", "/opt/models/x.gguf")])]
    assert missing_weights(nodes, outside) == {}
    # one of its profiles is outside: unknown, not missing
    mixed = [("m", [("m", "/var/lib/llmgw-weights/m.gguf"), ("m", "/opt/m.gguf")])]
    assert missing_weights(nodes, mixed) == {}
    # inside a weights dir, at any depth, and not there: missing
    inside = [("m", [("m", "/var/lib/llmgw-weights/sub/m.gguf")])]
    assert list(missing_weights(nodes, inside)) == ["m"]
    # found at the model_path, under whatever name discovery gave it: held
    named_apart = [("qwen", [("qwen", "/models/qwen2.5-0.5b-q4.gguf")])]
    assert missing_weights(nodes, named_apart) == {}
    # an agent that does not say where it looks: nothing is known about paths
    old = node_table({"n1": Inventory(weights_scanned=True)})
    assert missing_weights(old.nodes.values(), inside) == {}

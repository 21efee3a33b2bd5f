"""Node liveness as a pure function of reports and an explicit clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.controlplane.nodes import LivenessPolicy, NodeState, NodeTable, awaited
from llmgw.protocol.messages import Engine, Heartbeat, Inventory, Memory

POLICY = LivenessPolicy(unreachable_after=15, lost_after=60)


def table_with(node: str = "n1", now: float = 0.0, connection: int = 1) -> NodeTable:
    t = NodeTable(POLICY)
    t.register(node, Inventory(), peer="10.0.0.1:5000", connection=connection, now=now, wall=now)
    return t


def hb(seq: int = 1, **kw: object) -> Heartbeat:
    return Heartbeat(seq=seq, sent_at=0, **kw)  # type: ignore[arg-type]


def test_silence_moves_ready_to_unreachable_to_lost() -> None:
    t = table_with()
    assert t.sweep(14.9) == []
    [change] = t.sweep(15.0)
    assert (change.old, change.new) == (NodeState.READY, NodeState.UNREACHABLE)
    assert "no heartbeat for 15.0 s" in change.why
    [change] = t.sweep(60.0)
    assert change.new is NodeState.LOST
    assert t.sweep(1e6) == []  # Lost stays Lost until the node registers again


def test_heartbeat_keeps_a_node_ready_and_brings_it_back() -> None:
    t = table_with()
    t.heartbeat("n1", 1, hb(), now=10, wall=10)
    assert t.sweep(24) == []
    t.sweep(26)
    assert t.nodes["n1"].state is NodeState.UNREACHABLE
    [change] = t.heartbeat("n1", 1, hb(2), now=27, wall=27)[0]
    assert change.new is NodeState.READY


def test_closed_stream_is_unreachable_at_once_then_lost() -> None:
    t = table_with()
    [change] = t.disconnected("n1", 1, now=1)
    assert change.new is NodeState.UNREACHABLE
    assert change.why == "agent stream closed"
    t.sweep(61)
    assert t.nodes["n1"].state is NodeState.LOST


def test_reports_from_a_replaced_stream_are_ignored() -> None:
    t = table_with(connection=1)
    t.register("n1", Inventory(), peer="p", connection=2, now=5, wall=5)
    assert t.disconnected("n1", 1, now=6) == []  # the old stream closing changes nothing
    assert t.heartbeat("n1", 1, hb(), now=7, wall=7) == ([], [])
    assert t.nodes["n1"].state is NodeState.READY
    assert t.nodes["n1"].last_seen == 5


def test_memory_from_heartbeats_reaches_the_table_and_is_news_when_it_grows() -> None:
    t = table_with()
    _, news = t.heartbeat(
        "n1", 1, hb(memory=Memory(total_bytes=8 << 30, available_bytes=1)), now=1, wall=1
    )
    assert t.nodes["n1"].inventory.memory.total_bytes == 8 << 30
    _, news = t.heartbeat(
        "n1", 1, hb(memory=Memory(total_bytes=32 << 30, available_bytes=1)), now=2, wall=2
    )
    assert news == ["now has 32.0 GiB of memory"]
    _, news = t.heartbeat("n1", 1, hb(memory=Memory()), now=3, wall=3)
    assert t.nodes["n1"].inventory.memory.total_bytes == 32 << 30  # unknown is not zero


def test_engine_changes_are_news() -> None:
    t = table_with()
    inv = Inventory(engines=[Engine(name="vllm", version="0.11.0")])
    _, news = t.heartbeat("n1", 1, hb(inventory=inv), now=1, wall=1)
    assert news == ["now has vllm 0.11.0"]
    inv2 = Inventory(engines=[Engine(name="vllm", version="0.12.0")])
    _, news = t.heartbeat("n1", 1, hb(inventory=inv2), now=2, wall=2)
    assert news == ["now has vllm 0.12.0 (was 0.11.0)"]
    _, news = t.heartbeat("n1", 1, hb(inventory=Inventory()), now=3, wall=3)
    assert news == ["no longer has vllm"]


@given(
    st.lists(
        st.tuples(st.sampled_from(["hb", "sweep", "drop", "register"]), st.floats(0, 30)),
        max_size=40,
    )
)
def test_state_always_matches_the_definition(steps: list[tuple[str, float]]) -> None:
    """Whatever happens, a sweep leaves every node in exactly the state liveness defines."""
    t = table_with()
    now, connection, connected, last_seen = 0.0, 1, True, 0.0
    for action, dt in steps:
        now += dt
        if action == "hb":
            t.heartbeat("n1", connection, hb(), now=now, wall=now)
            if connected:
                last_seen = now
        elif action == "drop":
            t.disconnected("n1", connection, now=now)
            connected = False
        elif action == "register":
            connection += 1
            t.register("n1", Inventory(), peer="p", connection=connection, now=now, wall=now)
            connected, last_seen = True, now
        t.sweep(now)
        silent = now - last_seen
        node = t.nodes["n1"]
        if silent >= 60:
            assert node.state is NodeState.LOST
        elif node.state is not NodeState.LOST:
            expect_ready = connected and silent < 15
            assert (node.state is NodeState.READY) == expect_ready


def test_a_node_known_from_before_is_awaited_until_it_registers_or_is_lost() -> None:
    """Lost once silent for lost_after counted from this start, as any node; its
    registration is no news about an inventory this table never had."""
    t = table_with("n2")
    assert t.expect(["n1", "n2"], now=10, wall=10) == ["n1"]  # n2 is here already
    assert t.nodes["n1"].state is NodeState.UNREACHABLE and t.nodes["n1"].awaited
    assert awaited(t.nodes.values()) == ["n1"]
    assert not t.nodes["n2"].awaited
    changes, news = t.register(
        "n1", Inventory(engines=[Engine(name="llama.cpp")]), peer="p", connection=2, now=20, wall=20
    )
    assert [(c.old, c.new) for c in changes] == [(NodeState.UNREACHABLE, NodeState.READY)]
    assert news == [] and awaited(t.nodes.values()) == []
    t = NodeTable(POLICY)
    t.expect(["n1"], now=10, wall=10)
    assert t.sweep(69) == []
    [change] = t.sweep(70)
    assert change.new is NodeState.LOST and "silent for 60 s" in change.why
    assert awaited(t.nodes.values()) == []  # Lost: not awaited any more

"""The session state machine and codec, without sockets (they are sans-I/O)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.protocol import (
    TRANSITIONS,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Role,
    Session,
    State,
    decode,
    encode,
    negotiate,
)
from llmgw.protocol.errors import (
    CloseCode,
    IdentityMismatch,
    MalformedMessage,
    MessageTooLarge,
    OutOfOrder,
    UnknownMessageType,
    VersionMismatch,
    clip_reason,
)
from llmgw.protocol.exits import exit_fields, exit_words, signal_name
from llmgw.protocol.messages import (
    MESSAGE_TYPES,
    DrainShard,
    Heartbeat,
    Inventory,
    Memory,
    ProcessKill,
    Register,
    RegisterAck,
    ShardSpec,
    ShardStatus,
    SleepShard,
    StartShard,
    StopShard,
    WakeShard,
)


def register(node: str = "n1") -> Register:
    return Register(node_id=node, inventory=Inventory(hostname=node))


def ack(node: str = "n1") -> RegisterAck:
    return RegisterAck(node_id=node, heartbeat_interval_s=5)


def hb(seq: int = 1) -> Heartbeat:
    return Heartbeat(seq=seq, sent_at=1.0, memory=Memory(total_bytes=8 << 30))


def spec() -> ShardSpec:
    return ShardSpec(shard_id="s1", replica_id="r1", model="m", profile="p", engine="llama.cpp")


def pair(identity: str | None = "n1") -> tuple[Session, Session]:
    return Session(Role.AGENT), Session(Role.CONTROL_PLANE, peer_identity=identity)


def test_register_ack_heartbeat_and_commands_flow_both_ways() -> None:
    agent, cp = pair()
    got = cp.receive(agent.send(register()))
    assert got == register() and cp.state is State.REGISTERING and cp.node_id == "n1"
    assert agent.receive(cp.send(ack())) == ack()
    assert agent.registered and cp.registered
    assert cp.receive(agent.send(hb())) == hb()
    status = ShardStatus(shard_id="s1", state="failed", output_tail=["oom"])
    assert cp.receive(agent.send(status)) == status
    for command in (
        StartShard(spec=spec()),
        StopShard(shard_id="s1"),
        DrainShard(shard_id="s1"),
        SleepShard(shard_id="s1", grace_s=5),
        WakeShard(shard_id="s1"),
    ):
        assert agent.receive(cp.send(command)) == command


def test_heartbeat_before_registration_is_out_of_order() -> None:
    _, cp = pair()
    with pytest.raises(OutOfOrder, match="Heartbeat while this side is awaiting register"):
        cp.receive(encode(hb()))
    assert cp.state is State.ERROR
    with pytest.raises(LocalProtocolError):
        cp.receive(encode(register()))  # terminal: nothing more is accepted


def test_control_plane_may_not_command_before_acknowledging() -> None:
    agent, cp = pair()
    cp.receive(agent.send(register()))
    with pytest.raises(LocalProtocolError, match="may not send StartShard while registering"):
        cp.send(StartShard(spec=spec()))


def test_agent_may_not_send_commands_or_heartbeat_before_ack() -> None:
    agent, _ = pair()
    with pytest.raises(LocalProtocolError):
        agent.send(hb())
    _, cp = pair()
    # an agent sending a down-message is out of order for the control plane
    with pytest.raises(OutOfOrder):
        cp.receive(encode(StartShard(spec=spec())))


def test_second_register_is_out_of_order() -> None:
    agent, cp = pair()
    cp.receive(agent.send(register()))
    agent.receive(cp.send(ack()))
    with pytest.raises(OutOfOrder):
        cp.receive(encode(register()))


def test_identity_is_proved_by_the_certificate() -> None:
    _, cp = pair(identity="node-b")
    with pytest.raises(IdentityMismatch) as info:
        cp.receive(encode(register("node-a")))
    assert "'node-b'" in info.value.reason and "'node-a'" in info.value.reason
    assert info.value.code == CloseCode.IDENTITY_MISMATCH
    assert cp.state is State.ERROR


def test_empty_node_id_is_refused() -> None:
    _, cp = pair(identity=None)
    with pytest.raises(IdentityMismatch, match="empty node id"):
        cp.receive(encode(register("")))


def test_text_frames_are_refused() -> None:
    _, cp = pair()
    with pytest.raises(MalformedMessage, match="text frame"):
        cp.receive("hello")


def test_unknown_tag_and_malformed_are_told_apart() -> None:
    with pytest.raises(UnknownMessageType, match="'Reboot'"):
        decode(msgspec.msgpack.encode({"type": "Reboot", "node_id": "x"}))
    with pytest.raises(MalformedMessage, match="node_id"):
        decode(msgspec.msgpack.encode({"type": "Register", "node_id": 5, "inventory": {}}))
    with pytest.raises(MalformedMessage, match="not MessagePack"):
        decode(b"\xc1")
    with pytest.raises(MalformedMessage):
        decode(msgspec.msgpack.encode([1, 2, 3]))


def test_size_limit_is_checked_before_decoding() -> None:
    big = encode(Register(node_id="n1", inventory=Inventory(labels={"x": "y" * 5000})))
    with pytest.raises(MessageTooLarge, match="exceeds the limit of 1000"):
        decode(big, max_bytes=1000)
    _, cp = pair()
    cp.max_message_bytes = 1000
    with pytest.raises(MessageTooLarge):
        cp.receive(big)


def test_unknown_fields_from_a_newer_peer_are_ignored() -> None:
    data = msgspec.msgpack.encode(
        {"type": "Heartbeat", "seq": 3, "sent_at": 1.5, "from_the_future": [1, 2]}
    )
    assert decode(data) == Heartbeat(seq=3, sent_at=1.5)


def test_kills_ride_on_a_heartbeat_that_an_older_control_plane_still_reads() -> None:
    kill = ProcessKill(
        pid=4242,
        reason="did not stop 10 s after SIGTERM",
        kind="stop_timeout",
        shard_id="s1",
        command="llama-server --port 20001",
        killed_at=1.5,
    )
    agent, cp = pair()
    cp.receive(agent.send(register()))
    agent.receive(cp.send(ack()))
    data = agent.send(Heartbeat(seq=1, sent_at=2.0, kills=[kill]))
    got = cp.receive(data)
    assert isinstance(got, Heartbeat) and got.kills == [kill]
    assert cp.registered

    # a control plane from before kills were reported: its Heartbeat had no such
    # field, and it reads the same bytes without refusing the stream
    class OldHeartbeat(msgspec.Struct, tag="Heartbeat", tag_field="type"):
        seq: int
        sent_at: float
        memory: Memory = msgspec.field(default_factory=Memory)
        inventory: Inventory | None = None

    old = msgspec.msgpack.decode(data, type=OldHeartbeat | Register)
    assert old == OldHeartbeat(seq=1, sent_at=2.0)
    # a kind this control plane does not know is a string like any other
    newer = msgspec.msgpack.encode(
        {
            "type": "Heartbeat",
            "seq": 2,
            "sent_at": 3.0,
            "kills": [{"pid": 7, "reason": "r", "kind": "oom"}],
        }
    )
    assert cp.receive(newer) == Heartbeat(
        seq=2, sent_at=3.0, kills=[ProcessKill(pid=7, reason="r", kind="oom")]
    )
    # and a heartbeat without kills is the same bytes as before
    assert b"kills" not in encode(hb())


def test_version_negotiation() -> None:
    assert negotiate(["llmgw.agent.v1"]) == "llmgw.agent.v1"
    with pytest.raises(
        VersionMismatch, match=r"agent speaks llmgw.agent.v9; .* speaks llmgw.agent.v1"
    ):
        negotiate(["llmgw.agent.v9"])
    with pytest.raises(VersionMismatch, match="no subprotocol"):
        negotiate([])


def test_close_reasons_fit_in_a_close_frame() -> None:
    reason = clip_reason("é" * 200)
    assert len(reason.encode()) <= 123 and reason.endswith("...")
    assert clip_reason("short") == "short"


def test_transition_table_only_names_real_messages() -> None:
    for role, state, _, kind in TRANSITIONS:
        assert kind in MESSAGE_TYPES
        assert state not in (State.CLOSED, State.ERROR)
        assert isinstance(role, Role)


# --- fuzzing: only the protocol's own errors may come out --------------------

messages = st.sampled_from(
    [register(), register("other"), ack(), hb(), ShardStatus(shard_id="s", state="ready")]
    + [Heartbeat(seq=2, sent_at=1.0, kills=[ProcessKill(pid=9, reason="stray", kind="stray")])]
    + [StartShard(spec=spec()), StopShard(shard_id="s"), DrainShard(shard_id="s")]
)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_raises_only_protocol_errors_on_arbitrary_bytes(data: bytes) -> None:
    try:
        decode(data)
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("recv"), messages.map(encode)),
            st.tuples(st.just("recv"), st.binary(max_size=64)),
            st.tuples(st.just("send"), messages),
        ),
        max_size=12,
    ),
    st.sampled_from(list(Role)),
)
def test_session_raises_only_protocol_errors_on_arbitrary_sequences(
    steps: list[tuple[str, object]], role: Role
) -> None:
    session = Session(role, peer_identity="n1")
    for kind, item in steps:
        before = session.state
        try:
            if kind == "recv":
                assert isinstance(item, bytes)
                session.receive(item)
            else:
                session.send(item)  # type: ignore[arg-type]
        except ProtocolError:
            assert session.state is State.ERROR or before in (State.CLOSED, State.ERROR)
        else:
            assert session.state not in (State.ERROR, State.CLOSED)


def test_how_an_engine_ended_rides_on_a_status_that_older_peers_still_read() -> None:
    """``exit_code`` and ``signal`` are numbers beside the words of ``detail``: an older
    control plane reads the words and ignores the numbers; an older agent's status,
    without them, reads as not saying."""
    agent, cp = pair()
    cp.receive(agent.send(register()))
    agent.receive(cp.send(ack()))
    status = ShardStatus(
        shard_id="s1", state="failed", detail="engine killed by signal 9 (SIGKILL)", signal=9
    )
    data = agent.send(status)
    assert cp.receive(data) == status

    class OldShardStatus(msgspec.Struct, tag="ShardStatus", tag_field="type"):
        shard_id: str
        state: str
        detail: str = ""

    old = msgspec.msgpack.decode(data, type=OldShardStatus | Register)
    assert old == OldShardStatus(shard_id="s1", state="failed", detail=status.detail)
    older = msgspec.msgpack.encode(
        {"type": "ShardStatus", "shard_id": "s1", "state": "failed", "detail": "engine exited 1"}
    )
    got = cp.receive(older)
    assert isinstance(got, ShardStatus) and (got.exit_code, got.signal) == (None, None)
    # a status that says nothing of an exit is the same bytes as before
    assert b"exit_code" not in encode(ShardStatus(shard_id="s1", state="ready"))


def test_an_exit_in_numbers_and_in_words() -> None:
    assert exit_fields(0) == (0, None)
    assert exit_fields(3) == (3, None)
    assert exit_fields(-9) == (None, 9)
    assert exit_fields(None) == (None, None)
    assert exit_words(1, None) == "exited with code 1"
    assert exit_words(None, 9) == "killed by signal 9 (SIGKILL)"
    assert exit_words(None, 200) == "killed by signal 200"
    assert exit_words(None, None) == "exited"
    assert (signal_name(15), signal_name(200)) == ("SIGTERM", "200")

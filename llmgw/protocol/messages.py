"""Wire types of the agent stream: one tagged union of msgspec Structs.

Every WebSocket binary message is exactly one of these, MessagePack-encoded,
tagged by its class name in the ``type`` field. Rules for evolving them
(msgspec's schema-evolution guide): a new field always gets a default, a
field's type never changes, nothing is renumbered because nothing is
positional. Unknown fields are *ignored*, not refused: agents and control
planes are upgraded one at a time, and a newer agent's extra field must not
take a node out of the fleet. Incompatible changes bump the subprotocol
version instead (see ``version.py``).

Unknowns are not zeros: a field the agent could not find out is ``None``
(memory, temperature, ...), never ``0``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

import msgspec


class _Wire(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of the nested (untagged) wire structs."""


# --- inventory --------------------------------------------------------------


class Memory(_Wire, frozen=True):
    total_bytes: int | None = None
    available_bytes: int | None = None


class Gpu(_Wire, frozen=True):
    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    driver_version: str = ""
    compute_capability: str = ""
    healthy: bool = True
    problems: list[str] = []  # in words: "pending retired pages", ...


class IbPort(_Wire, frozen=True):
    port: int
    state: str = ""  # "ACTIVE", "DOWN", ...
    rate: str = ""


class IbAdapter(_Wire, frozen=True):
    name: str
    ports: list[IbPort] = []
    fabric: str = ""  # cannot be discovered; comes from configuration


class Engine(_Wire, frozen=True):
    name: str  # "llama.cpp", "vllm", "ray"
    version: str = ""
    path: str = ""


class WeightCopy(_Wire, frozen=True):
    model: str
    path: str
    format: str = ""  # "gguf", "hf"
    size_bytes: int | None = None
    storage: Literal["local", "shared", "unknown"] = "unknown"
    filesystem: str = ""  # mount type: "ext4", "nfs4", "lustre", ...
    storage_id: str = ""  # identifies one shared filer seen from many nodes
    # GGUF: what its KV cache holds per token of context, all layers together, in
    # elements (the control plane's memory estimate); None: not known
    layers: int | None = None
    kv_k_per_token: int | None = None
    kv_v_per_token: int | None = None
    # the source it was fetched from (``hf://...``, ``https://...``), as a profile names
    # it; empty: not fetched by an agent (put there by hand, or by an older agent)
    source: str = ""
    # when an engine last started on it (wall clock, s since the epoch), else when it
    # was last written; None: not said (an older agent). A disk budget evicts the
    # longest unused first
    last_used: float | None = None


class WeightsPeer(_Wire, frozen=True):
    """An agent to take weights from: its node id (its certificate's name) and where
    its transfer listener is (``[weights] peer_listen``)."""

    node_id: str
    host: str
    port: int


class FetchProgress(_Wire, frozen=True):
    """A fetch of weights under way on a node: how far, how fast, and from where."""

    source: str  # as the profile names it
    path: str  # where it lands on the node
    done_bytes: int = 0
    total_bytes: int | None = None  # None: not known yet (the source not asked yet)
    rate_bps: float = 0.0  # bytes per second lately
    peer: str = ""  # the node it comes from; empty: from the source itself


class Inventory(_Wire, frozen=True):
    hostname: str = ""
    address: str = ""
    cpus: int | None = None
    memory: Memory = msgspec.field(default_factory=Memory)
    gpus: list[Gpu] = []
    infiniband: list[IbAdapter] = []
    fabric: str = ""
    engines: list[Engine] = []
    weights: list[WeightCopy] = []
    weights_scanned: bool = False  # False: never asked to look (not "looked, found none")
    # the directories it looked in (absolute); [] from an agent older than the field
    weights_dirs: list[str] = []
    # where fetched weights land (absolute; ``[weights] default_dir``); empty: an older
    # agent, which fetches nothing
    weights_dir: str = ""
    # what the weights in weights_dir may take ([weights] budget_gb); None: no budget
    weights_budget_bytes: int | None = None
    # the port of its weights transfer listener, for agents of its fabric to take
    # weights from (on its ``address``); 0: it serves none
    weights_port: int = 0
    # sources whose last fetch here found no room (disk or budget), for a few minutes:
    # placement puts their replicas elsewhere meanwhile
    weights_no_room: list[str] = []
    # fetches under way (a partial copy: placement prefers the node to one without);
    # their figures are the latest, and a change of figures alone is not news
    fetching: list[FetchProgress] = []
    labels: dict[str, str] = {}
    port_range: list[int] = []  # [low, high]: the ports the agent lets engines use; [] = default
    # what the agent finds wrong with its node, in words (its state dir full, ...)
    problems: list[str] = []
    # engine ports something listens on that no shard of the agent is (an engine whose
    # records were lost, left running): placement leaves them alone
    busy_ports: list[int] = []


# --- shards -----------------------------------------------------------------


class ShardState(StrEnum):
    """Where a shard stands, as its agent says it (``agent/lifecycle.py`` maps its own
    phases to these). On the wire each is its value, a string, as it always was: an
    enum of strings encodes as the string, and a value not here is refused as before."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    # its engine sleeps (``SleepShard``): its process runs, its GPU memory is free, it
    # serves nothing until woken (``WakeShard``). Sent only to a control plane that asked
    SLEEPING = "sleeping"


class ShardSpec(_Wire, frozen=True):
    """Everything an agent needs to run one shard, and to describe it back."""

    shard_id: str
    replica_id: str
    model: str
    profile: str
    engine: str  # "llama.cpp", "vllm", "vllm-ray"
    rank: int = 0
    world_size: int = 1
    gpus: list[int] = []
    host: str = "127.0.0.1"
    port: int = 0
    model_path: str = ""
    engine_args: list[str] = []
    env: dict[str, str] = {}
    settings: dict[str, str | int | float | bool] = {}
    startup_timeout_s: float = 600.0
    head_address: str = ""  # multi-node: where rank 0's Ray head listens
    # SIGTERM to SIGKILL when it is stopped (its profile's); None: the agent's own
    stop_grace_s: float | None = None
    # the node the control plane placed it on, and the control plane's seal over that
    # placement (``controlplane.claims``): an agent reports them back as it was given
    # them, and a report whose spec names another node is refused. Empty: placed by
    # an older control plane
    node_id: str = ""
    seal: str = ""
    # start the engine able to sleep (``SleepShard``; vLLM: ``--enable-sleep-mode``);
    # sent only where the engine can (``EngineAdapter.sleeps``) and its profile asks
    sleep: bool = False
    # fetch the weights before the engine starts (a profile's ``source``): the agent
    # brings them to ``model_path`` first, verified by ``weights_sha256`` where given,
    # and fails the shard when no byte came for ``fetch_stall_s``. The startup timeout
    # counts from when they are whole. Empty: they must be at ``model_path`` already
    weights_source: str = ""
    weights_sha256: str = ""
    fetch_stall_s: float = 120.0
    # agents of its fabric that hold those weights or are fetching them, to take them
    # from before the source, in order; empty: from the source
    weights_peers: list[WeightsPeer] = []


class ShardReport(_Wire, frozen=True):
    spec: ShardSpec
    state: ShardState
    pid: int | None = None
    detail: str = ""
    healthy: bool = True  # as in ShardStatus
    engine_key: str = ""  # as in ShardStatus
    fetching: FetchProgress | None = None  # as in ShardStatus


class ProcessKill(_Wire, frozen=True):
    """A process the agent killed: a stray, or an engine that outlived its stop grace.

    ``kind`` is a string, not a closed set: a kind a newer agent adds must not
    make an older control plane refuse the heartbeat that carries it (it
    counts an unknown kind as ``other``).
    """

    pid: int
    reason: str  # in words: "did not stop 10 s after SIGTERM"
    kind: str = "other"  # "stray", "stop_timeout", "other"
    shard_id: str = ""  # empty: no shard describes it (a stray)
    command: str = ""  # its command line, cut short
    killed_at: float | None = None  # the agent's wall clock, seconds since the epoch


# --- messages ---------------------------------------------------------------


class Message(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag=True
):
    """Base of every message on the stream."""


class Register(Message, frozen=True):
    """Up, first message of every connection: who I am, what I have, what I run.

    ``shards`` lists *every* shard the agent runs; an empty list is news (the
    control plane lets go of whatever it believed this node runs).

    ``check_only`` (``llmgw agent --check``): prove the identity and hear the
    ack, nothing more. The control plane acks and closes (1000) without
    touching its node table, so a preflight never disturbs the node's running
    agent; an older control plane ignores the field and registers the node.
    """

    node_id: str
    inventory: Inventory
    shards: list[ShardReport] = []
    agent_version: str = ""
    check_only: bool = False
    # where this agent serves its Prometheus metrics ("host:port"; empty: nowhere), for
    # the control plane's service discovery; a wildcard host means the node's address
    metrics_address: str = ""
    # random, one per agent process: the same agent reconnecting says the same one, so
    # the control plane tells it from a second agent for the node (empty: an older agent)
    agent_instance: str = ""
    # what this agent does beyond what every agent does, by name: "sleep" (it obeys
    # ``SleepShard`` and ``WakeShard``). A control plane sends a command only to an
    # agent that names it; an older agent names nothing
    can: list[str] = []


class RegisterAck(Message, frozen=True):
    """Down: registration accepted; heartbeat at this interval."""

    node_id: str
    heartbeat_interval_s: float
    server_version: str = ""


class Heartbeat(Message, frozen=True):
    """Up: memory every time, the inventory only when it changed, and what the
    agent killed since the last one.

    ``kills`` rides on the heartbeat rather than in a message of its own: a
    control plane that does not know a message type closes the stream (4005),
    but it ignores a field it does not know, so an older one keeps the node.
    An agent with kills to report sends its heartbeat early.
    """

    seq: int
    sent_at: float  # the agent's wall clock, seconds since the epoch
    memory: Memory = msgspec.field(default_factory=Memory)
    inventory: Inventory | None = None
    kills: list[ProcessKill] = []
    # the fetches of weights under way, with their latest figures, every time while
    # there are any (the inventory lists them only as they begin and end); None: from
    # an older agent, or none
    fetching: list[FetchProgress] | None = None


class ShardStatus(Message, frozen=True):
    """Up: a shard moved; on failure, the engine's output tail says why."""

    shard_id: str
    state: ShardState
    detail: str = ""
    output_tail: list[str] = []
    pid: int | None = None
    # a ready engine that stopped answering its health check is still ready (its
    # process runs, and may come back): False takes it out of routing until it answers
    healthy: bool = True
    # the secret the engine wants as ``Authorization: Bearer``, made by the agent when
    # it launched the engine; routers send it. Empty: the engine takes no key (an
    # older agent), or the report says nothing new about it
    engine_key: str = ""
    # how the engine ended, on a ``failed`` that its end caused (``exits``): the code it
    # exited with, or the number of the signal that ended it; both None otherwise, or
    # from an older agent, whose ``detail`` alone says it in words
    exit_code: int | None = None
    signal: int | None = None
    # a ``starting`` shard whose weights are being fetched: how far (sent every few
    # seconds while it lasts); None once they are whole, or from an older agent
    fetching: FetchProgress | None = None


class StartShard(Message, frozen=True):
    spec: ShardSpec


class StopShard(Message, frozen=True):
    """Down: SIGTERM the shard's process group, SIGKILL after the grace.

    ``agent_grace``: the agent picks the grace, the shard spec's ``stop_grace_s``
    (its profile's) or else its own ``[engines] stop_grace_s``; ``grace_s`` is then
    only for an agent older than the field, which ignores it."""

    shard_id: str
    grace_s: float = 10.0
    agent_grace: bool = False


class DrainShard(Message, frozen=True):
    shard_id: str
    grace_s: float = 60.0


class SleepShard(Message, frozen=True):
    """Down: finish in-flight work (up to ``grace_s``), then the engine sleeps: its
    process stays, its GPU memory is freed; the shard reports ``sleeping``. An engine
    that cannot (no answer, a refusal) is stopped instead, and says why. Sent only to
    an agent that can (``Register.can``) for a shard started able to (``spec.sleep``)."""

    shard_id: str
    grace_s: float = 60.0


class WakeShard(Message, frozen=True):
    """Down: a sleeping shard's engine wakes; the shard reports ``starting``, then
    ``ready`` once it answers its health check (or ``failed``, saying why)."""

    shard_id: str


class FetchWeights(Message, frozen=True):
    """Down: fetch a profile's weights to ``path`` now, for no shard yet (``ctl weights
    prefetch``), as a shard's start would (``ShardSpec.weights_source``): its progress
    rides on heartbeats (``Heartbeat.fetching``), a failure is logged by the agent, and
    a file already whole there costs a look at the disk. Sent only to an agent that
    can (``Register.can``)."""

    source: str
    path: str
    sha256: str = ""
    stall_s: float = 120.0
    peers: list[WeightsPeer] = []  # as ``ShardSpec.weights_peers``


SLEEP = "sleep"  # ``Register.can``: the agent obeys SleepShard and WakeShard
FETCH = "fetch"  # ``Register.can``: the agent obeys FetchWeights

UpMessage = Register | Heartbeat | ShardStatus
DownMessage = (
    RegisterAck | StartShard | StopShard | DrainShard | SleepShard | WakeShard | FetchWeights
)
AnyMessage = (
    Register
    | Heartbeat
    | ShardStatus
    | RegisterAck
    | StartShard
    | StopShard
    | DrainShard
    | SleepShard
    | WakeShard
    | FetchWeights
)

MESSAGE_TYPES: tuple[type[Message], ...] = (
    Register,
    Heartbeat,
    ShardStatus,
    RegisterAck,
    StartShard,
    StopShard,
    DrainShard,
    SleepShard,
    WakeShard,
    FetchWeights,
)

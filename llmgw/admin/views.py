"""What the management API says about the fleet: JSON shapes shared with ``ctl``.

Every answer of the API is one of these Structs, built here from the control
plane's own objects and encoded by the API; ``ctl`` decodes the same Structs
(``llmgw.cli.admin_client``), so a field is declared once and both sides agree
on it. A field added later has a default, so a ``ctl`` older or newer than its
server still reads what it knows (unknown fields are ignored); a field's type
never changes. Views carry words (a state's value, a candidate's kind), not the
control plane's enums: a new state on the server is not an undecodable answer
to an older ``ctl``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from llmgw.controlplane.failures import Failure
from llmgw.controlplane.nodes import Node
from llmgw.controlplane.replicas import Replica
from llmgw.controlplane.tenants import Key, Tenant
from llmgw.protocol.messages import FetchProgress, Gpu, IbAdapter, WeightCopy
from llmgw.routing import Limits, TrafficView, UsageRow

if TYPE_CHECKING:  # ctl imports these views: it need not load placement for a type
    from llmgw.controlplane.catalog import Model
    from llmgw.controlplane.placement import Decision
    from llmgw.controlplane.scaling import Scaling


class GpuView(msgspec.Struct, kw_only=True):
    index: int
    name: str
    healthy: bool
    problems: list[str]
    memory_total_mib: int | None


class NodeView(msgspec.Struct, kw_only=True):
    node_id: str
    address: str
    peer: str
    state: str
    connected: bool
    last_seen: float  # wall clock, seconds since the epoch
    registered_at: float
    cpus: int | None
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    gpus: list[GpuView]
    engines: dict[str, str]
    fabric: str
    infiniband: list[IbAdapter]
    weights: list[WeightCopy]
    weights_scanned: bool
    labels: dict[str, str]
    weights_dirs: list[str] = []  # where its agent looks for weights
    weights_dir: str = ""  # where its fetched weights land
    weights_port: int = 0  # its weights transfer listener's port; 0: it serves none
    fetching: list[FetchProgress] = []  # its fetches under way, as last sent
    shards: int = 0  # the shards of the control plane's replicas on it now
    cordoned: bool = False
    draining: bool = False
    drained: bool = False  # draining, and nothing of the control plane's runs there
    version: str = ""  # its agent's, as said at registration: "0.1.0 (build 1a2b3c4d5e6f)"
    problems: list[str] = []  # what its agent finds wrong with it: "state dir ... is full"
    # known from before the control plane started, not back since (Lost lost_after later)
    awaited: bool = False


def _gpu(g: Gpu) -> GpuView:
    return GpuView(
        index=g.index,
        name=g.name,
        healthy=g.healthy,
        problems=list(g.problems),
        memory_total_mib=g.memory_total_mib,
    )


class GpuViews:
    """GPU views, rebuilt only when a node's GPU list changes.

    A heartbeat replaces a node's inventory (its memory reading) but keeps the
    same GPU list object, so the list's identity says whether anything changed;
    building 8,000 views on every ``/v1/nodes`` call would stall heartbeats.
    """

    def __init__(self) -> None:
        self._cache: dict[str, tuple[list[Gpu], list[GpuView]]] = {}

    def __call__(self, node: Node) -> list[GpuView]:
        gpus = node.inventory.gpus
        hit = self._cache.get(node.node_id)
        if hit is not None and hit[0] is gpus:
            return hit[1]
        views = [_gpu(g) for g in gpus]
        self._cache[node.node_id] = (gpus, views)
        return views


def node_view(node: Node, gpu_views: GpuViews | None = None) -> NodeView:
    inv = node.inventory
    return NodeView(
        node_id=node.node_id,
        address=node.address,
        peer=node.peer,
        state=node.state.value,
        connected=node.connected,
        last_seen=node.last_seen_wall,
        registered_at=node.registered_at_wall,
        cpus=inv.cpus,
        memory_total_bytes=inv.memory.total_bytes,
        memory_available_bytes=inv.memory.available_bytes,
        gpus=gpu_views(node) if gpu_views is not None else [_gpu(g) for g in inv.gpus],
        engines={e.name: e.version for e in inv.engines},
        fabric=inv.fabric,
        infiniband=list(inv.infiniband),
        weights=list(inv.weights),
        weights_scanned=inv.weights_scanned,
        labels=dict(inv.labels),
        weights_dirs=list(inv.weights_dirs),
        weights_dir=inv.weights_dir,
        weights_port=inv.weights_port,
        fetching=list(inv.fetching),
        version=node.agent_version,
        problems=list(inv.problems),
        awaited=node.awaited,
    )


class ShardView(msgspec.Struct, kw_only=True):
    shard_id: str
    node_id: str
    rank: int
    state: str
    detail: str
    port: int
    gpus: list[int]
    output_tail: list[str]
    healthy: bool = True  # False: ready, but not answering its health checks
    # False: learned from a report, its engine not yet found to be what the report says
    verified: bool = True
    unverified_why: str = ""  # why its last probe failed ("" not probed yet)
    # its weights are being fetched before its engine starts: how far, as its agent said
    fetching: FetchProgress | None = None


class ReplicaView(msgspec.Struct, kw_only=True):
    replica_id: str
    model: str
    profile: str
    state: str
    why: str
    leaving: bool
    # why it is leaving: a ``MoveKind``'s value (drain, surplus, outdated, spread,
    # removed, failed, stopped; ``moves.TABLE``), "" if it is not
    leaving_why: str = ""
    outdated: bool = False  # it runs an earlier version of its profile (a rollout replaces it)
    adopted: bool
    state_since: float  # seconds ago
    shards: list[ShardView]
    healthy: bool = True  # False: a shard's engine is not answering; it is not routed
    verified: bool = True  # False: an engine not yet found to be what was reported; not routed
    traffic: TrafficView | None = None  # the in-process router's view, if it runs


def replica_view(r: Replica, now: float, traffic: TrafficView | None = None) -> ReplicaView:
    return ReplicaView(
        replica_id=r.replica_id,
        model=r.model,
        profile=r.profile,
        state=r.state.value,
        why=r.why,
        leaving=r.leaving is not None,
        leaving_why=r.leaving.value if r.leaving is not None else "",
        outdated=r.outdated,
        adopted=r.adopted,
        state_since=max(0.0, now - r.state_since),
        healthy=r.healthy,
        verified=r.verified,
        shards=[
            ShardView(
                shard_id=s.shard_id,
                node_id=s.node_id,
                rank=s.rank,
                state=s.state_word,
                detail=s.detail,
                port=s.spec.port,
                gpus=list(s.spec.gpus),
                output_tail=s.output_tail[-10:],
                healthy=s.healthy,
                verified=s.verified,
                unverified_why=s.unverified_why,
                fetching=s.fetching,
            )
            for s in sorted(r.shards, key=lambda s: s.rank)
        ],
        traffic=traffic,
    )


class RunningView(msgspec.Struct, kw_only=True):
    """A replica that exists now, as ``explain-placement`` lists it."""

    replica_id: str
    profile: str
    state: str
    leaving: bool
    nodes: list[str]  # its shards' nodes, in rank order


def running_view(r: Replica) -> RunningView:
    return RunningView(
        replica_id=r.replica_id,
        profile=r.profile,
        state=r.state.value,
        leaving=r.leaving is not None,
        nodes=[s.node_id for s in sorted(r.shards, key=lambda s: s.rank)],
    )


class FailureView(msgspec.Struct, kw_only=True):
    model: str
    replica_id: str
    shard_id: str
    node_id: str
    reason: str
    exit_code: int | None
    signal: str | None
    output_tail: list[str]
    at: float  # wall clock, seconds since the epoch
    ago_s: float


def failure_view(f: Failure, wall_now: float) -> FailureView:
    return FailureView(
        model=f.model,
        replica_id=f.replica_id,
        shard_id=f.shard_id,
        node_id=f.node_id,
        reason=f.reason,
        exit_code=f.exit_code,
        signal=f.signal,
        output_tail=list(f.output_tail),
        at=f.at,
        ago_s=max(0.0, wall_now - f.at),
    )


class ScalingView(msgspec.Struct, kw_only=True):
    """A ranged model's scaling: its range, what it follows, and its last change."""

    min: int
    max: int
    target: float  # requests at once one replica should carry
    idle_s: float
    pinned: int | None = None  # an operator's count (``ctl scale``), until released
    in_flight: int = 0  # at every router, as the last pass read it
    waiting: int = 0  # queued or held in routers
    last_change: str = ""  # "2 → 3: 14 requests at once for 15 s, 4 each at most"
    last_change_ago_s: float | None = None
    start_s: float | None = None  # a start's time, measured (median of the last few)
    wake_s: float | None = None  # a sleeping replica's wake, measured (the same)
    # why it runs fewer than its demand wants: another model's floor goes first
    yielding: str = ""


class FetchingView(msgspec.Struct, kw_only=True):
    """A shard of a model whose weights are being fetched: where, and how far."""

    replica_id: str
    node_id: str
    progress: FetchProgress


class ModelView(msgspec.Struct, kw_only=True):
    model: str
    wanted: int  # now: for a range, what demand (or a pin) says
    ready: int
    starting: int  # Pending or Starting
    failed: int  # Failed replicas not yet cleaned up
    sleeping: int = 0  # let go by demand, their engines asleep: woken in seconds
    # replicas running an earlier version of their profile: a rollout replaces them
    outdated: int = 0
    nodes: list[str]  # where its replicas' shards run
    cannot_place: str = ""  # placement's words, while it is below its count and cannot place
    cannot_place_at: float | None = None
    retry_in_s: float | None = None  # its replicas keep failing: the next try, in seconds
    weights_missing: bool = False  # no node reports its weights (and some node looks)
    # its shards whose weights are being fetched, each as its agent last said
    fetching: list[FetchingView] = []
    failures: list[FailureView] = []  # the last few, newest first
    scaling: ScalingView | None = None  # a model with a range of replicas


def scaling_view(model: Model, scaling: Scaling, wall: float) -> ScalingView | None:
    """A ranged model's ``ScalingView``; None for a fixed count."""
    r = model.scaling
    demand = scaling.demand(model.name)
    if r is None or demand is None:
        return None
    view = ScalingView(
        min=r.min,
        max=r.max,
        target=demand.range.target,
        idle_s=r.idle_s,
        pinned=demand.pinned,
        start_s=scaling.start_s(model.name, [p.name for p in model.profiles]),
        wake_s=scaling.wake_s(model.name, [p.name for p in model.profiles]),
        yielding=scaling.yielding.get(model.name, ""),
    )
    if (last := demand.last) is not None:
        view.in_flight, view.waiting = last.in_flight, last.waiting
    if (said := scaling.said.get(model.name)) is not None:
        view.last_change = str(said.change)
        view.last_change_ago_s = round(max(0.0, wall - said.at), 1)
    return view


class ScaleAnswer(msgspec.Struct, kw_only=True):
    """``POST /v1/models/{model}/scale``: the pin taken, in words."""

    model: str
    pinned: int | None
    message: str


class NodeList(msgspec.Struct, kw_only=True):
    """``GET /v1/nodes``."""

    nodes: list[NodeView]
    server_version: str = ""  # the server's own, as ``llmgw.version.describe`` says it


class ReplicaList(msgspec.Struct, kw_only=True):
    """``GET /v1/replicas``: by model, then replica id."""

    replicas: list[ReplicaView]


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``: one per catalog model, by name."""

    models: list[ModelView]


class NodeWeights(msgspec.Struct, kw_only=True):
    """What one node holds of weights, and what it is fetching."""

    node_id: str
    state: str
    fabric: str
    weights_dir: str  # where its fetched weights land ("": an agent that fetches nothing)
    budget_bytes: int | None = None  # what the weights there may take; None: no budget
    copies: list[WeightCopy]
    fetching: list[FetchProgress]


class WeightsList(msgspec.Struct, kw_only=True):
    """``GET /v1/weights``: by node."""

    nodes: list[NodeWeights]


class SkippedNode(msgspec.Struct, kw_only=True):
    node_id: str
    why: str


class PrefetchAnswer(msgspec.Struct, kw_only=True):
    """``POST /v1/models/{model}/prefetch``: the nodes told to fetch, and the rest."""

    model: str
    profile: str
    source: str
    nodes: list[str]  # told to fetch; their progress is in ``GET /v1/weights``
    skipped: list[SkippedNode]


class IntentAnswer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``POST /v1/nodes/{node}``: the intent taken, in words."""

    node_id: str
    intent: str
    message: str
    # a drain's: the longest it takes (how long `ctl drain --wait` waits by default);
    # absent for other intents
    drain_bound_s: float | None = None


class ShardPlacementView(msgspec.Struct, kw_only=True):
    node_id: str
    gpus: list[int]
    port: int
    rank: int


class CandidateView(msgspec.Struct, kw_only=True):
    """A node placement considered, for one profile (``placement.Candidate``)."""

    node_id: str
    profile: str
    ok: bool
    reason: str  # rejected: why; accepted: how it scored
    kind: str  # ``filters.Kind``'s value: fits, or the filter it failed
    score: float = 0.0
    memory_bytes: int | None = None  # what the node has
    held_bytes: int | None = None  # what the shards already there need
    held_by: int | None = None  # how many shards that is
    need_bytes: int | None = None  # what one shard of this profile needs


class PlacementView(msgspec.Struct, kw_only=True):
    """``GET /v1/models/{model}/placement``: where a new replica would go, and where
    the existing ones run."""

    model: str
    profile: str | None  # None: nothing fits
    summary: str
    shards: list[ShardPlacementView]
    candidates: list[CandidateView]  # every node considered, for every profile tried
    # each profile tried -> what one shard needs of a node's memory, in words
    needs: dict[str, str] = {}
    running: list[RunningView] = []


def placement_view(d: Decision, running: list[RunningView]) -> PlacementView:
    return PlacementView(
        model=d.model,
        profile=d.profile,
        summary=d.summary,
        shards=[msgspec.convert(s, ShardPlacementView, from_attributes=True) for s in d.shards],
        candidates=[msgspec.convert(c, CandidateView, from_attributes=True) for c in d.candidates],
        needs=d.needs,
        running=running,
    )


class ConsoleInfo(msgspec.Struct, kw_only=True):
    """``GET /v1/console``: where the web console listens, if it does."""

    on: bool
    urls: list[str] = []
    tls: bool = False
    viewer_token_file: str = ""  # on the server's machine


class ReloadAnswer(msgspec.Struct, kw_only=True):
    """``POST /v1/catalog/reload``."""

    message: str
    warnings: list[str] = []  # a model no node can hold now, a setting its engine lacks


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    code: int = 0  # the HTTP status


class ErrorAnswer(msgspec.Struct, kw_only=True):
    """Any answer but a 200: what went wrong, in words."""

    error: ErrorDetail


# --- tenants and their keys (``llmgw.controlplane.tenants``) ---------------------------


class KeyView(msgspec.Struct, kw_only=True):
    name: str
    tenant: str
    hint: str  # the key's first characters, to tell it apart: not enough to use it
    models: list[str]  # its own narrowing of its tenant's; empty: its tenant's
    expires: float | None  # unix time; None: never
    expired: bool
    limits: Limits | None
    created: float


class TenantView(msgspec.Struct, kw_only=True):
    name: str
    models: list[str]  # empty: every model
    limits: Limits
    created: float
    keys: list[KeyView]
    # what each of its limits counts now, fleet-wide (``ctl tenant show``): granted to
    # routers and not given back (a per-minute one over its last 70 s, a budget over
    # its day or month)
    counted: dict[str, int] = {}
    weight: float = 1.0  # its turn in a full model's queue against others'


class TenantList(msgspec.Struct, kw_only=True):
    tenants: list[TenantView]


class KeyList(msgspec.Struct, kw_only=True):
    keys: list[KeyView]


class KeyCreated(msgspec.Struct, kw_only=True):
    key: str  # the key itself: shown in this answer only, never kept
    view: KeyView


class TenancyAnswer(msgspec.Struct, kw_only=True):
    """A change done: what it did, in words."""

    message: str


def key_view(k: Key, wall: float) -> KeyView:
    return KeyView(
        name=k.name,
        tenant=k.tenant,
        hint=k.hint,
        models=k.models,
        expires=k.expires,
        expired=k.expires is not None and wall >= k.expires,
        limits=k.limits,
        created=k.created,
    )


def tenant_view(t: Tenant, keys: list[Key], wall: float) -> TenantView:
    return TenantView(
        name=t.name,
        models=t.models,
        limits=t.limits,
        created=t.created,
        keys=[key_view(k, wall) for k in keys],
        weight=t.weight,
    )


class UsageList(msgspec.Struct, kw_only=True):
    """What tenants used of each model since ``since`` (unix time), fleet-wide."""

    since: float
    rows: list[UsageRow]

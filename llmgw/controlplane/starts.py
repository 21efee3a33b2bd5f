"""A new replica's shards, and the order they start in: the head first.

Theory of operation
-------------------
Placement's answer (one ``ShardPlacement`` per rank) becomes a replica in
``Pending``, with one shard per rank, each carrying everything its agent
needs (``ShardSpec``), sealed with the fleet's key (``claims``), and not
yet sent.

A multi-node replica (vLLM over Ray) starts its head first: rank 0's Start
goes out when it is placed, the other ranks' once rank 0 runs (its agent
reported it starting or ready), since they join the Ray head it starts and
would fail to find it otherwise. ``due`` says which shards to start now; the
reconciler calls it whenever a replica or its shards move, and sends the
Starts. A rank that was never started is nowhere to stop.

This module is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from llmgw.controlplane.catalog import Model, Profile
from llmgw.controlplane.claims import Sealer
from llmgw.controlplane.placement import ShardPlacement
from llmgw.controlplane.replicas import Replica, ReplicaState, Shard
from llmgw.protocol.messages import ShardSpec, ShardState, WeightsPeer
from llmgw.weights.source import parse_source, where

# where an agent's fetched weights land when it does not say ([weights] default_dir)
DEFAULT_WEIGHTS_DIR = "/var/lib/llmgw-weights"


def new_replica(
    rid: str,
    model: Model,
    profile: Profile,
    placements: list[ShardPlacement],
    head_address: str,
    sealer: Sealer,
    now: float,
    weights_dirs: Mapping[str, str] | None = None,
    peers: Mapping[str, list[WeightsPeer]] | None = None,
) -> Replica:
    """A replica placed where ``placements`` say, none of its shards started yet
    (``head_address``: where rank 0's node is reached, for the ranks that join it;
    ``weights_dirs``: where each node's fetched weights land, by node id; ``peers``:
    whom each node may take them from, ``peers.weights_peers``)."""
    shards = []
    for p in placements:
        spec = ShardSpec(
            shard_id=f"{rid}-{p.rank}",
            replica_id=rid,
            model=model.name,
            profile=profile.name,
            engine=profile.engine,
            rank=p.rank,
            world_size=len(placements),
            gpus=list(p.gpus),
            host="0.0.0.0",
            port=p.port,
            model_path=model_path(profile, (weights_dirs or {}).get(p.node_id, "")),
            engine_args=list(profile.engine_args),
            env=dict(profile.env),
            settings=dict(profile.settings),
            startup_timeout_s=profile.startup_timeout_s,
            stop_grace_s=profile.stop_grace_s,
            sleep=profile.sleep_s > 0,
            head_address=head_address if len(placements) > 1 else "",
            node_id=p.node_id,
            weights_source=profile.source,
            weights_sha256=profile.sha256.lower(),
            fetch_stall_s=profile.fetch_stall_s,
            weights_peers=list((peers or {}).get(p.node_id, [])),
        )
        shards.append(Shard(spec=sealer.seal(spec), node_id=p.node_id, sent=False))
    return Replica(
        replica_id=rid,
        model=model.name,
        profile=profile.name,
        world_size=len(placements),
        shards=shards,
        state=ReplicaState.PENDING,
        created_at=now,
        state_since=now,
    )


def model_path(profile: Profile, weights_dir: str) -> str:
    """Where the engine finds the weights on a node whose fetched weights land in
    ``weights_dir`` (empty: the default): the profile's model_path, else where its
    source lands."""
    if profile.model_path or not profile.source:
        return profile.model_path
    return str(where(parse_source(profile.source), Path(weights_dir or DEFAULT_WEIGHTS_DIR)))


def due(replica: Replica) -> list[Shard]:
    """A Pending or Starting replica's shards to start now: rank 0 at once; a multi-node
    replica's other ranks once rank 0 runs. Each is marked sent."""
    head = next((s for s in replica.shards if s.rank == 0), None)
    head_runs = (
        head is not None and head.sent and head.state in (ShardState.STARTING, ShardState.READY)
    )
    out = [s for s in replica.shards if not s.sent and (s.rank == 0 or head_runs)]
    for shard in out:
        shard.sent = True
    return out


def joining(replica: Replica, started: list[Shard]) -> str:
    """The note for ranks started to join their head ("": none did)."""
    ranks = [f"{s.rank} on {s.node_id}" for s in started if s.rank > 0]
    if not ranks:
        return ""
    head = next((s for s in replica.shards if s.rank == 0), None)
    return (
        f"replica {replica.replica_id}: rank 0 runs on {head.node_id if head else '?'}; "
        f"starting rank {', '.join(ranks)} to join it"
    )

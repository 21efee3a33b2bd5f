"""What a node may claim about the shards it runs, checked against what was placed.

Theory of operation
-------------------
The fleet is authoritative about what runs, but each node only about itself.
A node proves who it is (its certificate); what it reports is a claim, and
an agent with a valid certificate could report another node's shard ids, or
replicas nobody placed, and have the routers send them traffic.

Seals. Every shard the control plane places names, in its spec, the node it
was placed on, sealed: an HMAC, under a key kept in the control plane's state
directory, over that node, the shard, its replica, its model and its rank. The
agent keeps the spec as it was given and reports it back, so even a control
plane that has just restarted, and knows nothing yet, can tell a shard it
placed on the reporting node (``Sealer.placed``) from anything else. A spec
without a seal (placed by an older control plane) or with one that does not
check out (the key was lost) is a plain claim, as every report used to be.

A report is judged before it is adopted (``admit``):

- its spec names another node: refused (a node reports only its own shards);
- its shard id is known on another node: the one known keeps it (it was
  placed there, or claimed there first, and may be serving), and the report
  is refused; unless the report is sealed for the reporting node and the one
  known is not: that one was a claim told first, and is evicted.

A refused report adopts nothing and moves nothing; the reporting node is told
to stop its copy only when that cannot be the real engine seen twice: both
pids are known and differ (two agents given one state directory both see the
same engine under its id, and stopping "the liar's copy" would stop it).

Probes. A shard learned from a report (the control plane never knew it, or
its node, port or key changed) serves no traffic until the control plane has
checked that the engine there is what the report says (``probe`` does the
HTTP): 401 without the reported key, 200 with it, and the reported model among
those it serves. ``due`` lists the ready shards waiting for a check;
``checked`` takes the answer. One that keeps failing past the verify grace is
failed by the reconciler (``overdue``), like any replica that does not serve.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, MutableMapping

import attrs
import msgspec

from llmgw.controlplane.plan import Note, Plan, Refusal, Stop
from llmgw.controlplane.replicas import Replica, ReplicaState, Shard
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardState

SEAL_CHARS = 32  # hex characters kept of the HMAC-SHA256: 128 bits


class Sealer:
    """Seals placements with the control plane's key, and checks seals."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def ephemeral(cls) -> Sealer:
        """A key of this run only: its seals do not outlive it."""
        return cls(secrets.token_bytes(32))

    def seal(self, spec: ShardSpec) -> ShardSpec:
        """``spec`` (which names its node) with its seal."""
        return msgspec.structs.replace(spec, seal=self._mac(spec.node_id, spec))

    def placed(self, spec: ShardSpec, node_id: str) -> bool:
        """Whether this control plane's key sealed ``spec`` for ``node_id``."""
        if not spec.seal or spec.node_id != node_id:
            return False
        return hmac.compare_digest(spec.seal, self._mac(node_id, spec))

    def _mac(self, node_id: str, spec: ShardSpec) -> str:
        what = msgspec.msgpack.encode(
            [node_id, spec.shard_id, spec.replica_id, spec.model, spec.rank]
        )
        return hmac.new(self._key, what, hashlib.sha256).hexdigest()[:SEAL_CHARS]


def admit(
    node_id: str,
    report: ShardReport,
    replicas: MutableMapping[str, Replica],
    sealer: Sealer,
    plan: Plan,
    grace_s: float,
) -> bool:
    """Judge a report from ``node_id``; False: refused (said in ``plan.refused``, with
    a Stop to the reporter where that is safe). A known claim the report beats is
    evicted first (its replica forgets the shard; its node is told to stop it, where
    that is safe)."""
    spec = report.spec
    if spec.node_id and spec.node_id != node_id:
        known = _find(replicas.values(), spec.shard_id)
        theirs = known[1] if known is not None and known[1].node_id == spec.node_id else None
        why = f"its spec says it was placed on {spec.node_id}"
        _refuse(node_id, report, spec.node_id, why, theirs, plan, grace_s)
        return False
    known = _find(replicas.values(), spec.shard_id)
    if known is None or known[1].node_id == node_id:
        return True
    replica, shard = known
    if sealer.placed(spec, node_id) and not sealer.placed(shard.spec, shard.node_id):
        # placed here by this control plane: the claim known was told first, not placed
        replica.shards.remove(shard)
        if not replica.shards:
            del replicas[replica.replica_id]
        stop = _may_stop(shard.pid, report.pid)
        if stop:
            plan.stop.append(Stop(shard.node_id, shard.shard_id, grace_s))
        plan.refused.append(
            Refusal(
                shard.node_id,
                shard.shard_id,
                node_id,
                f"it was placed on {node_id}, which reports it",
                stop,
            )
        )
        return True
    how = "placed there" if sealer.placed(shard.spec, shard.node_id) else "reported there first"
    seen = " and seen serving" if shard.came_up else ""
    why = f"it runs on {shard.node_id} ({how}{seen})"
    _refuse(node_id, report, shard.node_id, why, shard, plan, grace_s)
    return False


def may_displace(rival: Shard, node_id: str, spec: ShardSpec, sealer: Sealer) -> bool:
    """Whether a reported shard may take the place of ``rival`` (another shard of its
    replica at its rank, which never came up): not when the control plane placed the
    rival and the report is no placement of its own."""
    return not sealer.placed(rival.spec, rival.node_id) or sealer.placed(spec, node_id)


def _refuse(
    node_id: str,
    report: ShardReport,
    owner: str,
    why: str,
    theirs: Shard | None,
    plan: Plan,
    grace_s: float,
) -> None:
    stop = theirs is not None and _may_stop(theirs.pid, report.pid)
    if stop:
        plan.stop.append(Stop(node_id, report.spec.shard_id, grace_s))
    plan.refused.append(Refusal(node_id, report.spec.shard_id, owner, why, stop))


def _may_stop(kept: int | None, refused: int | None) -> bool:
    """Stopping the refused copy cannot stop the engine that is kept: both pids are
    known and differ (the same pid may be the same engine, seen by two agents)."""
    return kept is not None and refused is not None and kept != refused


def refusal_words(r: Refusal) -> str:
    """One line for the log: the shard, both nodes, what was done."""
    then = (
        f"{r.node_id} is told to stop its copy"
        if r.stopped
        else f"its copy on {r.node_id} is left alone (it may be the same engine)"
    )
    return (
        f"node {r.node_id} reported shard {r.shard_id}, which is node {r.owner}'s: {r.why}; "
        f"{r.node_id}'s claim is refused and {then}"
    )


# --- probes ---------------------------------------------------------------------------


@attrs.frozen
class Claim:
    """What a probe checks: that the engine at a shard's address is the one reported."""

    replica_id: str
    shard_id: str
    node_id: str
    host: str  # its spec's, where the node says no address
    port: int
    engine_key: str = attrs.field(repr=False)
    engine: str
    model: str
    names: frozenset[str]  # any of these among the models it serves will do


def where(shard: Shard | None) -> tuple[str, int, str] | None:
    """What a report can change that a probe vouches for: node, port, key."""
    return None if shard is None else (shard.node_id, shard.spec.port, shard.engine_key)


def follow(shard: Shard, before: tuple[str, int, str] | None) -> None:
    """A shard just (re)described by a report: it waits for a probe when the control
    plane did not know it, or its node, port or key changed (a key learned for the
    first time, for a shard known where it is, is no change). Only rank 0 serves."""
    if shard.rank != 0:
        return
    node, port, key = where(shard) or ("", 0, "")
    if before is None or before[:2] != (node, port) or (before[2] and before[2] != key):
        shard.verified, shard.unverified_why, shard.unverified_since = False, "", None


def due(replicas: Iterable[Replica]) -> list[Claim]:
    """The ready shards waiting for a probe."""
    out = []
    for r in replicas:
        if r.state not in (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.PENDING):
            continue
        for s in r.shards:
            if not s.verified and s.state == ShardState.READY:
                names = {s.spec.model, str(s.spec.settings.get("served_model_name", ""))}
                out.append(
                    Claim(
                        replica_id=r.replica_id,
                        shard_id=s.shard_id,
                        node_id=s.node_id,
                        host=s.spec.host,
                        port=s.spec.port,
                        engine_key=s.engine_key,
                        engine=s.spec.engine,
                        model=s.spec.model,
                        names=frozenset(n for n in names if n),
                    )
                )
    return out


def pending(replica: Replica) -> bool:
    """A Ready replica with an engine learned from a report and not probed yet (moments,
    as a rule): which of a model's replicas is an extra waits for the answer."""
    return replica.state is ReplicaState.READY and any(
        not s.verified and not s.unverified_why for s in replica.shards
    )


def checked(replicas: Iterable[Replica], claim: Claim, why: str, now: float) -> Plan:
    """A probe's answer (``why``: "" when the engine is what was reported). Stale
    answers (the shard moved, or its key changed, since) change nothing; a failure is
    said once for each reason, a recovery once."""
    plan = Plan()
    found = _find(replicas, claim.shard_id)
    if found is None or where(found[1]) != (claim.node_id, claim.port, claim.engine_key):
        return plan
    replica, shard = found
    at = f"replica {replica.replica_id}: shard {shard.shard_id} on {shard.node_id}"
    if not why:
        if shard.unverified_why:
            plan.notes.append(Note(f"{at} answers as its report says now; routed"))
        shard.verified, shard.unverified_why, shard.unverified_since = True, "", None
        return plan
    if shard.unverified_since is None:
        shard.unverified_since = now
    if why != shard.unverified_why:
        plan.notes.append(
            Note(
                f"{at} is not routed: its engine at port {shard.spec.port} {why} "
                "(not the engine its node reported)",
                warning=True,
            )
        )
    shard.unverified_why = why
    return plan


def overdue(replica: Replica, now: float, grace_s: float) -> str | None:
    """Why a Ready replica has to go: its engine has failed every probe for the
    verify grace; None: it has not."""
    for s in replica.shards:
        since = s.unverified_since
        if not s.verified and since is not None and now - since >= grace_s:
            return (
                f"its engine on {s.node_id} (shard {s.shard_id}) {s.unverified_why}, "
                f"for {now - since:.0f} s: it is not the engine its node reported"
            )
    return None


def _find(replicas: Iterable[Replica], shard_id: str) -> tuple[Replica, Shard] | None:
    for replica in replicas:
        for shard in replica.shards:
            if shard.shard_id == shard_id:
                return replica, shard
    return None

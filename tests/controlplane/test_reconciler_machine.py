"""The reconciler against a simulated fleet: a hypothesis state machine.

The simulated agents are the ground truth of what runs. Each node has an
agent with a dict of running shards; commands from the reconciler's plans are
delivered to them the way the dispatcher delivers them (dropped when the node
has no open stream), and everything they say goes back through
``Reconciler.registered`` and ``Reconciler.shard_status``, as the stream
delivers it: a registration first, then whatever statuses the agent queued
while it had no stream (its outbox, in order).

The naive model of the world, in short:

- an agent reports ``starting`` as soon as it is told to start a shard; the
  shard becomes ready (a rule), crashes (a rule: status ``failed``) or times
  out on the agent's own startup bound (a tick: status ``failed``);
- a stop ends the shard at once (status ``stopped``); a drain makes it
  ``draining`` until it finishes (a rule) or its grace runs out (a tick);
  either to a shard the agent does not run answers ``stopped``; a sleep drains
  it the same way, then it is ``sleeping`` (every agent can), and a wake makes
  a sleeping one ``starting`` again (model ``big`` sleeps when let go);
- a node can lose its stream (a partition: engines keep running, statuses
  queue up), be lost (its stream drops and the clock runs past
  ``lost_after``; the rule says whether its engines survive, as in a
  partition, or die with it, as in a power cut; either way it may come back
  later and registers with exactly what it runs), or have its agent restart
  (the outbox is lost; the engines survive or die, as the rule says);
- a control plane restart is a brand-new Reconciler and NodeTable with the
  same catalog and operator intent; some agents register at once, the rest
  right after the next pass (they reconnect within a second or so; nothing
  is placed for ``Timing.settle_s`` after a start, so none of theirs doubles);
- an engine learned from a report is probed at once, and is what it was
  reported to be.

Statuses from connected agents are delivered immediately, so there is no
window in which a shard died and the reconciler could not know it: the
invariants hold after every step. The only windows are the ones the real
system has: a node without a stream (checked only once it registers again).

Invariants: no GPU held by two live replicas (and ``allocations()`` agrees);
no start onto a GPU or port a running shard holds, nor onto an unhealthy GPU;
every replica has a way out, within its state's time bound; a Ready replica
really serves on every connected node it spans; nothing runs on a connected
node that the reconciler forgot; a scale-down never drains a serving replica
while one that is not serving counts; and ``settle`` (where capacity allows)
converges to exactly the desired Ready replicas. An exception from the
reconciler (an ``IllegalMove``) fails the run as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import re

import attrs
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from llmgw.controlplane import claims
from llmgw.controlplane.catalog import Catalog, parse_catalog
from llmgw.controlplane.nodes import LivenessPolicy, NodeState, NodeTable
from llmgw.controlplane.plan import Plan
from llmgw.controlplane.reconciler import Reconciler, ReplicaIds, Timing
from llmgw.controlplane.replicas import TRANSITIONS, Replica, ReplicaState
from llmgw.protocol.messages import (
    SLEEP,
    Engine,
    Gpu,
    Heartbeat,
    Inventory,
    Memory,
    ShardReport,
    ShardSpec,
    ShardStatus,
)

R = ReplicaState

# --- the world's constants -----------------------------------------------------------

STARTUP_S = 30.0  # every profile's startup_timeout_s
SLEEP_S = 120.0  # big's sleep_s
TIMING = Timing(
    startup_margin_s=10,
    drain_grace_s=60,
    drain_timeout_s=40,
    stop_timeout_s=30,
    stop_grace_s=5,
    retry_base_s=5,
    retry_cap_s=60,
)
POLICY = LivenessPolicy(unreachable_after=10, lost_after=30)
TICKS = (1.0, 5.0, 10.0, 15.0)
MAX_TICK = max(TICKS)
QUIET_TICK = 5.0
QUIET_TICKS = 80  # 400 s: past every timeout, backoff cap and liveness bound, several times
ENGINES = [Engine(name="llama.cpp", version="b1"), Engine(name="vllm"), Engine(name="ray")]
NODE_MEMORY_GB = 64
# the naive model of what a shard needs of its node's memory, GiB: tiny's min_memory_gb;
# flex on the CPU, llama-server's default prompt cache (no node reports its weights);
# vLLM, nothing known
SHARD_MEMORY_GB = {("tiny", "cpu"): NODE_MEMORY_GB * 5 // 8, ("flex", "cpu"): 8}

PROFILES = {
    # more than half of a node's memory: two never share a node
    "tiny": f"""
[[models.tiny.profiles]]
name = "cpu"
engine = "llama.cpp"
min_memory_gb = {NODE_MEMORY_GB * 5 // 8}
model_path = "/models/tiny.gguf"
startup_timeout_s = {STARTUP_S}
""",
    # a replica let go sleeps (``controlplane/sleep.py``) before it stops
    "big": f"""
[[models.big.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
startup_timeout_s = {STARTUP_S}
sleep_s = {SLEEP_S}
""",
    # a GPU first, a CPU if no GPU is free
    "flex": f"""
[[models.flex.profiles]]
name = "gpu"
engine = "vllm"
gpus = 1
startup_timeout_s = {STARTUP_S}
[[models.flex.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/models/flex.gguf"
startup_timeout_s = {STARTUP_S}
""",
    "wide": f"""
[[models.wide.profiles]]
name = "ray"
engine = "vllm-ray"
nodes = 2
gpus = 1
startup_timeout_s = {STARTUP_S}
""",
}
GPU_MODELS = ("big", "flex")  # one GPU per replica, worst case

# Reconciler bugs this machine found, each pinned by a strict xfail test at the end of
# this module. While one is listed here the machine excuses exactly its symptom (and
# nothing else), so that it keeps looking for other bugs; once it is fixed its xfail
# test passes (and so fails, being strict): then take it off this list as well.
KNOWN_BUGS: frozenset[str] = frozenset()  # all three found so far are fixed


def make_catalog(replicas: dict[str, int], versions: dict[str, int] | None = None) -> Catalog:
    """``versions``: a model's profiles changed this many times (an env var each time)."""
    versions = versions or {}

    def profiles(name: str) -> str:
        v = versions.get(name, 0)
        if not v:
            return PROFILES[name]
        marker = f"startup_timeout_s = {STARTUP_S}"
        return PROFILES[name].replace(marker, f'{marker}\nenv = {{ V = "{v}" }}')

    text = "".join(
        f"[models.{name}]\nreplicas = {n}\n{profiles(name)}\n" for name, n in replicas.items()
    )
    return parse_catalog(text, "catalog.toml")


def _event(what: str) -> None:
    """Counted by ``--hypothesis-show-statistics``; nothing outside the machine's run."""
    with contextlib.suppress(InvalidArgument):
        event(what)


# --- the simulated agents ---------------------------------------------------------------


@attrs.define
class SimShard:
    spec: ShardSpec
    state: str  # starting, ready, draining, sleeping
    since: float
    drain_until: float = 0.0
    dozes: bool = False  # draining to sleep (a SleepShard), not to a stop


@attrs.define
class Agent:
    node_id: str
    healthy: list[bool]  # per GPU index
    running: dict[str, SimShard] = attrs.Factory(dict)
    outbox: list[ShardStatus] = attrs.Factory(list)
    # "up": registered with the current control plane, its stream open;
    # "down": no stream (partitioned, or the host is off) until node_returns;
    # "reconnecting": the control plane restarted; it registers right after the next pass
    link: str = "up"
    connection: int = 0
    seq: int = 0
    _inventory: Inventory | None = None

    def inventory(self) -> Inventory:
        # the same object until something changes (placement caches per inventory object)
        if self._inventory is None:
            self._inventory = Inventory(
                hostname=self.node_id,
                address=f"10.0.0.{self.node_id[1:]}",
                memory=Memory(total_bytes=NODE_MEMORY_GB << 30),
                gpus=[Gpu(index=i, name="H100", healthy=h) for i, h in enumerate(self.healthy)],
                engines=list(ENGINES),
                fabric="ib-a",
            )
        return self._inventory

    def set_health(self, index: int, healthy: bool) -> None:
        self.healthy[index] = healthy
        self._inventory = None

    def reports(self) -> list[ShardReport]:
        return [
            ShardReport(spec=s.spec, state=s.state, pid=1000 + i)  # type: ignore[arg-type]
            for i, s in enumerate(self.running.values())
        ]

    def gpus_held(self) -> dict[int, str]:
        held: dict[int, str] = {}
        for s in self.running.values():
            for g in s.spec.gpus:
                held[g] = s.spec.shard_id
        return held


# --- the machine --------------------------------------------------------------------------


class ReconcilerMachine(RuleBasedStateMachine):
    # ---- setup ----

    @initialize(
        gpus=st.lists(st.integers(0, 4), min_size=3, max_size=5),
        tiny=st.integers(0, 3),
        big=st.integers(0, 3),
        flex=st.integers(0, 2),
        wide=st.none() | st.integers(0, 1),
    )
    def setup(self, gpus: list[int], tiny: int, big: int, flex: int, wide: int | None) -> None:
        self.now = 0.0
        self.replicas: dict[str, int] = {"tiny": tiny, "big": big, "flex": flex}
        if wide is not None:
            self.replicas["wide"] = wide
        self.present = dict.fromkeys(self.replicas, True)  # removed from the catalog or not
        self.versions = dict.fromkeys(self.replicas, 0)  # how often its profiles changed
        self.restarts = 0
        self.rec = self._new_reconciler()
        self.table = NodeTable(POLICY)
        self.connections = itertools.count(1)
        self.agents = {f"n{i + 1}": Agent(f"n{i + 1}", [True] * g) for i, g in enumerate(gpus)}
        self.statuses: list[tuple[str, ShardStatus]] = []
        self.violations: list[str] = []
        self.excused: set[tuple[str, str]] = set()  # (node, shard): see KNOWN_BUGS
        self.last_plan = Plan()
        for agent in self.agents.values():
            self._register(agent)

    def _catalog(self) -> Catalog:
        return make_catalog(
            {m: n for m, n in self.replicas.items() if self.present[m]}, self.versions
        )

    def _new_reconciler(self) -> Reconciler:
        # deterministic ids (still unique per restart)
        return Reconciler(self._catalog(), TIMING, ids=ReplicaIds(f"cp{self.restarts}"))

    # ---- the stream ----

    def _register(self, agent: Agent) -> None:
        """A fresh stream: Register, then whatever the agent queued while it had none."""
        agent.link = "up"
        agent.connection = next(self.connections)
        reports = agent.reports()
        self.table.register(
            agent.node_id,
            agent.inventory(),
            peer=f"10.0.0.{agent.node_id[1:]}:4000",
            connection=agent.connection,
            now=self.now,
            wall=self.now,
        )
        self.table.nodes[agent.node_id].can = frozenset({SLEEP})  # its engines may sleep
        plan = self.rec.registered(agent.node_id, reports, self.now)
        if "readopted-shard-not-stopped" in KNOWN_BUGS:
            stopped = {(s.node, s.shard_id) for s in plan.stop}
            for report in reports:
                sid = report.spec.shard_id
                replica = self.rec.replicas.get(report.spec.replica_id)
                if (
                    replica is not None
                    and replica.state in (R.FAILED, R.STOPPING)
                    and (agent.node_id, sid) not in stopped
                ):
                    self.excused.add((agent.node_id, sid))
        self._deliver(plan)
        queued, agent.outbox = agent.outbox, []
        self.statuses += [(agent.node_id, s) for s in queued]
        self._flush()

    def _disconnect(self, agent: Agent) -> None:
        if agent.link == "up":
            self.table.disconnected(agent.node_id, agent.connection, now=self.now)
        agent.link = "down"

    def _emit(self, agent: Agent, status: ShardStatus) -> None:
        if agent.link == "up":
            self.statuses.append((agent.node_id, status))
        else:
            agent.outbox.append(status)

    def _flush(self) -> None:
        while self.statuses:
            node, status = self.statuses.pop(0)
            self._deliver(self.rec.shard_status(node, status, self.now))
        # the fleet's prober, moments later: a simulated engine is what its agent says
        for claim in claims.due(self.rec.replicas.values()):
            claims.checked(self.rec.replicas.values(), claim, "", self.now)

    def _deliver(self, plan: Plan, *, from_pass: bool = False) -> None:
        """Send a plan's commands as the fleet manager does (starts, drains, stops);
        a node without a stream does not get them."""
        if from_pass:
            self._check_scale_down(plan)
        for start in plan.start:
            agent = self.agents[start.node]
            if agent.link == "up":
                self._start(agent, start.spec, plan)
        for drain in plan.drain:
            agent = self.agents[drain.node]
            if agent.link == "up":
                self._drain(agent, drain.shard_id, drain.grace_s)
        for sleep in plan.sleep:
            agent = self.agents[sleep.node]
            if agent.link == "up":
                self._drain(agent, sleep.shard_id, sleep.grace_s, dozes=True)
        for wake in plan.wake:
            agent = self.agents[wake.node]
            if agent.link == "up":
                self._wake(agent, wake.shard_id)
        for stop in plan.stop:
            agent = self.agents[stop.node]
            if agent.link == "up":
                self._stop(agent, stop.shard_id)
        self._flush()

    # ---- what an agent does with a command ----

    def _start(self, agent: Agent, spec: ShardSpec, plan: Plan) -> None:
        existing = agent.running.get(spec.shard_id)
        if existing is not None:  # a second start is ignored; the agent says where it is
            self._emit(agent, ShardStatus(shard_id=spec.shard_id, state=existing.state))  # type: ignore[arg-type]
            return
        held = {g: h for g, h in agent.gpus_held().items() if not self._excused(agent, h, plan)}
        ports = {
            s.spec.port: sid
            for sid, s in agent.running.items()
            if s.spec.port and not self._excused(agent, sid, plan)
        }
        if spec.port in ports:
            self.violations.append(
                f"told {agent.node_id} to start {spec.shard_id} on port {spec.port}, "
                f"which shard {ports[spec.port]} running there holds"
            )
        for g in spec.gpus:
            if g in held:
                self.violations.append(
                    f"told {agent.node_id} to start {spec.shard_id} on GPU {g}, "
                    f"which shard {held[g]} running there holds"
                )
            if g >= len(agent.healthy) or not agent.healthy[g]:
                self.violations.append(
                    f"told {agent.node_id} to start {spec.shard_id} on GPU {g}, "
                    "which the node does not report healthy"
                )
        agent.running[spec.shard_id] = SimShard(spec, "starting", self.now)
        self._emit(agent, ShardStatus(shard_id=spec.shard_id, state="starting", pid=1))

    def _excused(self, agent: Agent, holder: str, plan: Plan) -> bool:
        """Whether a start onto what ``holder`` holds is a known bug's symptom."""
        if (agent.node_id, holder) in self.excused:
            return True
        if "failed-resources-reused-at-once" not in KNOWN_BUGS:
            return False
        if (agent.node_id, holder) in {(s.node, s.shard_id) for s in plan.stop}:
            return True
        return any(
            r.state is R.FAILED and any(s.shard_id == holder for s in r.shards)
            for r in self.rec.replicas.values()
        )

    def _stop(self, agent: Agent, shard_id: str) -> None:
        detail = "stopped" if agent.running.pop(shard_id, None) else "not running here"
        self._emit(agent, ShardStatus(shard_id=shard_id, state="stopped", detail=detail))

    def _drain(self, agent: Agent, shard_id: str, grace: float, *, dozes: bool = False) -> None:
        shard = agent.running.get(shard_id)
        if shard is None:
            self._emit(
                agent, ShardStatus(shard_id=shard_id, state="stopped", detail="not running here")
            )
            return
        if shard.state not in ("starting", "ready"):  # nothing changes; it says where it is
            self._emit(agent, ShardStatus(shard_id=shard_id, state=shard.state))  # type: ignore[arg-type]
            return
        shard.state, shard.drain_until, shard.dozes = "draining", self.now + grace, dozes
        self._emit(agent, ShardStatus(shard_id=shard_id, state="draining"))

    def _drained(self, agent: Agent, shard: SimShard) -> None:
        """Its drain is over: it stops, or its engine sleeps."""
        sid = shard.spec.shard_id
        if shard.dozes:
            _event("a shard slept")  # ``--hypothesis-show-statistics`` counts them
            shard.state, shard.dozes = "sleeping", False
            self._emit(agent, ShardStatus(shard_id=sid, state="sleeping"))
            return
        del agent.running[sid]
        self._emit(agent, ShardStatus(shard_id=sid, state="stopped", detail="drained"))

    def _wake(self, agent: Agent, shard_id: str) -> None:
        shard = agent.running.get(shard_id)
        if shard is None:
            self._emit(
                agent, ShardStatus(shard_id=shard_id, state="stopped", detail="not running here")
            )
            return
        if shard.state == "sleeping":
            _event("a sleeping shard was woken")
            shard.state, shard.since = "starting", self.now  # timed from the wake
        self._emit(agent, ShardStatus(shard_id=shard_id, state=shard.state))  # type: ignore[arg-type]

    # ---- time ----

    def _tick(self, dt: float, *, quiet: bool = False) -> Plan:
        self.now += dt
        for agent in self.agents.values():  # the agents' own bounds
            for shard in list(agent.running.values()):
                sid = shard.spec.shard_id
                if (
                    shard.state == "starting"
                    and self.now - shard.since > shard.spec.startup_timeout_s
                ):
                    del agent.running[sid]
                    self._emit(agent, ShardStatus(shard_id=sid, state="failed", detail="timeout"))
                elif shard.state == "draining" and self.now >= shard.drain_until:
                    self._drained(agent, shard)
        self._flush()
        for agent in self.agents.values():
            if agent.link == "up":
                agent.seq += 1
                self.table.heartbeat(
                    agent.node_id,
                    agent.connection,
                    Heartbeat(seq=agent.seq, sent_at=self.now),
                    now=self.now,
                    wall=self.now,
                )
        self.table.sweep(self.now)
        plan = self.rec.reconcile(self.table.nodes, self.now)
        self.last_plan = plan
        self._deliver(plan, from_pass=True)
        if quiet:  # everything started comes up, every drain finishes
            for agent in self.agents.values():
                if agent.link != "up":
                    continue
                for shard in list(agent.running.values()):
                    if shard.state == "starting":
                        shard.state = "ready"
                        self._emit(agent, ShardStatus(shard_id=shard.spec.shard_id, state="ready"))
                    elif shard.state == "draining":
                        self._drained(agent, shard)
            self._flush()
        for agent in self.agents.values():
            if agent.link == "reconnecting":
                self._register(agent)
        return plan

    # ---- lookups ----

    def _running(self, *states: str, up_only: bool = False) -> list[tuple[Agent, SimShard]]:
        return [
            (a, s)
            for a in self.agents.values()
            for s in a.running.values()
            if s.state in states and (a.link == "up" or not up_only)
        ]

    def _nodes(self, link: str) -> list[str]:
        return [n for n, a in self.agents.items() if a.link == link]

    # ---- rules: time and engines ----

    @rule(dt=st.sampled_from(TICKS))
    def tick(self, dt: float) -> None:
        self._tick(dt)

    @precondition(lambda self: bool(self._running("starting")))
    @rule(pick=st.integers(0, 1000))
    def shard_becomes_ready(self, pick: int) -> None:
        candidates = self._running("starting")
        agent, shard = candidates[pick % len(candidates)]
        shard.state = "ready"
        self._emit(agent, ShardStatus(shard_id=shard.spec.shard_id, state="ready"))
        self._flush()

    @precondition(lambda self: bool(self._running("starting", "ready", "draining", "sleeping")))
    @rule(pick=st.integers(0, 1000))
    def shard_fails(self, pick: int) -> None:
        """The engine crashed."""
        candidates = self._running("starting", "ready", "draining", "sleeping")
        agent, shard = candidates[pick % len(candidates)]
        del agent.running[shard.spec.shard_id]
        self._emit(
            agent,
            ShardStatus(
                shard_id=shard.spec.shard_id,
                state="failed",
                detail="engine exited with code 1",
                output_tail=["CUDA error: out of memory"],
            ),
        )
        self._flush()

    @precondition(lambda self: bool(self._running("draining")))
    @rule(pick=st.integers(0, 1000))
    def drain_finishes(self, pick: int) -> None:
        candidates = self._running("draining")
        agent, shard = candidates[pick % len(candidates)]
        self._drained(agent, shard)
        self._flush()

    @rule(node=st.integers(0, 4), index=st.integers(0, 3), healthy=st.booleans())
    def gpu_health_changes(self, node: int, index: int, healthy: bool) -> None:
        agent = list(self.agents.values())[node % len(self.agents)]
        if index >= len(agent.healthy) or agent.healthy[index] == healthy:
            return
        agent.set_health(index, healthy)
        if agent.link == "up":  # the next heartbeat carries the changed inventory
            agent.seq += 1
            self.table.heartbeat(
                agent.node_id,
                agent.connection,
                Heartbeat(seq=agent.seq, sent_at=self.now, inventory=agent.inventory()),
                now=self.now,
                wall=self.now,
            )

    # ---- rules: agents, nodes, the control plane ----

    @precondition(lambda self: bool(self._nodes("up")))
    @rule(pick=st.integers(0, 100), engines_die=st.booleans())
    def agent_restarts(self, pick: int, engines_die: bool) -> None:
        """The agent process restarts: its stream drops, it registers again with what it
        runs (adopted engines), or with nothing when its engines died with it."""
        up = self._nodes("up")
        agent = self.agents[up[pick % len(up)]]
        self._disconnect(agent)
        agent.outbox.clear()
        if engines_die:
            agent.running.clear()
        self._register(agent)

    @precondition(lambda self: bool(self._nodes("up")))
    @rule(pick=st.integers(0, 100))
    def disconnect(self, pick: int) -> None:
        """A partition: the stream drops, the engines keep serving."""
        up = self._nodes("up")
        self._disconnect(self.agents[up[pick % len(up)]])

    @precondition(lambda self: bool(self._nodes("up")))
    @rule(pick=st.integers(0, 100), engines_survive=st.booleans())
    def node_lost(self, pick: int, engines_survive: bool) -> None:
        """The node goes silent until the NodeTable's sweep marks it Lost (a pass every
        5 s meanwhile). With engines_survive it was a partition: its engines keep
        running and come back with it; otherwise it lost power and they died."""
        up = self._nodes("up")
        agent = self.agents[up[pick % len(up)]]
        self._disconnect(agent)
        if not engines_survive:
            agent.running.clear()
            agent.outbox.clear()
        while self.table.nodes[agent.node_id].state is not NodeState.LOST:
            self._tick(5.0)

    @precondition(lambda self: bool(self._nodes("down") + self._nodes("reconnecting")))
    @rule(pick=st.integers(0, 100))
    def node_returns(self, pick: int) -> None:
        away = self._nodes("down") + self._nodes("reconnecting")
        self._register(self.agents[away[pick % len(away)]])

    @rule(registered_now=st.integers(0, 5))
    def control_plane_restarts(self, registered_now: int) -> None:
        """A brand-new Reconciler and NodeTable, the same catalog and operator intent.
        The first ``registered_now`` connected agents register at once; the others
        right after the next pass."""
        cordoned, draining = set(self.rec.cordoned), set(self.rec.draining)
        self.restarts += 1
        self.rec = self._new_reconciler()
        self.rec.cordoned, self.rec.draining = cordoned, draining
        self.table = NodeTable(POLICY)
        up = self._nodes("up")
        for node in up:
            self.agents[node].link = "reconnecting"
        for node in up[:registered_now]:
            self._register(self.agents[node])

    # ---- rules: the operator ----

    @rule(node=st.integers(0, 4))
    def drain(self, node: int) -> None:
        self.rec.drain(list(self.agents)[node % len(self.agents)])

    @rule(node=st.integers(0, 4))
    def cordon(self, node: int) -> None:
        self.rec.cordon(list(self.agents)[node % len(self.agents)])

    @precondition(lambda self: bool(self.rec.cordoned or self.rec.draining))
    @rule(node=st.integers(0, 4))
    def uncordon(self, node: int) -> None:
        held = sorted(self.rec.cordoned | self.rec.draining)
        self.rec.uncordon(held[node % len(held)])

    @rule(model=st.sampled_from(("tiny", "big", "flex", "wide")), n=st.integers(0, 3))
    def change_replicas(self, model: str, n: int) -> None:
        if model not in self.replicas:
            return
        self.replicas[model] = min(n, 1) if model == "wide" else n
        self.rec.set_catalog(self._catalog())

    @rule(n=st.integers(0, 2))
    def demand_for_big_moves(self, n: int) -> None:
        """Its count rises and falls as demand would: let go, its replicas sleep; wanted
        again, a sleeping one is woken (``change_replicas`` alone seldom gets there)."""
        self.change_replicas("big", n)

    @rule(model=st.sampled_from(("tiny", "big", "flex", "wide")))
    def model_leaves_or_returns(self, model: str) -> None:
        if model not in self.present:
            return
        self.present[model] = not self.present[model]
        self.rec.set_catalog(self._catalog())

    @rule(model=st.sampled_from(("tiny", "big", "flex", "wide")))
    def profile_changes(self, model: str) -> None:
        if model not in self.replicas:
            return
        self.versions[model] += 1
        self.rec.set_catalog(self._catalog())

    # ---- convergence ----

    def capacity_allows(self) -> bool:
        """Enough healthy GPUs on connected, schedulable nodes for every GPU replica,
        however the one-GPU ones land (a sufficient condition, not a necessary one)."""
        if self.rec.draining:
            return False
        open_ = [
            a for a in self.agents.values() if a.link == "up" and a.node_id not in self.rec.cordoned
        ]
        want = {m: n for m, n in self.replicas.items() if self.present[m]}
        if not open_ and any(want.values()):
            return False
        if want.get("tiny", 0) > len(open_):  # a node each: two never fit in one's memory
            return False
        caps = [sum(a.healthy) for a in open_]
        singles = sum(want.get(m, 0) for m in GPU_MODELS)
        wide = want.get("wide", 0)
        if sum(caps) < singles + 2 * wide:
            return False
        # each wide replica needs two nodes with a GPU left, even where the singles landed
        return sum(min(max(0, c - singles), wide) for c in caps) >= 2 * wide

    @precondition(lambda self: self.capacity_allows())
    @rule()
    def settle(self) -> None:
        """Quiet ticks (everything started comes up, nothing fails) until nothing is left
        to do; then every model has exactly its count of Ready replicas."""
        for _ in range(QUIET_TICKS):
            plan = self._tick(QUIET_TICK, quiet=True)
            if not plan and not self.statuses and self._converged() == "":
                break
        problem = self._converged()
        assert problem == "", (
            f"not converged after {QUIET_TICKS} quiet ticks of {QUIET_TICK:g} s "
            f"(capacity allows): {problem}; replicas: {self._describe()}; "
            f"last pass: {self.last_plan}"
        )

    def _converged(self) -> str:
        want = {m: n for m, n in self.replicas.items() if self.present[m]}
        ready: dict[str, int] = {}
        for r in self.rec.replicas.values():
            if r.state is R.SLEEPING and not r.outdated and r.model in want:
                continue  # let go, asleep until its sleep_s or a wake: settled as it is
            if r.state is not R.READY or r.leaving:
                return f"{r.replica_id} is {r.state.value}{' (leaving)' if r.leaving else ''}"
            if r.outdated:
                return f"{r.replica_id} runs an earlier version of its profile"
            ready[r.model] = ready.get(r.model, 0) + 1
        for model, n in want.items():
            if ready.get(model, 0) != n:
                return f"{model} has {ready.get(model, 0)} Ready replicas, wants {n}"
        extra = set(ready) - set(want)
        if extra:
            return f"replicas of {sorted(extra)}, which left the catalog"
        return ""

    def _describe(self) -> str:
        return ", ".join(
            f"{r.replica_id}:{r.state.value}{'/leaving' if r.leaving else ''}@{r.nodes}"
            for r in self.rec.replicas.values()
        )

    # ---- checks made while a plan is delivered ----

    def _check_scale_down(self, plan: Plan) -> None:
        """The docstring's promise, for scale-down: a serving replica is drained as an
        extra only when no replica of the model that counts is still not serving, and
        an adopted one (it served before this control plane started) only when no
        replica placed since still counts."""
        if "scale-down-drains-serving" in KNOWN_BUGS:
            return
        for note in plan.notes:
            m = re.fullmatch(r"replica (\S+) is an extra; draining it", note.text)
            if m is None:
                continue
            drained = self.rec.replicas.get(m.group(1))
            if drained is None or drained.state is not R.DRAINING:
                continue  # it was not serving: stopped, not drained
            waiting = [
                r
                for r in self.rec.replicas.values()
                if r.model == drained.model
                and r.counts
                and (r.state is not R.READY or (drained.adopted and not r.adopted))
            ]
            if waiting:
                self.violations.append(
                    f"scale-down drained serving replica {drained.replica_id} while "
                    f"{', '.join(f'{r.replica_id} ({r.state.value})' for r in waiting)} "
                    "still counts without serving, or was placed since it was adopted"
                )

    # ---- invariants ----

    @invariant()
    def nothing_went_wrong_on_the_wire(self) -> None:
        assert not self.violations, "; ".join(self.violations)

    @invariant()
    def no_gpu_is_allocated_twice(self) -> None:
        holder: dict[tuple[str, int], str] = {}
        for r in self.rec.replicas.values():
            if r.state is R.FAILED:
                continue
            for s in r.shards:
                for g in s.spec.gpus:
                    other = holder.setdefault((s.node_id, g), s.shard_id)
                    assert other == s.shard_id, (
                        f"GPU {g} of {s.node_id} is held by {other} and by {s.shard_id} "
                        f"({r.replica_id}, {r.state.value})"
                    )
        # and the allocations placement reads agree: everything a live replica holds is
        # handed out, and nothing is handed out that no replica holds
        allocated = self.rec.allocations()
        anyone = {
            (s.node_id, g)
            for r in self.rec.replicas.values()
            for s in r.shards
            for g in s.spec.gpus
        }
        for (node, g), shard_id in holder.items():
            assert g in allocated.gpus.get(node, set()), (
                f"GPU {g} of {node} is held by {shard_id} but allocations() hands it out"
            )
        for node, gpus in allocated.gpus.items():
            stray = sorted(g for g in gpus if (node, g) not in anyone)
            assert not stray, f"allocations() holds GPUs {stray} of {node}, which no shard holds"

    @invariant()
    def no_node_holds_more_than_its_memory(self) -> None:
        """What the shards on a node need (tiny's min_memory_gb, flex's prompt cache) never
        adds up to more than the node has: placement subtracts what is there."""
        held: dict[str, int] = {}
        for r in self.rec.replicas.values():
            for s in r.shards:
                need = SHARD_MEMORY_GB.get((r.model, r.profile), 0)
                held[s.node_id] = held.get(s.node_id, 0) + need
        for node, gb in held.items():
            assert gb <= NODE_MEMORY_GB, (
                f"{node} holds shards needing {gb} GiB, has {NODE_MEMORY_GB} GiB: {self._describe()}"
            )

    @invariant()
    def every_replica_has_a_way_out(self) -> None:
        for r in self.rec.replicas.values():
            exits = [to for (frm, to) in TRANSITIONS if frm is r.state]
            assert exits, f"{r.replica_id} is {r.state.value}, which has no way out"
            self._check_age(r)

    def _check_age(self, r: Replica) -> None:
        t = TIMING
        slack = MAX_TICK  # a pass runs at most one tick later
        if r.state in (R.PENDING, R.STARTING):
            profile = self.rec.catalog.profile(r.model, r.profile)
            if profile is None:
                return  # stopped on the next pass
            limit = profile.startup_timeout_s + t.startup_margin_s + slack
            # placed, or back to starting since (a shard restarted, or it was woken)
            since = max(r.created_at, r.restarted_at or 0.0)
            assert self.now - since <= limit, (
                f"{r.replica_id} is {r.state.value} {self.now - since:g} s after it was "
                f"placed or restarted (bound {limit:g} s)"
            )
        elif r.state is R.DRAINING:
            limit = t.drain_timeout_s + slack
            assert self.now - r.state_since <= limit, (
                f"{r.replica_id} is Draining for {self.now - r.state_since:g} s (bound {limit:g} s)"
            )
        elif r.state is R.SLEEPING:
            limit = SLEEP_S + slack
            assert self.now - r.state_since <= limit, (
                f"{r.replica_id} is Sleeping for {self.now - r.state_since:g} s (bound {limit:g} s)"
            )
        elif r.state in (R.FAILED, R.STOPPING):
            limit = t.stop_timeout_s + slack
            assert self.now - r.state_since <= limit, (
                f"{r.replica_id} is {r.state.value} for {self.now - r.state_since:g} s "
                f"(bound {limit:g} s)"
            )

    @invariant()
    def ready_replicas_really_serve(self) -> None:
        """Ready never exceeds what the fleet reports: every shard of a Ready replica
        runs, ready, on the node the reconciler thinks (where that node has a stream:
        a node without one cannot tell, and registers what runs when it returns)."""
        for r in self.rec.replicas.values():
            if r.state is not R.READY:
                continue
            assert len(r.shards) == r.world_size, (
                f"{r.replica_id} is Ready with {len(r.shards)} of {r.world_size} shards"
            )
            for s in r.shards:
                agent = self.agents[s.node_id]
                if agent.link != "up":
                    continue
                real = agent.running.get(s.shard_id)
                assert real is not None and real.state == "ready", (
                    f"{r.replica_id} is Ready, but {s.node_id} "
                    f"{'does not run' if real is None else 'reports ' + real.state} "
                    f"shard {s.shard_id}"
                )

    @invariant()
    def nothing_runs_that_the_reconciler_forgot(self) -> None:
        """Every shard a connected agent runs belongs to a replica the reconciler knows
        (it was told to stop everything else, and a connected agent stops at once)."""
        known = {(s.node_id, s.shard_id) for r in self.rec.replicas.values() for s in r.shards}
        for agent in self.agents.values():
            if agent.link != "up":
                continue
            for sid, shard in agent.running.items():
                if (agent.node_id, sid) in self.excused:
                    continue
                assert (agent.node_id, sid) in known, (
                    f"{agent.node_id} runs shard {sid} ({shard.state}, GPUs {shard.spec.gpus}), "
                    "which no replica of the reconciler's holds: nothing will ever stop it, "
                    "and its GPUs look free"
                )


ReconcilerMachine.TestCase.settings = settings(
    max_examples=800,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReconcilerMachine = ReconcilerMachine.TestCase


# --- the bugs the machine found, as plain sequences ------------------------------------


class World:
    """The machine's world driven by hand, for the minimal sequences hypothesis found."""

    def __init__(self, gpus: list[int], replicas: dict[str, int]) -> None:
        self.m = ReconcilerMachine()
        self.m.setup(gpus=gpus, tiny=0, big=0, flex=0, wide=None)
        self.m.replicas = dict(replicas)
        self.m.present = dict.fromkeys(replicas, True)
        self.m.rec.set_catalog(self.m._catalog())
        self.plans: list[Plan] = []
        deliver = self.m._deliver

        def recording(plan: Plan, *, from_pass: bool = False) -> None:
            self.plans.append(plan)
            deliver(plan, from_pass=from_pass)

        self.m._deliver = recording  # type: ignore[method-assign]

    def agent(self, node: str) -> Agent:
        return self.m.agents[node]

    def where(self, model: str) -> list[Replica]:
        return [r for r in self.m.rec.replicas.values() if r.model == model]

    def stops(self) -> set[tuple[str, str]]:
        return {(s.node, s.shard_id) for p in self.plans for s in p.stop}


def test_a_shard_reported_for_a_stopping_replica_is_told_to_stop() -> None:
    """Hypothesis: setup(gpus=[1, 0, 1], big=1, wide=1); model big leaves; settle;
    disconnect n1; n3's agent restarts, its engines dead; n1 returns; wide leaves; settle
    -> n1 runs wide's rank 0 and the reconciler has forgotten it.

    Plainer: a replica is still starting on n1 when n1 loses its stream (it comes up
    meanwhile); scaled to zero, it is stopped (the stop cannot be sent); n1 comes back
    reporting the shard ready; the registration takes it back into the Stopping replica
    and sends nothing. Thirty seconds later the replica is forgotten, the engine runs
    on, unknown to the control plane, and its GPU and port look free to placement."""
    w = World([1, 1], {"big": 1})
    w.m._tick(1)
    w.m._tick(TIMING.settle_s)  # past the settle time after a start
    [replica] = w.where("big")
    [shard] = replica.shards
    node = w.agent(shard.node_id)
    w.m._disconnect(node)
    node.running[shard.shard_id].state = "ready"  # it comes up meanwhile (status queued)
    w.m._emit(node, ShardStatus(shard_id=shard.shard_id, state="ready"))
    w.m.replicas["big"] = 0
    w.m.rec.set_catalog(w.m._catalog())
    w.m._tick(1)
    assert replica.state is R.STOPPING
    w.plans.clear()
    w.m._register(node)  # it reports the shard, ready
    for _ in range(10):  # 50 s: past stop_timeout_s
        w.m._tick(5)
    assert shard.shard_id not in node.running, (
        f"{node.node_id} still runs {shard.shard_id}; the reconciler "
        f"{'forgot it' if replica.replica_id not in w.m.rec.replicas else 'holds it'} "
        f"and has planned no stop since it came back: {sorted(w.stops())}"
    )


def test_a_failed_replicas_gpus_are_not_reused_while_its_shards_still_run() -> None:
    """Hypothesis: setup(gpus=[1, 1, 1], wide=1); settle; node_lost(n1, engines die)
    -> told n2 to start wide's new rank 0 on GPU 0 and port 20000, which the old
    replica's rank 1, still running there, holds (its stop comes in the same plan,
    after the start; the agent refuses a port that another process holds)."""
    w = World([1, 1, 1], {"wide": 1})
    w.m.settle()
    [old] = w.where("wide")
    lost, survivor = old.shards[0].node_id, old.shards[1]
    w.m._disconnect(w.agent(lost))
    w.agent(lost).running.clear()
    w.plans.clear()
    while w.m.table.nodes[lost].state is not NodeState.LOST:
        w.m._tick(5)
    starts = [(s.node, s.spec) for p in w.plans for s in p.start]
    clash = [
        spec.shard_id
        for n, spec in starts
        if n == survivor.node_id
        and (set(spec.gpus) & set(survivor.spec.gpus) or spec.port == survivor.spec.port)
    ]
    assert not clash, (
        f"{clash} placed on {survivor.node_id}'s GPU {survivor.spec.gpus} / port "
        f"{survivor.spec.port} in the pass that fails {old.replica_id}, whose "
        f"{survivor.shard_id} still runs there"
    )


def test_scale_down_keeps_the_replica_that_serves() -> None:
    """Hypothesis: setup(gpus=[0, 0, 0], tiny=1); settle; node_lost(n1, engines
    survive); node_returns(n1); settle -> the adopted replica on n1, Ready, is drained as
    the extra, and the one placed on n2 meanwhile, still starting, is kept: the model
    serves from nothing until that one has loaded (minutes, for a large model)."""
    w = World([0, 0, 0], {"tiny": 1})
    w.m.settle()
    [serving] = w.where("tiny")
    shard_id, home = serving.shards[0].shard_id, w.agent(serving.shards[0].node_id)
    w.m.node_lost(pick=w.m._nodes("up").index(home.node_id), engines_survive=True)
    w.m._register(home)  # back, still serving: adopted, Ready
    w.plans.clear()
    w.m._tick(1)
    drained = {d.shard_id for p in w.plans for d in p.drain}
    assert shard_id not in drained, (
        f"drained {shard_id}, which serves, and kept "
        f"{[r.replica_id + ' (' + r.state.value + ')' for r in w.where('tiny') if r.counts]}"
    )


def test_a_rollout_on_the_only_free_gpu_replaces_in_place_beside_cordoned_nodes() -> None:
    """Hypothesis: setup(gpus=[0, 0, 1], big=1); settle; cordon n1; cordon n2; big's
    profile changes; settle -> the old replica stays leaving forever, its replacement
    never placed: most nodes refused it as cordoned, so the rollout was not seen to be
    short of the one GPU the old replica holds, and the old one was never given up."""
    w = World([0, 0, 1], {"big": 1})
    w.m.settle()
    w.m.cordon(0)
    w.m.cordon(1)
    w.m.profile_changes("big")
    w.m.settle()  # asserts it converges: one Ready replica of the new version
    [replica] = w.where("big")
    assert not replica.outdated


def test_a_sleeping_replica_outlives_a_control_plane_restart_and_is_woken_not_placed() -> None:
    """big let go sleeps; the control plane restarts and adopts it asleep (its agent
    reports ``sleeping``); wanted again, that engine is woken: nothing new is started."""
    w = World([1, 0, 0], {"big": 1})
    w.m.settle()
    [serving] = w.where("big")
    shard_id = serving.shards[0].shard_id
    w.m.change_replicas("big", 0)
    w.m.settle()
    [asleep] = w.where("big")
    assert asleep.state is R.SLEEPING and w.agent("n1").running[shard_id].state == "sleeping"
    w.m.control_plane_restarts(registered_now=3)
    w.m.settle()
    [adopted] = w.where("big")
    assert adopted.state is R.SLEEPING and adopted.adopted
    w.plans.clear()
    w.m.change_replicas("big", 1)
    w.m.settle()
    [woken] = w.where("big")
    assert woken.state is R.READY and woken.shards[0].shard_id == shard_id
    assert [s.shard_id for p in w.plans for s in p.wake] == [shard_id]
    assert not [s for p in w.plans for s in p.start]

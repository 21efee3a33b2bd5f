"""Would the routing settings ``ctl bench`` recommends shed load the bench saw served?

The recommendation is read from samples of the engine's load, four a second,
and samples miss: short replies queue for a few milliseconds at a time, so a
one-slot llama-server that served three clients within the SLO can read as
having queued nothing, and ``target_waiting = 0`` would then let the router send
it one request at a time and refuse the other two with 429. Each level that
met the SLO is put to the router's own admission rule
(``llmgw.router.balancer.above_thresholds``, with the requests in flight the
level had): where the router would refuse the replica a request it served, the
operator is told, with how many it would take and what would take them all.
"""

from __future__ import annotations

import math

from llmgw.bench.ladder import Level
from llmgw.bench.results import Recommendation, Run, capacity_level, kv_ceiling
from llmgw.engines.base import LoadSignals
from llmgw.router.balancer import Admission, Endpoint, above_thresholds


def shed_warnings(run: Run) -> list[str]:
    """One line, where admission by the recommendation would refuse load the run saw
    served within the SLO; empty when it would not."""
    rec, best = run.recommendation, capacity_level(run.levels)
    if rec is None or best is None:
        return []
    replicas = len(run.target.replicas) if run.target.kind == "router" else 1
    replicas = max(1, replicas)
    admission = Admission(target_waiting=rec.target_waiting, kv_ceiling=rec.kv_ceiling)
    met = [lv for lv in run.levels if lv.concurrency <= best.concurrency]
    for lv in [best, *met]:  # the capacity first: that is what would be lost
        load, per = _load(lv, replicas), math.ceil(lv.concurrency / replicas)
        why = refusal(load, admission, per)
        if not why:
            continue
        takes = next((n - 1 for n in range(1, per + 1) if refusal(load, admission, n)), per)
        who = "these replicas" if replicas > 1 else "this replica"
        kv = "-" if rec.kv_ceiling is None else f"{rec.kv_ceiling:g}"
        return [
            f"target_waiting = {rec.target_waiting}, kv_ceiling = {kv} would shed load {who}"
            f" served within the SLO: at concurrency {lv.concurrency}, which met it, the router"
            f" would refuse a request ({'; '.join(why)}) and take {takes} at once where"
            f" {per} met the SLO; {_fix(lv, load, rec, per)} would take them all"
        ]
    return []


def refusal(load: LoadSignals, admission: Admission, in_flight: int) -> list[str]:
    """Why the router would refuse a replica reading ``load`` its ``in_flight``-th
    request (the others already on it), in the router's words; empty: it takes it."""
    on = Endpoint(key="bench", model="", url="", in_flight=in_flight - 1,
                  in_flight_at_load=in_flight - 1)  # fmt: skip
    return above_thresholds(load, admission, on)


def _load(lv: Level, replicas: int) -> LoadSignals:
    """What one replica's engine read at this level (the run adds queues up over the
    replicas it aimed at, and keeps the fullest KV cache)."""

    def each(value: float | None) -> float | None:
        return None if value is None else value / replicas

    return LoadSignals(
        waiting=each(lv.waiting_max),
        running=each(lv.running_max),
        kv_usage=lv.kv_max,
        slots=each(lv.slots),
    )


def _fix(lv: Level, load: LoadSignals, rec: Recommendation, per: int) -> str:
    """The least settings under which the router takes the level's load."""
    kv = rec.kv_ceiling
    if kv is not None and lv.kv_max is not None and lv.kv_max > kv:
        kv = kv_ceiling(lv.kv_max)
    waiting, most = rec.target_waiting, per + math.ceil(load.waiting or 0)
    while refusal(load, Admission(target_waiting=waiting, kv_ceiling=kv), per) and waiting < most:
        waiting += 1
    parts = []
    if waiting != rec.target_waiting:
        parts.append(f"target_waiting = {waiting}")
    if kv != rec.kv_ceiling:
        parts.append(f"kv_ceiling = {kv:g}")
    return " and ".join(parts) or "no threshold"

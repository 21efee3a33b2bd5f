"""A bench run as a value: kept as JSON, shown as a table and a plot, compared with
another, and turned into the routing settings admission should use.

Recommendations come from the levels that met the SLO, up to the last (the capacity):

- ``weight``: that level's concurrency. The balancer sends each replica work in
  proportion to its weight, so replicas weighted by the concurrency each can
  serve within the SLO each get their share.
- ``target_waiting``: the most requests the engine had queued at any level that
  met the SLO: a queue that deep is healthy, a deeper one is not. It may be 0: a
  one-slot llama-server whose SLO broke at concurrency 2 broke it with one request
  queued, so admitting a queue of one would let it break the SLO again.
- ``kv_ceiling``: the fullest KV cache seen at any of those levels, rounded up to
  5 %, when the engine reports one (vLLM's KV usage; llama.cpp's slots' context
  fill). The samples are noisy: a lower level may read fuller than the capacity's,
  and a ceiling under what it read would refuse load the run saw served.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from llmgw.bench.ladder import Level

FORMAT = 1


class Hardware(msgspec.Struct, kw_only=True):
    """What discovery says of the node(s) the replica runs on."""

    nodes: list[str] = []
    gpus: list[str] = []  # GPU names, one per GPU
    cpus: int | None = None
    memory_gb: float | None = None


class Target(msgspec.Struct, kw_only=True):
    kind: str  # "router" (as a client sees the fleet) or "replica" (straight at one)
    url: str
    replica_id: str = ""
    replicas: list[str] = []  # behind the router: the model's Ready replicas when it began


class Recommendation(msgspec.Struct, kw_only=True):
    weight: float
    target_waiting: int
    kv_ceiling: float | None = None


class Run(msgspec.Struct, kw_only=True):
    format: int = FORMAT
    date: str  # ISO 8601, UTC
    model: str
    profile: str = ""
    engine: str = ""
    engine_version: str = ""
    target: Target
    hardware: Hardware = msgspec.field(default_factory=Hardware)
    slo: str
    settings: dict[str, Any] = {}  # input and output lengths, shared prefix, duration
    levels: list[Level] = []
    capacity: int | None = None  # the concurrency of the last level that met the SLO
    recommendation: Recommendation | None = None
    # where the recommendation would make the router's admission refuse load the run
    # saw served within the SLO, in words (llmgw.cli.shed says them)
    warnings: list[str] = []
    # why the ladder ended before it was climbed ("" when it was): an interrupted run
    # keeps the levels it finished, and is kept level by level as it goes
    stopped: str = ""


def capacity_level(levels: list[Level]) -> Level | None:
    """The last level that met the SLO, before the first that broke it."""
    best = None
    for level in levels:
        if not level.met_slo:
            break
        best = level
    return best


def kv_ceiling(kv: float) -> float:
    """A KV-cache reading as a ceiling: rounded up to 5 %, and never 0 (a ceiling of 0
    would refuse everything)."""
    return min(1.0, math.ceil(kv * 20 - 1e-9) / 20) or 0.05


def recommend(levels: list[Level]) -> Recommendation | None:
    """From the levels that met the SLO, the capacity last; None when none did."""
    if not levels:
        return None
    kvs = [lv.kv_max for lv in levels if lv.kv_max is not None]
    kv = kv_ceiling(max(kvs)) if kvs else None
    waits = [lv.waiting_max for lv in levels if lv.waiting_max is not None]
    waiting = math.ceil(max(waits)) if waits else 0
    return Recommendation(
        weight=float(levels[-1].concurrency), target_waiting=waiting, kv_ceiling=kv
    )


def finish(run: Run) -> Run:
    best = capacity_level(run.levels)
    run.capacity = best.concurrency if best else None
    met = run.levels[: run.levels.index(best) + 1] if best else []
    run.recommendation = recommend(met)
    return run


def load(data: bytes, where: str) -> Run:
    try:
        return msgspec.json.decode(data, type=Run)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where} is not a bench result: {exc}") from None


# --- for people ---------------------------------------------------------------------


def _t(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s"


def _n(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def render(run: Run) -> str:
    head = [
        f"{run.model} ({run.profile or '?'} profile, {run.engine or '?'} {run.engine_version})"
        f" via {run.target.kind} {run.target.replica_id or run.target.url}, {run.date}",
        f"hardware: {describe_hardware(run.hardware)}",
        f"SLO: {run.slo}",
    ]
    rows = [
        ["CONC", "REQ/S", "OUT TOK/S", "IN/OUT TOK", "CACHED", "TTFT p50", "TTFT p95",
         "ITL p50", "ITL p95", "E2E p95", "ERR", "WAITING", "RUNNING", "KV", "SLO"],
    ]  # fmt: skip
    for lv in run.levels:
        rows.append(
            [
                str(lv.concurrency),
                _n(lv.rps, 2),
                _n(lv.output_tps),
                f"{lv.input_tokens:.0f}/{lv.output_tokens:.0f}",
                _n(lv.cached_tokens, 0),
                _t(lv.ttft_p50),
                _t(lv.ttft_p95),
                _t(lv.itl_p50),
                _t(lv.itl_p95),
                _t(lv.e2e_p95),
                f"{lv.errors}/{lv.requests}",
                _n(lv.waiting_max, 0),
                _n(lv.running_max, 0) + ("" if lv.slots is None else f"/{lv.slots:.0f}"),
                "-" if lv.kv_max is None else f"{lv.kv_max:.0%}",
                "met" if lv.met_slo else "broke: " + "; ".join(lv.broke),
            ]
        )
    lines = [*head, "", _table(rows), ""]
    best = capacity_level(run.levels)
    if best is None:
        lines.append("capacity: none: the SLO is not met even at the first level")
    else:
        lines.append(
            f"capacity: concurrency {best.concurrency} ({best.rps:.2f} req/s, "
            f"{best.output_tps:.1f} output tok/s) is the last level that met the SLO"
        )
    if run.recommendation is not None:
        r = run.recommendation
        kv = "-" if r.kv_ceiling is None else f"{r.kv_ceiling:g}"
        lines.append(
            f"recommended for profile {run.profile or '?'}: weight = {r.weight:g}, "
            f"target_waiting = {r.target_waiting}, kv_ceiling = {kv}"
        )
    lines += [f"warning: {w}" for w in run.warnings]
    if run.stopped:
        lines.append(f"stopped early: {run.stopped}")
    return "\n".join(lines)


def describe_hardware(h: Hardware) -> str:
    parts = []
    if h.nodes:
        parts.append(", ".join(h.nodes))
    if h.gpus:
        names = sorted(set(h.gpus))
        parts.append(f"{len(h.gpus)} GPU ({', '.join(names)})")
    if h.cpus:
        parts.append(f"{h.cpus} CPUs")
    if h.memory_gb:
        parts.append(f"{h.memory_gb:.0f} GiB")
    return ", ".join(parts) or "unknown"


def plot(run: Run, *, height: int = 8) -> str:
    """Throughput and TTFT p95 against concurrency, in the terminal, the SLO's TTFT
    limit drawn as a line of dashes."""
    levels = run.levels
    if not levels:
        return ""
    col = 7
    xs = "".join(str(lv.concurrency).center(col) for lv in levels)
    out = []
    limit = None
    for part in run.slo.split(","):
        key, _, value = part.partition("=")
        if key == "ttft_p95":
            limit = _parse_shown(value)
    for title, values, line in (
        ("output tok/s", [lv.output_tps for lv in levels], None),
        ("TTFT p95 (s)", [lv.ttft_p95 or 0.0 for lv in levels], limit),
    ):
        top = max([*values, line or 0.0]) or 1.0
        out.append(f"{title}, up to {top:.3g}")
        for row in range(height, 0, -1):
            lo = top * (row - 1) / height
            hi = top * row / height
            cells = []
            for v in values:
                mark = "#" if v > lo else " "
                if line is not None and lo < line <= hi:
                    mark = "*" if v > lo else "-"
                cells.append(mark.center(col, "-" if line is not None and lo < line <= hi else " "))
            out.append("|" + "".join(cells))
        out.append("+" + "-" * (col * len(levels)))
        out.append(" " + xs + "  concurrency")
    if limit is not None:
        out.append(f"(---: the SLO's TTFT p95 of {limit:g} s)")
    return "\n".join(out)


def slo_limits(slo: str) -> dict[str, float]:
    """The latency limits of a kept run's SLO (as ``Slo`` writes it), in seconds."""
    out = {}
    for part in slo.split(","):
        key, _, value = part.partition("=")
        limit = _parse_shown(value)
        if key != "error_rate" and limit is not None:
            out[key] = limit
    return out


def _parse_shown(value: str) -> float | None:
    v = value.strip()
    try:
        if v.endswith("ms"):
            return float(v[:-2]) / 1000
        if v.endswith("s"):
            return float(v[:-1])
        return float(v)
    except ValueError:
        return None


PNG_NEEDS = (
    "--png needs matplotlib, which this llmgw cannot import (the single file has none):"
    " draw with --svg FILE instead, which needs nothing, or pip install matplotlib"
    " beside an installed llmgw"
)


def png_problem() -> str:
    """Why ``png`` cannot draw here ("" when it can): asked before the run, so that
    a missing matplotlib costs no measurement."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError:
        return PNG_NEEDS
    return ""


def png(run: Run, path: str) -> None:
    """The same plot as a PNG, with matplotlib (an optional dependency: ``svg`` draws
    it without one)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(PNG_NEEDS) from None
    xs = [lv.concurrency for lv in run.levels]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    top.plot(xs, [lv.output_tps for lv in run.levels], marker="o")
    top.set_ylabel("output tokens/s")
    top.set_title(f"{run.model} ({run.profile}): throughput and latency against concurrency")
    bottom.plot(xs, [lv.ttft_p95 for lv in run.levels], marker="o", label="TTFT p95")
    bottom.plot(xs, [lv.itl_p95 for lv in run.levels], marker="s", label="ITL p95")
    for part in run.slo.split(","):
        key, _, value = part.partition("=")
        limit = _parse_shown(value)
        if key in ("ttft_p95", "itl_p95") and limit is not None:
            bottom.axhline(limit, linestyle="--", color="red", label=f"SLO {key}")
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(xs, [str(x) for x in xs])
    bottom.minorticks_off()
    bottom.set_xlabel("concurrency")
    bottom.set_ylabel("seconds")
    bottom.legend()
    if run.capacity is not None:
        for ax in (top, bottom):
            ax.axvline(run.capacity, color="green", linestyle=":")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(a: Run, b: Run) -> str:
    """Two runs side by side, level by level, with B's figures as a ratio of A's."""
    lines = [
        f"A: {a.model} {a.profile} {a.engine} {a.engine_version} on "
        f"{describe_hardware(a.hardware)}, {a.date}, capacity {a.capacity}",
        f"B: {b.model} {b.profile} {b.engine} {b.engine_version} on "
        f"{describe_hardware(b.hardware)}, {b.date}, capacity {b.capacity}",
    ]
    if a.slo != b.slo:
        lines.append(f"note: the SLOs differ (A: {a.slo}; B: {b.slo})")
    if a.settings != b.settings:
        lines.append(f"note: the settings differ (A: {a.settings}; B: {b.settings})")
    by_b = {lv.concurrency: lv for lv in b.levels}
    rows = [["CONC", "REQ/S A", "REQ/S B", "B/A", "TOK/S A", "TOK/S B", "B/A",
             "TTFT p95 A", "TTFT p95 B", "ITL p95 A", "ITL p95 B"]]  # fmt: skip
    seen = set()
    for la in a.levels:
        lb = by_b.get(la.concurrency)
        seen.add(la.concurrency)
        rows.append(_compare_row(la.concurrency, la, lb))
    for lb in b.levels:
        if lb.concurrency not in seen:
            rows.append(_compare_row(lb.concurrency, None, lb))
    rows[1:] = sorted(rows[1:], key=lambda r: int(r[0]))
    return "\n".join([*lines, "", _table(rows)])


def _ratio(b: float | None, a: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}"


def _compare_row(c: int, a: Level | None, b: Level | None) -> list[str]:
    return [
        str(c),
        _n(a.rps if a else None, 2),
        _n(b.rps if b else None, 2),
        _ratio(b.rps if b else None, a.rps if a else None),
        _n(a.output_tps if a else None),
        _n(b.output_tps if b else None),
        _ratio(b.output_tps if b else None, a.output_tps if a else None),
        _t(a.ttft_p95 if a else None),
        _t(b.ttft_p95 if b else None),
        _t(a.itl_p95 if a else None),
        _t(b.itl_p95 if b else None),
    ]

"""The benchmarks under tools/ still run: each at a tiny size, from the project's venv.

They are not timed here (figures belong in their own output, on a quiet
machine); this only keeps them from rotting as the code they drive changes.
The router benchmarks need their own virtualenvs (uvicorn, LiteLLM) and are
left to be run by hand; the abuse benchmark needs llama-server, as the
cluster tests do.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.realparts import needs_server

ROOT = Path(__file__).resolve().parents[2]


def run_tool(module: str, *args: str, timeout: float = 120) -> str:
    """``python -m MODULE ARGS`` from the checkout, as the README runs the benchmarks."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def test_bench_reconcile_runs_and_judges_its_goals() -> None:
    text = run_tool(
        "tools.bench_reconcile",
        "--nodes=20",
        "--models=2",
        "--replicas-per-model=5",
        "--passes=5",
        "--place-repeats=2",
    )
    assert "goal: a full reconcile pass under 50 ms:" in text
    assert "goal: every replica re-adopted within one heartbeat interval: met" in text


def test_bench_http_server_runs() -> None:
    text = run_tool("tools.bench_http_server", "--requests=200", "--seconds=0.5")
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["16"])]
    assert [r[:2] for r in rows] == [["1", "200"], ["16", "200"]], text


@pytest.mark.parametrize("client", ["pool", "httpx"])
def test_bench_upstream_pool_runs(client: str) -> None:
    text = run_tool(
        "tools.bench_upstream_pool", "--requests=50", "--seconds=0.5", f"--client={client}"
    )
    assert sum(1 for line in text.splitlines() if line.split()[:1] == [client]) >= 2, text


def test_bench_agents_holds_a_small_fleet() -> None:
    text = run_tool(
        "tools.bench_agents",
        "--agents=5",
        "--heartbeat=0.5",
        "--window=2",
        "--workers=1",
        "--connect-spread=0.2",
        "--unreachable-after=2",
        "--lost-after=4",
    )
    assert "registrations / reconnects" in text
    assert "N = 5: no problems seen" in text


@needs_server
def test_bench_abuse_runs_every_attack() -> None:
    text = run_tool("tools.bench_abuse", "--quick", timeout=240)
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[:1]}
    attacks = ["nokey", "poison", "flood", "log", "body-budget", "metrics-listener"]
    attacks += ["connections", "slow-reader", "grammar"]
    assert set(attacks) <= set(rows), text
    assert "forged lines in the server's log: 0" in rows["log"], text
    for attack in attacks:  # the good client's failures: none
        assert rows[attack].split()[2] == "0", text
    assert "the engine: alive" in rows["grammar"], text  # refused before it saw them


def test_bench_reload_runs() -> None:
    text = run_tool("tools.bench_reload", "--mib=0.1,4.5", "--after=0.5")
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0.1"], ["4.5"])]
    assert [r[3] for r in rows] == ["200", "400"], text


@needs_server
def test_bench_goodput_runs_every_workload_and_policy() -> None:
    text = run_tool("tools.bench_goodput", "--quick", timeout=300)
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (
        ["multiturn"], ["shared"], ["unique"])]  # fmt: skip
    assert [(r[0], r[1]) for r in rows] == [
        (w, p) for w in ("multiturn", "shared", "unique") for p in ("rr", "load", "prefix")
    ], text
    answered = [r[2].split("/") for r in rows]  # every request answered: "ok/requests"
    assert all(ok == total for ok, total in answered), text
    # each turn matched to its access log line: the later turns' moves are counted
    moved = [r[-3] for r in rows if r[0] == "multiturn"]
    assert all(m.isdigit() for m in moved), text
    # and why affinity sent each where it went: only prefix routes by it
    assert [r[-1].isdigit() for r in rows] == [r[1] == "prefix" for r in rows], text
    for w in ("multiturn", "shared", "unique"):
        assert re.search(rf"^routes: {w} prefix: .*\b(first|even|held) \d+", text, re.M), text
    assert "goal: unique: TTFT p95 within 5% of load-only:" in text
    assert "choice: shared: by load" in text
    assert "cpu: shared: router CPU per request by load" in text


def test_bench_goodputs_cpu_measure_runs_alone_over_several_seeds() -> None:
    """``--cpu-only`` runs no policy's goodput run: with several seeds, no sweep (the
    rotation of the policies' order once divided by their count, zero here)."""
    text = run_tool("tools.bench_goodput", "--quick", "--cpu-only", "--seed", "1-2", timeout=300)
    assert "cpu: shared: router CPU per request by load" in text, text
    assert "goal: unique: router CPU per request <= 1.1x load-only" in text, text


@needs_server
def test_bench_tenants_runs_and_holds_budgets_across_killed_routers() -> None:
    """Small: what it prints is the issue's table; a budget overspent or a request
    refused within one fails here too (the design says none, whatever the size)."""
    text = run_tool(
        "tools.bench_tenants",
        "--quick",
        "--tenants=5",
        "--requests=400",
        "--outage-s=3",
        "--only=budgets,outage,cpu,fair",
        timeout=400,
    )
    assert "budgets: 0 tokens served past budgets" in text, text
    assert " 0 false refusals (goal 0: met)" in text, text
    assert "outage:" in text and "cpu: tenants on / off =" in text, text
    assert "fair: steady TTFT p95 with noisy / without =" in text, text


@needs_server
def test_bench_demand_runs_its_shape_and_fails_no_request() -> None:
    """Small (a few users, short phases, the elastic run only): the figures it prints
    are the issue's, and no request fails through zero, a burst, a sine and idle."""
    text = run_tool(
        "tools.bench_demand",
        "--only=elastic",
        "--users=4",
        "--burst-s=5",
        "--period=16",
        "--periods=1",
        "--idle-s=3",
        timeout=300,
    )
    assert "elastic: " in text and " 0 failed " in text, text
    assert "first request at zero: TTFT" in text, text
    assert "starts per rise of the sine:" in text, text
    assert "flapping, a start after a stop within it:" in text, text
    assert "0 → 1: 1 request held with no replica" in text, text  # the first request
    assert "no request for 3 s" in text, text  # and back to zero


def test_bench_demand_counts_rises_stops_and_flaps_from_the_server_log() -> None:
    from tools.bench_demand import _sine

    def line(at: float, change: str) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        return f"{stamp},{int(at * 1000) % 1000:03d} INFO llmgw.scaling: scaling m: {change}: why"

    start = time.mktime(time.strptime("2026-12-05 10:00:00", "%Y-%m-%d %H:%M:%S"))
    log = "\n".join(
        [
            line(start + 5, "0 → 1"),  # first rise: woken, then grown
            line(start + 40, "1 → 2"),
            line(start + 130, "2 → 1"),  # a fall in the second period...
            line(start + 150, "1 → 2"),  # ...and a start again: a flap
        ]
    )
    assert _sine(log, start, 120.0, 2) == ([2, 1], 1, 1)
    assert _sine("\n".join(log.splitlines()[:2]), start, 120.0, 2) == ([2, 0], 0, 0)


@needs_server
def test_bench_console_measures_every_figure_at_a_tiny_size() -> None:
    """Its goals are judged on a quiet machine (exit 1 when one is missed): here, that it
    measures every figure and that every console stayed live and error-free."""
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench_console", "--nodes", "10", "--models", "2",
         "--replicas", "5", "--requests", "20", "--loads", "1", "--changes", "2",
         "--unreachable", "1", "--window", "3", "--consoles", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode in (0, 1), text[-4000:]
    for measure in ("first page load, cold", "GET /api/replicas p50 / p99",
                    "GET /api/models/M/placement", "cordon -> on screen",
                    "Unreachable (server's log) -> on screen", "server CPU, 2 consoles"):  # fmt: skip
        assert measure in text, text[-4000:]
    assert "consoles live and showing every change  2 of 2" in text, text[-4000:]
    assert "the pages' console: no errors" in text, text[-4000:]


def test_bench_goodput_takes_each_turns_replica_from_the_access_line_that_says_its_reuse(
    tmp_path: Path,
) -> None:
    """Two replies that end 5 ms apart: each turn gets the access log line whose reuse is
    what its own reply's timings said, not the nearer line (the other turn's), which
    counted a turn that stayed as moved; and why affinity sent it there, where the
    line says (``route=``)."""
    from tools.bench_goodput import Turn, from_access_log

    start = time.mktime(time.strptime("2026-12-05 10:00:00", "%Y-%m-%d %H:%M:%S"))

    def line(at: float, replica: str, cached: int, prompt: int, more: str = "") -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        return (
            f"{stamp},{round(at * 1000) % 1000:03d} INFO llmgw.router.access: key=k "
            f"model=m replica={replica} status=200 time=1.0s cached={cached}/{prompt} end=ok" + more
        )

    log = tmp_path / "llmgw.log"
    log.write_text(
        line(start + 1.000, "r0", 473, 516, " waited=0.100s route=held")
        + "\n"
        + line(start + 1.005, "r1", 39, 574, " sent=r2,r1 route=spill:full")
    )
    stayed = Turn("q", cache_n=473, prompt_n=43, ended_at=start + 1.006)
    other = Turn("q", cache_n=39, prompt_n=535, ended_at=start + 1.001)
    from_access_log(log, [stayed, other])
    assert (stayed.replica, stayed.cached, other.replica, other.cached) == ("r0", 473, "r1", 39)
    assert (stayed.route, other.route) == ("held", "spill:full")


def test_bench_goodputs_cpu_measure_sends_a_conversations_turns_in_the_order_they_come() -> None:
    """The router CPU measure's requests interleave conversations as their turns arrive
    (a turn comes a think time after the one before): never a conversation's turns
    back to back, which a closed loop then sent at once, all to the replica holding it,
    and what that did to the engines' pace, not the choice, set the router's CPU."""
    from tools.bench_goodput import Miss, Sizes, bodies

    sizes = Sizes()
    sizes.calibrate(Miss(ttft_s=2.9, total_s=3.4), replicas=4, cores=2)
    sent = bodies("multiturn", sizes, 1)
    firsts = [str(body["messages"][1]["content"]) for body in sent]  # type: ignore[index]
    assert len(sent) == 16 * sizes.turns
    for i in range(len(sent) - 1):
        assert firsts[i] != firsts[i + 1], f"requests {i} and {i + 1} are one conversation's"


def test_bench_goodputs_workloads_load_a_fast_machine_as_they_load_a_slow_one() -> None:
    """Every time in a workload follows the machine's measured miss: on a machine four
    times as fast, conversations start four times as often and their users think a
    quarter as long (a fixed think time offered it a quarter of the load)."""
    from tools.bench_goodput import Miss, Sizes, workload

    def timed(total_s: float) -> list[tuple[float, float]]:
        sizes = Sizes()
        sizes.calibrate(Miss(ttft_s=0.85 * total_s, total_s=total_s), replicas=4, cores=2)
        return [(s.start, s.think_s) for s in workload("multiturn", sizes, 1)]

    slow, fast = timed(3.4), timed(0.85)
    assert len(slow) == len(fast) == 16
    for (start, think), (start_fast, think_fast) in zip(slow, fast, strict=True):
        assert think > 0
        assert abs(start - 4 * start_fast) < 1e-6 and abs(think - 4 * think_fast) < 1e-6


def test_bench_goodputs_oracle_finds_a_shared_prompt_only_once_it_was_computed() -> None:
    """Users behind one system prompt, its first computed from 100 s to its first token
    at 102 s: a second, sent at 101 s and given a free slot at once, began before that
    and finds nothing cached, as on every router; a third, sent at 101 s too but
    waiting for a slot until 102.2 s, and a fourth sent at 102.5 s find the system
    prompt. A conversation's later turn finds its earlier turn and reply."""
    from tools.bench_goodput import Session, Turn, oracle

    system = [{"role": "system", "content": "S" * 600}]
    first = Turn("a?", ttft=2.0, sent_at=100.0, prompt_ms=2000)
    during = Turn("b?", ttft=2.5, sent_at=101.0, prompt_ms=2500)
    queued = Turn("c?", ttft=1.3, sent_at=101.0, prompt_ms=100)
    after = Turn("d?", ttft=0.2, sent_at=102.5, prompt_ms=100)
    later = Turn("e?", ttft=0.2, sent_at=110.0, prompt_ms=100)
    first.prompt_chars, first.reply = 602, "yes"
    sessions = [Session(0.0, system, [first, later], group="s0"),
                Session(1.0, system, [during], group="s0"),
                Session(1.0, system, [queued], group="s0"),
                Session(2.5, system, [after], group="s0")]  # fmt: skip
    oracle(sessions)
    shared = [t.shared_chars for t in (first, during, queued, after, later)]
    assert shared == [0, 0, 600, 600, 605]


def test_bench_goodput_pools_its_seeds_as_one_run_of_them_all() -> None:
    """Two seeds of one policy: goodput is the requests that met the SLO over both runs'
    wall time (not the mean of two rates: a short run would weigh as much as a long
    one), tokens and hits are summed, the imbalance is the median run's; and a goal
    judged on the pool says on how many seeds it was met."""
    from tools.bench_goodput import Result, goals, pooled, resampled, seed_range

    def run(seed: int, policy: str, met: int, wall: float, computed: float, imbal: float) -> Result:
        r = Result("shared", policy, seed, requests=10, ok=10, met=met, wall_s=wall)
        r.goodput, r.computed, r.cached = met / wall, computed, 1000 - computed
        r.hit_rate, r.imbalance, r.ttfts = r.cached / 1000, imbal, [0.5] * 10
        r.oracle_rate, r.oracle_computed = 0.8, 200
        return r

    runs = [run(1, "rr", 2, 10, 800, 1.1), run(1, "prefix", 8, 10, 300, 1.1),
            run(2, "rr", 1, 30, 600, 1.0), run(2, "prefix", 10, 30, 400, 1.4)]  # fmt: skip
    rr, prefix = pooled(runs)
    assert (prefix.met, prefix.wall_s, prefix.goodput) == (18, 40, 18 / 40)
    assert (rr.goodput, prefix.computed, prefix.hit_rate) == (3 / 40, 700, 1300 / 2000)
    assert prefix.imbalance == 1.25 and prefix.oracle_computed == 400
    judged = {g.what: g for g in goals([rr, prefix], [])}
    tokens = judged["shared: prompt tokens computed <= 0.5x round robin"]
    assert tokens.value == 0.5 and tokens.ok
    assert "(an oracle's: 0.29)" in tokens.line()  # 400 / 1400
    assert judged["shared: goodput >= 2x round robin"].value == 6.0
    assert seed_range("1-3") == [1, 2, 3] and seed_range("4") == [4]
    # how far the pooled figure moves over the seed sets one might have drawn: from
    # seed 1's alone (4x round robin's goodput, 0.375x its tokens) to seed 2's (10x,
    # 0.67x), which two seeds drawn with replacement give each one time in four
    spread = resampled(runs, [1, 2])
    assert spread["shared: goodput >= 2x round robin"] == (4.0, 10.0)
    assert spread["shared: prompt tokens computed <= 0.5x round robin"] == (300 / 800, 400 / 600)
    assert resampled([r for r in runs if r.seed == 1], [1])["shared: load imbalance <= 1.25"] == (
        1.1,
        1.1,
    )
    with pytest.raises(Exception, match="N or N-M"):
        seed_range("x")


def test_bench_goodputs_goal_against_a_baseline_that_met_no_slo_is_met() -> None:
    """A seed where round robin's goodput is 0 is a seed where the goal is met (an
    infinite ratio), not one left out of the tally."""
    from tools.bench_goodput import Result, goals

    rr = Result("shared", "rr", 1, requests=10, ok=10, computed=1000, imbalance=1.0)
    prefix = Result("shared", "prefix", 1, requests=10, ok=10, goodput=2.0, computed=400)
    prefix.imbalance = 1.1
    judged = {g.what: g for g in goals([rr, prefix], [])}
    assert judged["shared: goodput >= 2x round robin"].ok is True

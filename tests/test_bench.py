"""``ctl bench``'s parts that need no engine: prompts, the SLO, results and what they
recommend, the table, the plot, a comparison and the catalog edit."""

from __future__ import annotations

import itertools
import os
import pathlib
import re

import pytest

from llmgw.bench import results
from llmgw.bench.ladder import Level, Slo, SloError, default_levels, percentile
from llmgw.bench.prompts import Dist, DistError, PromptMaker
from llmgw.cli.catalog_edit import with_routing


def maker(**kw: object) -> PromptMaker:
    base: dict[str, object] = dict(
        input_words=Dist.parse("40", "x"), output_tokens=Dist.parse("8", "y")
    )
    base.update(kw)
    return PromptMaker(**base)  # type: ignore[arg-type]


def common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))  # noqa: RUF071 - strings, not paths


def test_prompts_are_unique_from_their_first_byte_by_default() -> None:
    m = maker()
    prompts = [m.next()[0] for _ in range(200)]
    assert len(set(prompts)) == 200
    # a random header first: any two share a prefix of a few bytes at most (by chance)
    assert max(common_prefix(a, b) for a, b in itertools.pairwise(prompts)) < 8


def test_a_shared_prefix_is_byte_identical_and_the_prompts_still_differ() -> None:
    m = maker(shared_prefix=30)
    prompts = [m.next()[0] for _ in range(100)]
    prefix = m.prefix
    assert len(prefix.split()) == 30
    assert all(p.startswith(prefix + " ") for p in prompts)  # byte for byte
    assert len(set(prompts)) == 100  # the header after it keeps them apart
    # the same prefix in another run: a second bench measures the same cache
    assert maker(shared_prefix=30).prefix == prefix
    # and what follows the prefix is unique from its first byte
    tails = [p[len(prefix) + 1 :] for p in prompts]
    assert max(common_prefix(a, b) for a, b in itertools.pairwise(tails)) < 8


def test_lengths_follow_their_distributions() -> None:
    m = maker(
        input_words=Dist.parse("uniform:20,60", "x"),
        output_tokens=Dist.parse("normal:50,5", "y"),
        seed=1,
    )
    drawn = [m.next() for _ in range(400)]
    words = [len(p.split()) for p, _ in drawn]  # the header is one word
    assert min(words) >= 21 and max(words) <= 61
    outs = [n for _, n in drawn]
    assert 45 < sum(outs) / len(outs) < 55


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("uniform:5", "uniform takes two numbers"),
        ("uniform:9,3", "needs LO <= HI"),
        ("lots", "give N, uniform:LO,HI or normal:MEAN,SD"),
        ("5,6", "a fixed length is one number"),
    ],
)
def test_a_bad_length_says_how_to_write_one(text: str, error: str) -> None:
    with pytest.raises(DistError, match=error):
        Dist.parse(text, "--input-words")


def test_the_slo_parses_and_says_what_broke() -> None:
    slo = Slo.parse("ttft_p95=2s,itl_p95=100ms,error_rate=1%")
    assert slo.limits == {"ttft_p95": 2.0, "itl_p95": 0.1, "error_rate": 0.01}
    ok = Level(concurrency=4, requests=200, errors=1, ttft_p95=1.5, itl_p95=0.05)
    assert slo.broken(ok) == []
    bad = Level(concurrency=8, requests=100, errors=5, ttft_p95=2.5, itl_p95=0.05)
    assert slo.broken(bad) == ["errors 5/100 > 1.0%", "ttft_p95 2.50s > 2.00s"]
    # by default no error is allowed, and a latency never measured breaks it
    assert Slo.parse("ttft_p95=2s").broken(Level(concurrency=1, requests=3, errors=3)) == [
        "errors 3/3 > 0.0%",
        "ttft_p95 none > 2.00s",
    ]
    for text in ("ttft=2s", "ttft_p95=fast", "", "error_rate=150%"):
        with pytest.raises(SloError, match="--slo"):
            Slo.parse(text)


def test_percentiles_and_the_default_ladder() -> None:
    assert percentile([], 95) is None
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0
    assert percentile([1.0], 50) == 1.0
    assert default_levels(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_levels(12) == [1, 2, 4, 8, 12]


def level(c: int, met: bool, **kw: float) -> Level:
    return Level(concurrency=c, requests=100, met_slo=met, rps=c * 1.0, output_tps=c * 10.0,
                 ttft_p95=0.1 * c, broke=[] if met else ["ttft_p95 1s > 500ms"], **kw)  # type: ignore[arg-type]  # fmt: skip


def a_run(levels: list[Level], version: str = "0.11.2") -> results.Run:
    run = results.Run(
        date="2026-12-01T12:00:00+00:00",
        model="m",
        profile="h200",
        engine="vllm",
        engine_version=version,
        target=results.Target(kind="replica", url="http://10.0.0.1:20000/v1", replica_id="m-x-1"),
        hardware=results.Hardware(nodes=["n1"], gpus=["NVIDIA H200"], cpus=64, memory_gb=512),
        slo="ttft_p95=500ms",
        levels=levels,
    )
    return results.finish(run)


def test_capacity_is_the_last_level_that_met_the_slo_and_sets_the_recommendation() -> None:
    run = a_run(
        [
            level(1, True, waiting_max=0, kv_max=0.1),
            level(2, True, waiting_max=2.4, kv_max=0.62),
            level(4, False, waiting_max=9, kv_max=0.97),
        ]
    )
    assert run.capacity == 2
    assert run.recommendation == results.Recommendation(
        weight=2.0, target_waiting=3, kv_ceiling=0.65
    )
    # a level after a broken one never counts, and none met: no capacity
    assert results.capacity_level([level(1, False), level(2, True)]) is None
    nothing = a_run([level(1, False)])
    assert nothing.capacity is None and nothing.recommendation is None
    assert "capacity: none" in results.render(nothing)


def test_the_table_plot_and_json_say_what_was_measured() -> None:
    run = a_run([level(1, True, waiting_max=0, running_max=1, slots=4),
                 level(2, False, waiting_max=5)])  # fmt: skip
    table = results.render(run)
    assert " 1/4 " in table  # busy slots of the engine's slots, where it says
    assert "m (h200 profile, vllm 0.11.2) via replica m-x-1" in table
    assert "hardware: n1, 1 GPU (NVIDIA H200), 64 CPUs, 512 GiB" in table
    assert "broke: ttft_p95 1s > 500ms" in table
    assert "capacity: concurrency 1 (1.00 req/s, 10.0 output tok/s)" in table
    assert "recommended for profile h200: weight = 1, target_waiting = 0, kv_ceiling = -" in table
    drawing = results.plot(run)
    assert "TTFT p95" in drawing and "-" * 5 in drawing  # the SLO's line
    again = results.load(__import__("msgspec").json.encode(run), "x")
    assert again == run


def test_two_runs_compare_level_by_level() -> None:
    a = a_run([level(1, True), level(2, True), level(4, False)])
    b = a_run([level(1, True), level(2, False)], version="0.12.0")
    text = results.compare(a, b)
    assert "A: m h200 vllm 0.11.2" in text and "B: m h200 vllm 0.12.0" in text
    row = next(line for line in text.splitlines() if line.startswith("2 "))
    assert row.split()[:4] == ["2", "2.00", "2.00", "1.00"]
    assert any(line.startswith("4 ") and " - " in line for line in text.splitlines())


CATALOG = """# the fleet's models
[models.m]
replicas = 2

[[models.m.profiles]]
name = "cpu"   # the fallback
engine = "llama.cpp"

[[models.m.profiles]]
name = "h200"
engine = "vllm"
gpus = 1
"""


def test_write_sets_the_profile_routing_and_keeps_the_rest_as_it_was() -> None:
    rec = results.Recommendation(weight=8.0, target_waiting=3, kv_ceiling=0.85)
    after = with_routing(CATALOG, "m", "h200", rec, "catalog.toml")
    import tomllib

    parsed = tomllib.loads(after)
    [cpu, h200] = parsed["models"]["m"]["profiles"]
    assert h200["routing"] == {"weight": 8.0, "target_waiting": 3, "kv_ceiling": 0.85}
    assert "routing" not in cpu
    assert after.startswith(CATALOG.rstrip("\n"))  # comments and layout kept, only added to
    assert with_routing(after, "m", "h200", rec, "catalog.toml") == after  # idempotent
    from llmgw.cli.admin_client import CtlError

    with pytest.raises(
        CtlError, match=re.escape("catalog.toml has no profile 'a100' of model 'm'")
    ):
        with_routing(CATALOG, "m", "a100", rec, "catalog.toml")


def test_a_recommendation_that_would_shed_what_the_replica_served_is_said() -> None:
    """Short replies queue for milliseconds: the samples read no queue, and a one-slot
    engine's target_waiting of 0 would let the router take one request at a time where
    three met the SLO (its own admission rule decides: llmgw.router.balancer)."""
    from llmgw.cli.shed import shed_warnings

    missed = a_run([level(c, True, waiting_max=0, slots=1, kv_max=0.3) for c in (1, 2, 3)])
    assert missed.recommendation is not None and missed.recommendation.target_waiting == 0
    assert shed_warnings(missed) == [
        "target_waiting = 0, kv_ceiling = 0.3 would shed load this replica served within the"
        " SLO: at concurrency 3, which met it, the router would refuse a request (waiting 2 > 0)"
        " and take 1 at once where 3 met the SLO; target_waiting = 2 would take them all"
    ]
    # the queue was seen: nothing to say
    seen = a_run([level(1, True, waiting_max=0, slots=1), level(2, True, waiting_max=1, slots=1),
                  level(3, True, waiting_max=2, slots=1)])  # fmt: skip
    assert shed_warnings(seen) == []
    # a KV cache read empty at the capacity, fuller below it, and a queue read deeper
    # below it (the samples are noisy): the recommendation takes the fullest and the
    # deepest any level that met the SLO read, so that it sheds none of them
    kv = a_run([level(1, True, waiting_max=0, slots=4, kv_max=0.32),
                level(2, True, waiting_max=0, slots=4, kv_max=0.0)])  # fmt: skip
    assert kv.recommendation is not None and kv.recommendation.kv_ceiling == 0.35
    assert shed_warnings(kv) == []
    vllm = a_run([level(2, True, waiting_max=4), level(4, True, waiting_max=3),
                  level(8, False, waiting_max=20)])  # fmt: skip
    assert vllm.recommendation is not None and vllm.recommendation.target_waiting == 4
    assert vllm.recommendation.weight == 4.0
    assert shed_warnings(vllm) == []
    # given a ceiling under what a level read (an operator's own), it is said
    vllm.recommendation.target_waiting = 3
    [line] = shed_warnings(vllm)
    assert "at concurrency 2, which met it" in line and "(waiting 4 > 3)" in line, line
    assert line.endswith("target_waiting = 4 would take them all")
    kv.recommendation.kv_ceiling = 0.05
    [line] = shed_warnings(kv)
    assert "kv_ceiling = 0.05" in line and "(kv 0.32 > 0.05)" in line, line
    assert line.endswith(
        "take 0 at once where 1 met the SLO; kv_ceiling = 0.35 would take them all"
    )
    # no capacity, no recommendation: nothing to warn of
    assert shed_warnings(a_run([level(1, False)])) == []
    # said under the recommendation in the table
    missed.warnings = shed_warnings(missed)
    assert "\nwarning: target_waiting = 0, kv_ceiling = 0.3 would shed" in results.render(missed)


def test_the_plot_as_svg_needs_nothing() -> None:
    from xml.etree import ElementTree

    from llmgw.bench.svg import svg

    run = a_run([level(1, True, itl_p95=0.01), level(2, True, itl_p95=0.02), level(4, False)])
    run.slo = "ttft_p95=500ms,itl_p95=100ms"
    doc = svg(run)
    root = ElementTree.fromstring(doc)  # well-formed
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"1", "2", "4", "TTFT p95", "ITL p95", "SLO ttft_p95", "SLO itl_p95"} <= set(texts)
    assert "concurrency" in texts
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 3
    # a run interrupted before its first level still draws
    ElementTree.fromstring(svg(a_run([])))


def test_ctl_bench_finds_the_endpoint_llmgw_init_set_up_beside_the_server(
    tmp_path: pathlib.Path,
) -> None:
    """``llmgw init`` runs the endpoint as ``llmgw router`` (router.toml beside
    server.toml): ``ctl bench --config server.toml`` measures through it."""
    from llmgw.cli.admin_client import Target
    from llmgw.cli.bench_aim import router_url
    from llmgw.cli.init import init

    init(dir_=tmp_path, name=["localhost"], endpoint_listen="0.0.0.0:8123")
    assert router_url(Target(config=tmp_path / "server.toml")) == "http://127.0.0.1:8123/v1"

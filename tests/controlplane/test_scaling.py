"""Ranged models' counts (``llmgw.controlplane.scaling``): read from the catalog, fed
routers' loads, kept through a restart, pinned and released, and the start times
measured from replicas that became Ready."""

from __future__ import annotations

import pytest

from llmgw.controlplane.catalog import ConfigError, parse_catalog, scaling_target
from llmgw.controlplane.followers import ReportRefused, RouterReports
from llmgw.controlplane.replicas import Replica, ReplicaState
from llmgw.controlplane.scaling import DEFAULT_START_S, Scaling
from llmgw.routing import ModelLoad, RouterReport, summed

CATALOG = """
[models.fixed]
replicas = 2
[[models.fixed.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/m.gguf"

[models.elastic]
replicas = {{ min = {min}, max = 3, idle_s = 30 {more} }}
[[models.elastic.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/m.gguf"
{routing}
"""


def catalog(min: int = 0, more: str = "", routing: str = "") -> object:
    return parse_catalog(CATALOG.format(min=min, more=more, routing=routing), "catalog.toml")


def test_a_range_parses_and_a_count_stays_a_count() -> None:
    c = parse_catalog(CATALOG.format(min=1, more="", routing=""), "catalog.toml")
    fixed, elastic = c.models["fixed"], c.models["elastic"]
    assert fixed.replicas == 2 and fixed.scaling is None
    assert elastic.scaling is not None and elastic.scaling.max == 3
    assert elastic.replicas == 1  # its min, until demand says more
    assert scaling_target(elastic) == 4.0  # nothing measured: llama.cpp's four slots
    with_weight = parse_catalog(
        CATALOG.format(min=0, more="", routing="[models.elastic.profiles.routing]\nweight = 6.0"),
        "catalog.toml",
    )
    assert scaling_target(with_weight.models["elastic"]) == 6.0  # as ctl bench wrote it
    own = parse_catalog(CATALOG.format(min=0, more=", target = 2", routing=""), "catalog.toml")
    assert scaling_target(own.models["elastic"]) == 2.0


@pytest.mark.parametrize(
    ("replicas", "said"),
    [
        ("{ min = 3, max = 2 }", "models.m.replicas.max: must be at least 1 and min (3)"),
        ("{ min = 0, max = 0 }", "models.m.replicas.max: must be at least 1"),
        ("{ min = -1, max = 2 }", "models.m.replicas.min: must be at least 0"),
        ("{ max = 2, target = 0 }", "models.m.replicas.target: must be greater than 0"),
        ("{ max = 2, idle_s = 0.5 }", "models.m.replicas.idle_s: must be at least 1 second"),
        ("{ min = 1 }", "models.m.replicas.max: required, but missing"),
        ("{ max = 2, mni = 1 }", "models.m.replicas.mni: unknown key"),
        ('"two"', "models.m.replicas: expected a count or a range like { min = 0, max = 4 }"),
    ],
)
def test_a_bad_range_says_which_key_and_why(replicas: str, said: str) -> None:
    text = (
        f'[models.m]\nreplicas = {replicas}\n[[models.m.profiles]]\nname = "cpu"\n'
        'engine = "llama.cpp"\nmodel_path = "/m.gguf"\n'
    )
    with pytest.raises(ConfigError) as err:
        parse_catalog(text, "catalog.toml")
    assert said in str(err.value), str(err.value)
    assert str(err.value).startswith("catalog.toml: ")


def test_a_range_on_static_endpoints_is_refused() -> None:
    text = '[models.m]\nreplicas = { max = 2 }\nstatic_endpoints = ["http://127.0.0.1:1"]\n'
    with pytest.raises(ConfigError, match="a range is for a placed model"):
        parse_catalog(text, "catalog.toml")


def test_a_fixed_count_is_untouched_and_a_range_follows_its_load() -> None:
    c = catalog()
    s = Scaling()
    s.follow(c, {}, settled=True)
    fixed, elastic = c.models["fixed"], c.models["elastic"]
    assert s.wanted(fixed) == 2 and s.wanted(elastic) == 0
    s.observe({"elastic": ModelLoad(waiting=2)}, now=1.0, wall=1000.0)
    assert s.wanted(elastic) == 1  # a held request starts one at once
    assert str(s.said["elastic"].change) == "0 → 1: 2 requests held with no replica"
    assert s.events == {("elastic", "held"): 1}
    t = 1.0
    while t < 40:  # 9 at once for longer than UP_S: three replicas (its max)
        t += 1
        s.observe({"elastic": ModelLoad(in_flight=9)}, now=t, wall=1000 + t)
    assert s.wanted(elastic) == 3
    assert s.said["elastic"].change.kind == "up"
    while t < 200:  # nothing for its idle_s: none
        t += 1
        s.observe({}, now=t, wall=1000 + t)
    assert s.wanted(elastic) == 0
    assert s.said["elastic"].change.kind == "idle"


def test_short_requests_between_readings_keep_a_model_from_idling() -> None:
    c = catalog(min=0)
    s = Scaling()
    s.follow(c, {"elastic": 1}, settled=True)
    elastic = c.models["elastic"]
    assert s.wanted(elastic) == 1
    for t in range(1, 100):  # never in flight at a reading, one arrival every 5 s
        s.observe({"elastic": ModelLoad(arrived=1)} if t % 5 == 0 else {}, float(t), 0.0)
    assert s.wanted(elastic) == 1


def test_a_restarted_control_plane_keeps_what_came_back_until_settled() -> None:
    c = catalog(min=0)
    s = Scaling()
    s.follow(c, {}, settled=False)  # nothing back yet
    elastic = c.models["elastic"]
    assert s.wanted(elastic) == 0
    s.follow(c, {"elastic": 2}, settled=False)  # a scale-up's two came back
    assert s.wanted(elastic) == 2  # nothing placed twice, nothing drained
    s.follow(c, {"elastic": 5}, settled=False)
    assert s.wanted(elastic) == 3  # within its range
    s.follow(c, {"elastic": 0}, settled=True)
    assert s.wanted(elastic) == 3  # settled: the rule decides, with its patience


def test_a_pin_holds_until_released_and_a_catalog_change_keeps_the_count_in_range() -> None:
    c = catalog(min=0)
    s = Scaling()
    s.follow(c, {}, settled=True)
    elastic = c.models["elastic"]
    assert "pinned at 2" in s.pin("elastic", 2, now=1.0, wall=0.0)
    for t in range(2, 300):
        s.observe({}, float(t), 0.0)
    assert s.wanted(elastic) == 2  # idle, but pinned
    assert "released" in s.pin("elastic", None, now=300.0, wall=0.0)
    for t in range(301, 1000):
        s.observe({}, float(t), 0.0)
    assert s.wanted(elastic) == 0
    with pytest.raises(KeyError):
        s.pin("fixed", 1, now=0.0, wall=0.0)
    narrower = catalog(min=1)
    s.follow(narrower, {}, settled=True)
    assert s.wanted(narrower.models["elastic"]) == 1
    s.follow(parse_catalog("", "catalog.toml"), {}, settled=True)  # gone: forgotten
    assert s.demand("elastic") is None


def replica(rid: str, created: float, ready: float, *, adopted: bool = False) -> Replica:
    return Replica(
        replica_id=rid,
        model="elastic",
        profile="cpu",
        world_size=1,
        shards=[],
        state=ReplicaState.READY,
        created_at=created,
        state_since=ready,
        adopted=adopted,
    )


def test_start_times_are_measured_from_replicas_placed_here() -> None:
    c = catalog()
    s = Scaling()
    s.follow(c, {}, settled=True)
    assert s.start_times(c.models["elastic"]) == DEFAULT_START_S  # none measured
    s.saw([replica("a", 10.0, 14.0), replica("b", 0.0, 100.0, adopted=True)])
    s.saw([replica("a", 10.0, 14.0)])  # seen once
    s.saw([replica("c", 20.0, 26.0), replica("d", 30.0, 38.0)])
    assert s.start_s("elastic", ["cpu"]) == 6.0  # the median of 4, 6, 8
    assert [took for _, _, took in s.new_starts] == [4.0, 6.0, 8.0]


def test_router_loads_are_summed_over_routers_heard_from_lately() -> None:
    reports = RouterReports()
    reports.take(
        RouterReport(router="a", load={"m": ModelLoad(in_flight=2, waiting=1)}), "1.2.3.4", 0.0
    )
    reports.take(RouterReport(router="b", load={"m": ModelLoad(arrived=3)}), "1.2.3.4", 5.0)
    assert reports.loads(6.0) == {"m": ModelLoad(in_flight=2, waiting=1, arrived=3)}
    assert reports.loads(12.0) == {"m": ModelLoad(arrived=3)}  # a's said too long ago
    reports.take(RouterReport(router="b"), "1.2.3.4", 13.0)  # b has none now
    assert reports.loads(13.0) == {}
    with pytest.raises(ReportRefused, match="load must be"):
        reports.take(RouterReport(router="c", load={"m": ModelLoad(in_flight=-1)}), "", 0.0)
    assert summed([{"m": ModelLoad(in_flight=1)}, {"m": ModelLoad(waiting=2)}, {}]) == {
        "m": ModelLoad(in_flight=1, waiting=2)
    }


def test_what_routers_believe_cached_is_summed_kept_while_heard_from_and_checked() -> None:
    reports = RouterReports()
    reports.take(RouterReport(router="a", cached={"m-1": 4, "m-2": 1}), "1.2.3.4", 0.0)
    reports.take(RouterReport(router="b", cached={"m-1": 2}), "1.2.3.4", 50.0)
    assert reports.cached(60.0) == {"m-1": 6, "m-2": 1}
    assert reports.cached(100.0) == {"m-1": 2}  # a's said too long ago
    reports.take(RouterReport(router="b"), "1.2.3.4", 101.0)  # b believes none now
    assert reports.cached(101.0) == {}
    for bad in ({"m-1": -1}, {"no spaces": 1}):
        with pytest.raises(ReportRefused, match="cached must be"):
            reports.take(RouterReport(router="c", cached=bad), "", 0.0)
    assert reports.cached(101.0) == {}  # a bad report takes nothing


def test_a_range_grows_no_further_while_another_model_is_below_its_floor_for_room() -> None:
    c = catalog(min=0)
    s = Scaling()
    s.follow(c, {"fixed": 1, "elastic": 1}, settled=True)
    s.observe({"elastic": ModelLoad(waiting=0)}, 0.0, 0.0)
    for t in range(1, 40):
        s.observe({"elastic": ModelLoad(in_flight=12)}, float(t), 0.0)
    elastic = c.models["elastic"]
    assert s.demand("elastic").count == 3  # type: ignore[union-attr]
    s.room_first(c, ["fixed"])
    assert s.wanted(elastic) == 1  # what it runs: the fixed model's second goes first
    assert s.yielding["elastic"] == (
        "elastic runs 1 of the 3 its demand wants: fixed is below the minimum for want of "
        "room, and placed first"
    )
    s.follow(c, {"fixed": 2, "elastic": 1}, settled=True)
    s.room_first(c, ["fixed"])  # at its floor: a want, not a need
    assert s.wanted(elastic) == 3 and not s.yielding

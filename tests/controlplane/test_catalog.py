"""The model catalog: typed, bounded, and every error names the model, the profile and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import ConfigError
from llmgw.controlplane.catalog import Catalog, Profile, Routing, load_catalog, parse_catalog

EXAMPLE = Path(__file__).parents[2] / "packaging" / "catalog.example.toml"

FULL = """
[models.qwen-coder]
replicas = 2
[models.qwen-coder.routing]
weight = 2.5
target_waiting = 4
kv_ceiling = 0.9
[[models.qwen-coder.profiles]]
name = "h100"
engine = "vllm"
gpus = 1
min_memory_gb = 24
selector = { role = "coding" }
model_path = "/models/qwen"
weights = "Qwen2.5-Coder-14B-Instruct"
engine_args = ["--enable-prefix-caching"]
settings = { max_model_len = 8192, gpu_memory_utilization = 0.85, served_model_name = "q", x = true }
env = { X = "1" }
startup_timeout_s = 900
[[models.qwen-coder.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/models/qwen.gguf"

[models.big]
replicas = 0
[[models.big.profiles]]
name = "ray"
engine = "vllm-ray"
gpus = 8
nodes = 2

[models.embed]
static_endpoints = ["http://10.0.0.7:8000", "https://embed.example.com/v1"]
"""


def parse(text: str) -> Catalog:
    return parse_catalog(text, "catalog.toml")


def error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return str(info.value)


def test_a_full_catalog_parses_into_typed_values() -> None:
    c = parse(FULL)
    assert list(c.models) == ["qwen-coder", "big", "embed"]
    qwen = c.models["qwen-coder"]
    assert qwen.name == "qwen-coder"
    assert qwen.replicas == 2
    assert qwen.routing == Routing(weight=2.5, target_waiting=4, kv_ceiling=0.9)
    assert [p.name for p in qwen.profiles] == ["h100", "cpu"]  # the order of preference
    assert qwen.profiles[0] == Profile(
        name="h100",
        engine="vllm",
        gpus=1,
        nodes=1,
        min_memory_gb=24.0,
        selector={"role": "coding"},
        model_path="/models/qwen",
        weights="Qwen2.5-Coder-14B-Instruct",
        engine_args=["--enable-prefix-caching"],
        settings={
            "max_model_len": 8192,
            "gpu_memory_utilization": 0.85,
            "served_model_name": "q",
            "x": True,
        },
        env={"X": "1"},
        startup_timeout_s=900.0,
    )
    cpu = qwen.profiles[1]
    assert (cpu.gpus, cpu.nodes, cpu.min_memory_gb, cpu.selector) == (0, 1, None, {})
    assert cpu.startup_timeout_s == 600.0
    assert qwen.weights_name(cpu) == "qwen-coder"  # no weights name: the model's
    assert qwen.weights_name(qwen.profiles[0]) == "Qwen2.5-Coder-14B-Instruct"
    assert c.models["big"].replicas == 0  # scaled to zero is allowed
    assert c.models["big"].profiles[0].nodes == 2
    assert c.models["embed"].static_endpoints == [
        "http://10.0.0.7:8000",
        "https://embed.example.com/v1",
    ]
    assert c.models["embed"].routing == Routing()
    assert c.managed and not c.models["embed"].managed


def test_profile_lookup() -> None:
    c = parse(FULL)
    assert c.profile("qwen-coder", "cpu") is c.models["qwen-coder"].profiles[1]
    assert c.profile("qwen-coder", "a100") is None
    assert c.profile("gone", "cpu") is None


def test_the_packaged_example_is_valid(tmp_path: Path) -> None:
    c = load_catalog(EXAMPLE)
    engines = {p.engine for m in c.models.values() for p in m.profiles}
    assert engines == {"llama.cpp", "vllm", "vllm-ray"}
    assert any(m.static_endpoints for m in c.models.values())
    assert "qwen2.5-0.5b" in c.models  # a quoted name with a dot stays one name


def test_an_empty_catalog_is_valid_and_manages_nothing() -> None:
    assert parse("") == Catalog(models={}, source="catalog.toml")
    assert not parse("").managed


def test_a_router_only_catalog_does_not_need_a_control_plane() -> None:
    c = parse('[models.embed]\nstatic_endpoints = ["http://h:1"]\n')
    assert not c.managed


def test_static_endpoints_name_their_engine_for_the_router() -> None:
    """The engine behind static endpoints reaches the routes: the router reads its load
    and carries broken streams on among them."""
    from llmgw.controlplane.routing import build_snapshot

    c = parse(
        '[models.m]\nstatic_endpoints = ["http://h:1/", "http://h:2"]\nstatic_engine = "llama.cpp"\n'
    )
    routes = build_snapshot(c, [], {}).routes
    assert [(r.url, r.engine) for r in routes] == [
        ("http://h:1", "llama.cpp"),
        ("http://h:2", "llama.cpp"),
    ]
    plain = parse('[models.m]\nstatic_endpoints = ["http://h:1"]\n')
    assert [r.engine for r in build_snapshot(plain, [], {}).routes] == [""]


PROFILE = '[models.qwen-coder]\n[[models.qwen-coder.profiles]]\nname = "h100"\n'


def vllm(extra: str) -> str:
    return PROFILE + 'engine = "vllm"\ngpus = 1\n' + extra


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            PROFILE + 'engine = "vllm"\ngpus = -1\n',
            "models.qwen-coder.profiles[h100].gpus: must be at least 0, got -1",
        ),
        (
            PROFILE + 'engine = "vlm"\n',
            "models.qwen-coder.profiles[h100].engine: 'vlm' is not one of llama.cpp, vllm, "
            "vllm-ray",
        ),
        (
            '[models.m]\n[[models.m.profiles]]\nname = "cpu"\nengine = "llama.cpp"\n'
            'model_path = "/m.gguf"\nnodes = 2\n',
            "models.m.profiles[cpu].nodes: only vllm-ray runs on more than one node",
        ),
        (
            vllm("nodes = 0\n"),
            "models.qwen-coder.profiles[h100].nodes: must be at least 1, got 0",
        ),
        (
            PROFILE + 'engine = "vllm-ray"\ngpus = 1\n',
            "models.qwen-coder.profiles[h100].nodes: vllm-ray runs on at least 2 nodes",
        ),
        (
            PROFILE + 'engine = "vllm"\n',
            "models.qwen-coder.profiles[h100].gpus: vllm needs at least 1 GPU, got 0",
        ),
        (
            PROFILE + 'engine = "llama.cpp"\n',
            "models.qwen-coder.profiles[h100].model_path: llama.cpp needs model_path (a GGUF file on "
            "the node), or a source to fetch it from",
        ),
        (
            vllm("min_memory_gb = 0\n"),
            "models.qwen-coder.profiles[h100].min_memory_gb: must be greater than 0, got 0",
        ),
        (
            vllm("startup_timeout_s = 0\n"),
            "models.qwen-coder.profiles[h100].startup_timeout_s: must be greater than 0",
        ),
        (
            vllm("startup_timeout_s = 1e9\n"),
            "models.qwen-coder.profiles[h100].startup_timeout_s: must be at most 86400",
        ),
        (
            vllm('env = { CUDA_VISIBLE_DEVICES = "0" }\n'),
            "models.qwen-coder.profiles[h100].env: sets CUDA_VISIBLE_DEVICES, which comes from",
        ),
        (
            vllm('selector = { "" = "x" }\n'),
            "models.qwen-coder.profiles[h100].selector: a label name cannot be empty",
        ),
        (
            vllm('[[models.qwen-coder.profiles]]\nname = "h100"\nengine = "vllm"\ngpus = 2\n'),
            "models.qwen-coder.profiles[1].name: duplicate profile name 'h100' (also profiles[0])",
        ),
        (
            PROFILE.replace('"h100"', '""') + 'engine = "vllm"\ngpus = 1\n',
            "models.qwen-coder.profiles[0].name: must be a non-empty name without spaces",
        ),
        (
            vllm("").replace("[models.qwen-coder]\n", "[models.qwen-coder]\nreplicas = -1\n"),
            "models.qwen-coder.replicas: must be at least 0, got -1",
        ),
        (
            vllm("").replace("[models.qwen-coder]\n", "[models.qwen-coder]\nreplicas = 1001\n"),
            "models.qwen-coder.replicas: must be at most 1000, got 1001",
        ),
        (
            vllm("[models.qwen-coder.routing]\nweight = 0\n"),
            "models.qwen-coder.routing.weight: must be greater than 0, got 0",
        ),
        (
            vllm("[models.qwen-coder.routing]\ntarget_waiting = -1\n"),
            "models.qwen-coder.routing.target_waiting: must be at least 0, got -1",
        ),
        (
            vllm("[models.qwen-coder.routing]\nkv_ceiling = 1.5\n"),
            "models.qwen-coder.routing.kv_ceiling: must be in (0, 1], got 1.5",
        ),
        (
            "[models.qwen-coder]\nreplicas = 1\n",
            "models.qwen-coder: has no profiles and no static_endpoints: nothing could serve it",
        ),
        (
            '[models.e]\nstatic_endpoints = ["http://h:1"]\nstatic_engine = "sglang"\n',
            "models.e.static_engine: 'sglang' is not one of llama.cpp, vllm, vllm-ray",
        ),
        (
            '[models.x]\nstatic_engine = "vllm"\n'
            '[[models.x.profiles]]\nname = "a"\nengine = "vllm"\ngpus = 1\n',
            "models.x.static_engine: is only for a model with static_endpoints",
        ),
        (
            '[models.e]\nstatic_endpoints = ["ftp://h/x"]\n',
            "models.e.static_endpoints[0]: 'ftp://h/x' is not an http(s) URL",
        ),
        (
            '[models.e]\nstatic_endpoints = ["http://h:1", "10.0.0.7:8000"]\n',
            "models.e.static_endpoints[1]: '10.0.0.7:8000' is not an http(s) URL",
        ),
        (
            '[models.e]\nstatic_endpoints = ["http://:80/"]\n',
            "models.e.static_endpoints[0]: 'http://:80/' has no host",
        ),
        (
            '[models.e]\nstatic_endpoints = ["http://h:99999"]\n',
            "models.e.static_endpoints[0]: 'http://h:99999' is not a URL",
        ),
        (
            vllm("").replace(
                "[models.qwen-coder]\n", '[models.qwen-coder]\nstatic_endpoints = ["http://h:1"]\n'
            ),
            "models.qwen-coder.static_endpoints: a model is either placed (profiles) or routed",
        ),
        (
            '[models."has space"]\nstatic_endpoints = ["http://h:1"]\n',
            "models.has space: a model name must be 1-200 printable characters without spaces",
        ),
        # types, from msgspec, in the catalog's words
        (
            PROFILE + 'engine = "vllm"\ngpus = "1"\n',
            "models.qwen-coder.profiles[h100].gpus: expected `int`, got `str`",
        ),
        (
            PROFILE + 'engine = "vllm"\ngpus = true\n',
            "models.qwen-coder.profiles[h100].gpus: expected `int`, got `bool`",
        ),
        (
            vllm('selector = { role = "coding", tier = 2 }\n'),
            "models.qwen-coder.profiles[h100].selector.tier: expected `str`, got `int`",
        ),
        (
            vllm("settings = { a = 1, b = [1] }\n"),
            "models.qwen-coder.profiles[h100].settings.b: expected `bool | int | float | str`, "
            "got `array`",
        ),
        (
            PROFILE,
            "models.qwen-coder.profiles[h100].engine: required, but missing",
        ),
        (
            "[models.m]\n[[models.m.profiles]]\nengine = 'vllm'\n",
            "models.m.profiles[0].name: required, but missing",
        ),
        (
            "[models.m]\nprofiles = { name = 'x' }\n",
            "models.m.profiles: expected `array`, got `table`",
        ),
        (
            PROFILE + 'engine = "llama.cpp"\nsource = "ftp://h/m.gguf"\n',
            "models.qwen-coder.profiles[h100].source: ",
        ),
        (
            PROFILE + 'engine = "llama.cpp"\nsource = "hf://acme/m-GGUF"\n',
            "models.qwen-coder.profiles[h100].source: names a whole repository, and llama.cpp "
            "loads a GGUF file on the node: name the file in it, hf://acme/m-GGUF/FILE.gguf",
        ),
        (
            PROFILE + 'engine = "llama.cpp"\nmodel_path = "/m.gguf"\nsha256 = "ab"\n',
            "models.qwen-coder.profiles[h100].sha256: is for a fetched file: give a source too",
        ),
        (
            PROFILE + 'engine = "llama.cpp"\nsource = "hf://a/b/m.gguf"\nsha256 = "xyz"\n',
            "models.qwen-coder.profiles[h100].sha256: 'xyz' is not 64 hex digits",
        ),
        (
            PROFILE + 'engine = "llama.cpp"\nsource = "hf://a/b/m.gguf"\nfetch_stall_s = 0\n',
            "models.qwen-coder.profiles[h100].fetch_stall_s: must be greater than 0",
        ),
        ("models = 1\n", "models: expected a table of models, got int"),
        ("[models]\nm = 1\n", "models.m: expected a table, got int"),
    ],
)
def test_errors_name_the_model_the_profile_and_the_field(text: str, expected: str) -> None:
    message = error(text)
    assert message.startswith("catalog.toml: ")
    assert expected in message, message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("model = {}\n", "model"),
        ("[models.m]\nreplica = 1\n", "models.m.replica"),
        ("[models.m]\nname = 'm'\n", "models.m.name"),  # the name is the table's key
        (vllm("gpu = 1\n").replace("qwen-coder", "m"), "models.m.profiles[h100].gpu"),
        (vllm("[models.qwen-coder.routing]\nweigth = 1\n"), "models.qwen-coder.routing.weigth"),
        (vllm("[models.qwen-coder.routin]\nweight = 1\n"), "models.qwen-coder.routin"),
    ],
)
def test_unknown_keys_are_refused_by_name(text: str, key: str) -> None:
    assert error(text) == f"catalog.toml: {key}: unknown key (is it misspelt?)"


def test_an_unquoted_name_with_a_dot_is_explained() -> None:
    message = error('[models.qwen2.5]\nstatic_endpoints = ["http://h:1"]\n')
    assert message == (
        'catalog.toml: models.qwen2.5: unknown key (a name with a dot is quoted: [models."qwen2.5"])'
    )


def test_static_endpoints_are_kept_as_data() -> None:
    c = parse('[models.e]\nreplicas = 3\nstatic_endpoints = ["http://[::1]:8000"]\n')
    e = c.models["e"]
    assert e.static_endpoints == ["http://[::1]:8000"]
    assert e.profiles == [] and not e.managed


def test_load_catalog_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text(vllm("gpus = -1\n").replace("gpus = 1\n", ""))
    with pytest.raises(ConfigError) as info:
        load_catalog(path)
    assert str(info.value) == (
        f"{path}: models.qwen-coder.profiles[h100].gpus: must be at least 0, got -1"
    )
    assert info.value.key == "models.qwen-coder.profiles[h100].gpus"
    with pytest.raises(ConfigError, match="cannot read"):
        load_catalog(tmp_path / "missing.toml")
    path.write_text("[models\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_catalog(path)


def test_a_catalog_is_a_value() -> None:
    assert parse(FULL) == parse(FULL)
    with pytest.raises(AttributeError):
        parse(FULL).models["big"].replicas = 3  # type: ignore[misc]


TWO_PROFILES = """
[models.m]
replicas = 2
[models.m.routing]
target_waiting = 4
[[models.m.profiles]]
name = "h200"
engine = "vllm"
gpus = 1
[models.m.profiles.routing]
weight = 8.0
kv_ceiling = 0.9
[[models.m.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/models/m.gguf"
"""


def test_a_profile_weighs_its_replicas_apart_over_its_models_routing() -> None:
    from llmgw.controlplane.catalog import routing_for

    model = parse(TWO_PROFILES).models["m"]
    assert routing_for(model, "h200") == Routing(weight=8.0, target_waiting=4, kv_ceiling=0.9)
    assert routing_for(model, "cpu") == Routing(weight=1.0, target_waiting=4)
    with pytest.raises(
        ConfigError,
        match=r"models\.m\.profiles\[h200\]\.routing\.kv_ceiling: must be in \(0, 1\], got 2",
    ):
        parse(TWO_PROFILES.replace("kv_ceiling = 0.9", "kv_ceiling = 2.0"))
    with pytest.raises(
        ConfigError, match=r"models\.m\.profiles\[h200\]\.routing\.weight: must be greater than 0"
    ):
        parse(TWO_PROFILES.replace("weight = 8.0", "weight = 0.0"))


def test_affinity_and_its_load_bound_by_model_and_by_profile() -> None:
    from llmgw.controlplane.catalog import routing_for

    text = TWO_PROFILES.replace(
        "target_waiting = 4\n", 'target_waiting = 4\naffinity = "session"\n'
    )
    text = text.replace("weight = 8.0\n", 'weight = 8.0\naffinity = "off"\naffinity_bound = 2.0\n')
    model = parse(text).models["m"]
    assert (routing_for(model, "h200").affinity, routing_for(model, "h200").affinity_bound) == (
        "off",
        2.0,
    )
    assert (routing_for(model, "cpu").affinity, routing_for(model, "cpu").affinity_bound) == (
        "session",
        1.5,
    )
    assert parse(TWO_PROFILES).models["m"].routing.affinity == "prefix"  # the default
    with pytest.raises(
        ConfigError,
        match=r"models\.m\.routing\.affinity: 'sticky' is not one of off, prefix, session",
    ):
        parse(text.replace('affinity = "session"', 'affinity = "sticky"'))
    with pytest.raises(
        ConfigError,
        match=r"models\.m\.profiles\[h200\]\.routing\.affinity_bound: must be at least 1, got 0.5",
    ):
        parse(text.replace("affinity_bound = 2.0", "affinity_bound = 0.5"))


def test_a_source_stands_in_for_a_model_path() -> None:
    """A llama.cpp profile with a source and no model_path is whole: its nodes fetch
    the file, and its weights are known by the source, written one way."""
    text = PROFILE + 'engine = "llama.cpp"\nsource = "hf://acme/m-GGUF@main/m.gguf"\n'
    catalog = parse_catalog(text, "catalog.toml")
    model = catalog.models["qwen-coder"]
    (p,) = model.profiles
    assert model.weights_source(p) == "hf://acme/m-GGUF/m.gguf"
    assert model.weights_path(p) == ""
    repo = PROFILE + 'engine = "vllm"\ngpus = 1\nsource = "hf://acme/m@v1"\n'
    model = parse_catalog(repo, "catalog.toml").models["qwen-coder"]
    assert model.weights_source(model.profiles[0]) == "hf://acme/m@v1"  # a folder, for vLLM
    mounted = PROFILE + 'engine = "llama.cpp"\nsource = "/mnt/models/m.gguf"\n'
    model = parse_catalog(mounted, "catalog.toml").models["qwen-coder"]
    assert model.weights_source(model.profiles[0]) == ""  # read where it is, never fetched
    assert model.weights_path(model.profiles[0]) == "/mnt/models/m.gguf"

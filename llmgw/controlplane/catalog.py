"""The model catalog: which models to run, how many replicas, and how to run them.

A TOML file, one table per model::

    [models.qwen-coder]
    replicas = 2                       # or a range: { min = 0, max = 4 } (``Scaling``)
    [[models.qwen-coder.profiles]]     # one or more, in order of preference
    name = "h100"
    engine = "vllm"
    gpus = 1

(``packaging/catalog.example.toml`` is the commented reference.) A model that
sets ``static_endpoints`` instead of profiles is router-only: nothing is
placed for it, the router sends its traffic to those URLs.

Types are checked by msgspec (unknown keys refused, as in every config file);
every rule about values is in :func:`validate`, written once, and each error
names the model, the profile and the field: ``catalog.toml:
models.qwen-coder.profiles[h100].gpus: must be at least 0, got -1``.
"""

from __future__ import annotations

import math
import posixpath
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from llmgw.config.errors import ConfigError
from llmgw.config.loader import parse_toml, read_text
from llmgw.engines import adapter, adapters
from llmgw.weights.source import HubRepo, parse_source

MAX_REPLICAS = 1000
MAX_STARTUP_TIMEOUT_S = 86_400.0
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
MAX_STOP_GRACE_S = 3600.0  # as [engines] stop_grace_s
MAX_SLEEP_S = 7 * 86400.0  # a profile's sleep_s: a week
# A catalog is a few KiB; 4 MiB is some 20,000 models, parsed in about a second (off the
# event loop, on a reload). A larger file is refused before it is read.
MAX_CATALOG_BYTES = 4 << 20

SettingValue = str | int | float | bool
# how the router steers a model's requests to what its replicas hold (llmgw.router.affinity)
Affinity = Literal["off", "prefix", "session"]


class _Entry(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class Routing(_Entry, frozen=True):
    """How the router weighs this model's replicas (read by the router, not placement)."""

    # a replica's share of its model's traffic (> 0), against the model's other replicas;
    # it tells replicas apart only when set per profile (a profile's ``routing``)
    weight: float = 1.0
    target_waiting: int | None = None  # queued requests per replica worth routing away from
    kv_ceiling: float | None = None  # KV-cache usage in (0, 1] past which a replica is avoided
    # to the replica holding the most of the prompt, within a load bound ("prefix"), by
    # the client's session hint alone ("session"), or by load alone ("off")
    affinity: Affinity = "prefix"
    # a replica takes a request for what it holds while its load stays within this many
    # times its share of the model's (at least 1; higher: more cache hits, less balance)
    affinity_bound: float = 1.5


class ProfileRouting(_Entry, frozen=True):
    """A profile's own routing settings, over its model's (``ctl bench --write`` sets
    them): replicas on different hardware take different shares and queues."""

    weight: float | None = None  # this profile's replicas' share (> 0); unset: the model's
    target_waiting: int | None = None  # queued requests worth routing away from; unset: the model's
    kv_ceiling: float | None = None  # KV-cache usage in (0, 1] to avoid; unset: the model's
    affinity: Affinity | None = None  # off, prefix or session; unset: the model's
    affinity_bound: float | None = None  # at least 1; unset: the model's


class Profile(_Entry, frozen=True):
    """One way to run a model: an engine, its resources, and what the engine is given."""

    name: str  # the profile's name, unique within the model (ctl and logs say it)
    engine: str  # an engine adapter's name (llmgw.engines): llama.cpp, vllm or vllm-ray
    gpus: int = 0  # per shard, i.e. per node
    nodes: int = 1  # shards per replica; more than one only for a multi-node engine
    # GiB of node memory one replica needs on each node (placement subtracts what the
    # replicas there need); unset: llama.cpp's is estimated, other engines' not counted
    min_memory_gb: float | None = None
    selector: dict[str, str] = {}  # node labels that must all match
    model_path: str = ""  # on the node; empty: the engine resolves the model by name
    # where the weights come from when a node lacks them (hf://ORG/REPO/FILE,
    # hf://ORG/REPO@REVISION/FILE, hf://ORG/REPO[@REVISION] for a whole repository's
    # folder (vLLM), https://HOST/PATH, or /PATH on a shared mount): the
    # agent fetches them before the engine starts, into its [weights] default_dir, or
    # to model_path when both are given. Empty: they must be on the node already
    source: str = ""
    sha256: str = ""  # what the fetched file's sha256 must be; empty: the hub's, if it says
    # a fetch with no byte arriving this long fails (the startup timeout counts from
    # when the weights are whole, not while they are fetched)
    fetch_stall_s: float = 120.0
    weights: str = ""  # name to look for in nodes' discovered weights; empty: the model's name
    engine_args: list[str] = []  # passed to the engine as they are, after llmgw's own
    # what the engine adapter turns into arguments (llama.cpp: context, parallel, threads,
    # ...); one it does not know is a warning at start and on reload
    settings: dict[str, SettingValue] = {}
    env: dict[str, str] = {}  # added to the engine's clean environment
    startup_timeout_s: float = 600.0  # placed to Ready; past it (plus a margin) it is failed
    # SIGTERM to SIGKILL when its engines are stopped; unset: each agent's [engines]
    # stop_grace_s. Given to engines as they are placed: changing it restarts nothing
    stop_grace_s: float | None = None
    # over the model's routing, for this profile's replicas; changing it restarts nothing
    routing: ProfileRouting | None = None
    # a replica its model's demand lets go sleeps this long before it stops: its engine
    # keeps its process and frees its GPUs' memory, and a rise wakes it in seconds
    # instead of loading it again (vLLM's sleep mode: its engines start with
    # --enable-sleep-mode; turning it on or off restarts them). 0: it stops at once
    sleep_s: float = 0.0


class Scaling(_Entry, kw_only=True, frozen=True):
    """A range of replicas that follows demand (``llmgw.controlplane.scaling``):
    ``replicas = { min = 0, max = 4 }`` instead of a count."""

    min: int = 0  # never fewer; 0: none at all after idle_s without a request
    max: int  # never more
    # requests at once (in flight or waiting) one replica should carry; unset: its first
    # profile's routing weight where ``ctl bench --write`` recorded it, else 4
    target: float | None = None
    idle_s: float = 600.0  # a model of min 0 with no request this long: no replica


DEFAULT_TARGET = 4.0  # a replica's load when nothing says better (llama.cpp's 4 slots)


class _ModelEntry(_Entry, frozen=True):
    """A model's table as written (its name is the table's key)."""

    # how many copies to keep running, or a range that follows demand
    replicas: int | Scaling = 1
    routing: Routing = msgspec.field(default_factory=Routing)
    profiles: list[Profile] = []  # ways to run it, in order of preference
    # base URLs the router sends this model's traffic to; nothing is placed for it
    static_endpoints: list[str] = []
    # the engine behind them (llama.cpp, vllm): the router reads its load and progress,
    # and carries a broken stream on from another of them; empty: not known
    static_engine: str = ""


class Model(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    # the count to run; for a range (``scaling``), its ``min``: what it starts with before
    # demand says more (``llmgw.controlplane.scaling`` says how many it wants now)
    replicas: int = 1
    scaling: Scaling | None = None
    profiles: list[Profile] = []
    routing: Routing = msgspec.field(default_factory=Routing)
    static_endpoints: list[str] = []  # router-only: fixed URLs, nothing is placed
    static_engine: str = ""  # the engine behind them; "": not known

    @property
    def managed(self) -> bool:
        """Whether the control plane places replicas of it (it has profiles)."""
        return bool(self.profiles)

    def profile(self, name: str) -> Profile | None:
        for p in self.profiles:
            if p.name == name:
                return p
        return None

    def weights_name(self, profile: Profile) -> str:
        """The name matched against nodes' discovered weights for this profile."""
        return profile.weights or self.name

    def weights_path(self, profile: Profile) -> str:
        """The profile's model_path as matched against the paths of nodes' discovered
        weights (normalised; "" when it has none): a copy found at exactly the path
        its engine is given holds its weights, whatever discovery named it. A source
        on a shared mount is its path."""
        path = profile.model_path or (profile.source if profile.source.startswith("/") else "")
        return posixpath.normpath(path) if path else ""

    def weights_source(self, profile: Profile) -> str:
        """The source a node's fetched copy names (``WeightCopy.source``), written one
        way; "" when the profile fetches nothing (no source, or one on a mount)."""
        if not profile.source or profile.source.startswith("/"):
            return ""
        return str(parse_source(profile.source))


class Catalog(msgspec.Struct, kw_only=True, frozen=True):
    models: dict[str, Model] = {}
    source: str = ""

    def profile(self, model: str, profile_name: str) -> Profile | None:
        """The named profile of a model; None when either left the catalog."""
        m = self.models.get(model)
        return None if m is None else m.profile(profile_name)

    @property
    def managed(self) -> bool:
        """Whether any model declares a profile (the server then runs a control plane)."""
        return any(m.profiles for m in self.models.values())


# --- loading ------------------------------------------------------------------


def load_catalog(path: str | Path) -> Catalog:
    """Read, type-check and validate a catalog file (at most ``MAX_CATALOG_BYTES``).

    This blocks for as long as parsing takes (about a second at the bound): a
    running server calls it from a worker thread.

    Raises:
        ConfigError: naming the file, the key (``models.NAME.profiles[PROFILE].FIELD``)
            and the problem.
    """
    return parse_catalog(read_text(Path(path), max_bytes=MAX_CATALOG_BYTES), str(path))


def parse_catalog(text: str, source: str) -> Catalog:
    """Like :func:`load_catalog`, for text already read; ``source`` names it in errors."""
    raw = parse_toml(text, source)
    for key in raw:
        if key != "models":
            raise ConfigError(source, key, "unknown key (is it misspelt?)")
    tables = raw.get("models", {})
    if not isinstance(tables, dict):
        raise ConfigError(
            source, "models", f"expected a table of models, got {_kind(tables, toml=True)}"
        )
    models: dict[str, Model] = {}
    for name, entry in tables.items():
        key = f"models.{name}"
        if not isinstance(entry, dict):
            raise ConfigError(source, key, f"expected a table, got {_kind(entry, toml=True)}")
        try:
            typed = msgspec.convert(entry, _ModelEntry, strict=True)
        except msgspec.ValidationError as exc:
            where, problem = _explain(str(exc), entry)
            dotted = where.removeprefix(".")
            inner = entry.get(dotted)
            if (
                problem.startswith("unknown key")
                and isinstance(inner, dict)
                and inner.keys() & _ModelEntry.__struct_fields__
            ):  # [models.qwen2.5] is models -> qwen2 -> 5
                problem = f'unknown key (a name with a dot is quoted: [models."{name}.{dotted}"])'
            raise ConfigError(source, key + where, problem) from None
        ranged, count = (
            (typed.replicas, typed.replicas.min)
            if isinstance(typed.replicas, Scaling)
            else (None, typed.replicas)
        )
        models[name] = Model(
            name=name,
            replicas=count,
            scaling=ranged,
            profiles=typed.profiles,
            routing=typed.routing,
            static_endpoints=typed.static_endpoints,
            static_engine=typed.static_engine,
        )
    catalog = Catalog(models=models, source=source)
    try:
        validate(catalog)
    except ConfigError as exc:
        raise ConfigError(source, exc.key, exc.problem) from None
    return catalog


# --- validation: every rule about values, in one place ---------------------------


def validate(catalog: Catalog) -> None:
    """Raise ConfigError (source left empty) for the first rule a value breaks."""
    for name, model in catalog.models.items():
        _validate_model(name, model)


def _check_scaling(key: str, model: Model) -> None:
    r = model.scaling
    assert r is not None
    _at_least(f"{key}.min", r.min, 0)
    if r.max < max(1, r.min) or r.max > MAX_REPLICAS:
        raise ConfigError(
            "",
            f"{key}.max",
            f"must be at least 1 and min ({r.min}), at most {MAX_REPLICAS}, got {r.max}",
        )
    if r.target is not None and not (math.isfinite(r.target) and r.target > 0):
        raise ConfigError("", f"{key}.target", f"must be greater than 0, got {r.target}")
    if not (math.isfinite(r.idle_s) and r.idle_s >= 1):
        raise ConfigError("", f"{key}.idle_s", f"must be at least 1 second, got {r.idle_s}")
    if model.static_endpoints:
        raise ConfigError(
            "", key, "a range is for a placed model (profiles); static endpoints are not started"
        )


def scaling_target(model: Model) -> float:
    """The load one replica of a ranged model should carry: its own ``target``, else its
    first profile's routing weight where one was written (``ctl bench --write`` writes
    the concurrency at which the replica still met its SLO), else ``DEFAULT_TARGET``."""
    r = model.scaling
    if r is not None and r.target is not None:
        return r.target
    for p in model.profiles[:1]:
        if p.routing is not None and p.routing.weight is not None:
            return p.routing.weight
    return DEFAULT_TARGET


def _check_routing(key: str, r: Routing | ProfileRouting) -> None:
    if r.weight is not None and not (math.isfinite(r.weight) and r.weight > 0):
        raise ConfigError("", f"{key}.weight", f"must be greater than 0, got {r.weight}")
    if r.target_waiting is not None:
        _at_least(f"{key}.target_waiting", r.target_waiting, 0)
    if r.kv_ceiling is not None and not 0 < r.kv_ceiling <= 1:
        raise ConfigError("", f"{key}.kv_ceiling", f"must be in (0, 1], got {r.kv_ceiling}")
    bound = r.affinity_bound
    if bound is not None and not (math.isfinite(bound) and bound >= 1):
        raise ConfigError("", f"{key}.affinity_bound", f"must be at least 1, got {bound}")


def routing_for(model: Model, profile: str) -> Routing:
    """The routing settings of ``model``'s replicas of ``profile``: the profile's own,
    then the model's."""
    p = model.profile(profile)
    own = p.routing if p is not None else None
    if own is None:
        return model.routing
    r = model.routing
    return Routing(
        weight=own.weight if own.weight is not None else r.weight,
        target_waiting=own.target_waiting if own.target_waiting is not None else r.target_waiting,
        kv_ceiling=own.kv_ceiling if own.kv_ceiling is not None else r.kv_ceiling,
        affinity=own.affinity if own.affinity is not None else r.affinity,
        affinity_bound=own.affinity_bound if own.affinity_bound is not None else r.affinity_bound,
    )


def _validate_model(name: str, model: Model) -> None:
    key = f"models.{name}"
    if not name or len(name) > 200 or any(c.isspace() or not c.isprintable() for c in name):
        raise ConfigError("", key, "a model name must be 1-200 printable characters without spaces")
    if model.scaling is not None:
        _check_scaling(f"{key}.replicas", model)
    _at_least(f"{key}.replicas", model.replicas, 0)
    if model.replicas > MAX_REPLICAS:
        raise ConfigError(
            "", f"{key}.replicas", f"must be at most {MAX_REPLICAS}, got {model.replicas}"
        )
    _check_routing(f"{key}.routing", model.routing)
    for p in model.profiles:
        if p.routing is not None:
            _check_routing(f"{key}.profiles[{p.name}].routing", p.routing)
    if not model.profiles and not model.static_endpoints:
        raise ConfigError(
            "", key, "has no profiles and no static_endpoints: nothing could serve it"
        )
    if model.profiles and model.static_endpoints:
        raise ConfigError(
            "",
            f"{key}.static_endpoints",
            "a model is either placed (profiles) or routed to fixed endpoints, not both",
        )
    if model.static_engine and not model.static_endpoints:
        raise ConfigError("", f"{key}.static_engine", "is only for a model with static_endpoints")
    if model.static_engine and adapter(model.static_engine) is None:
        raise ConfigError(
            "",
            f"{key}.static_engine",
            f"{model.static_engine!r} is not one of {', '.join(adapters())}",
        )
    for i, url in enumerate(model.static_endpoints):
        problem = _url_problem(url)
        if problem:
            raise ConfigError("", f"{key}.static_endpoints[{i}]", problem)
    seen: dict[str, int] = {}
    for i, profile in enumerate(model.profiles):
        if profile.name in seen:
            raise ConfigError(
                "",
                f"{key}.profiles[{i}].name",
                f"duplicate profile name {profile.name!r} (also profiles[{seen[profile.name]}])",
            )
        seen[profile.name] = i
        _validate_profile(f"{key}.profiles[{profile.name or i}]", profile)


def _validate_profile(key: str, p: Profile) -> None:
    if not p.name or any(c.isspace() or not c.isprintable() for c in p.name):
        raise ConfigError("", f"{key}.name", "must be a non-empty name without spaces")
    engine = adapter(p.engine)
    if engine is None:
        raise ConfigError(
            "", f"{key}.engine", f"{p.engine!r} is not one of {', '.join(adapters())}"
        )
    needs = engine.requires
    _at_least(f"{key}.gpus", p.gpus, 0)
    if needs.gpu and p.gpus < 1:
        raise ConfigError("", f"{key}.gpus", f"{p.engine} needs at least 1 GPU, got {p.gpus}")
    _at_least(f"{key}.nodes", p.nodes, 1)
    if p.nodes > 1 and not needs.multi_node:
        multi = [a.name for a in adapters().values() if a.requires.multi_node]
        runs = "runs" if len(multi) == 1 else "run"
        raise ConfigError(
            "", f"{key}.nodes", f"only {', '.join(multi)} {runs} on more than one node"
        )
    if p.nodes < 2 and needs.multi_node:
        use = f" (use {needs.one_node} for one node)" if needs.one_node else ""
        raise ConfigError("", f"{key}.nodes", f"{p.engine} runs on at least 2 nodes{use}")
    if p.min_memory_gb is not None and not (math.isfinite(p.min_memory_gb) and p.min_memory_gb > 0):
        raise ConfigError(
            "", f"{key}.min_memory_gb", f"must be greater than 0, got {p.min_memory_gb}"
        )
    for label in p.selector:
        if not label:
            raise ConfigError("", f"{key}.selector", "a label name cannot be empty")
    if needs.model_file and not (p.model_path or p.source):
        raise ConfigError(
            "",
            f"{key}.model_path",
            f"{p.engine} needs model_path ({needs.model_file}), or a source to fetch it from",
        )
    _check_source(key, p, needs.model_file)
    for var in p.env:
        if not var or "=" in var or "\0" in var:
            raise ConfigError("", f"{key}.env", f"{var!r} is not an environment variable name")
        if var == "CUDA_VISIBLE_DEVICES":
            raise ConfigError(
                "", f"{key}.env", "sets CUDA_VISIBLE_DEVICES, which comes from the shard's GPUs"
            )
    if not (math.isfinite(p.startup_timeout_s) and p.startup_timeout_s > 0):
        raise ConfigError(
            "", f"{key}.startup_timeout_s", f"must be greater than 0, got {p.startup_timeout_s}"
        )
    if p.startup_timeout_s > MAX_STARTUP_TIMEOUT_S:
        raise ConfigError(
            "",
            f"{key}.startup_timeout_s",
            f"must be at most {MAX_STARTUP_TIMEOUT_S:g}, got {p.startup_timeout_s:g}",
        )
    if not (math.isfinite(p.sleep_s) and 0 <= p.sleep_s <= MAX_SLEEP_S):
        raise ConfigError(
            "", f"{key}.sleep_s", f"must be between 0 and {MAX_SLEEP_S:g}, got {p.sleep_s:g}"
        )
    if p.sleep_s and not engine.sleeps:
        can = [a.name for a in adapters().values() if a.sleeps]
        raise ConfigError(
            "",
            f"{key}.sleep_s",
            f"{p.engine} cannot sleep (only {', '.join(can) or 'no engine'} can); "
            "remove sleep_s, or set it to 0",
        )
    grace = p.stop_grace_s
    if grace is not None and not (math.isfinite(grace) and 0 < grace <= MAX_STOP_GRACE_S):
        raise ConfigError(
            "",
            f"{key}.stop_grace_s",
            f"must be greater than 0 and at most {MAX_STOP_GRACE_S:g}, got {grace:g}",
        )


def _check_source(key: str, p: Profile, model_file: str) -> None:
    """``model_file``: what the engine loads, when it must be one file."""
    if p.source:
        try:
            source = parse_source(p.source)
        except ValueError as exc:
            raise ConfigError("", f"{key}.source", str(exc)) from None
        if model_file and isinstance(source, HubRepo):
            raise ConfigError(
                "",
                f"{key}.source",
                f"names a whole repository, and {p.engine} loads {model_file}: name the "
                f"file in it, {p.source}/FILE.gguf",
            )
    elif p.sha256:
        raise ConfigError("", f"{key}.sha256", "is for a fetched file: give a source too")
    if p.sha256 and not _SHA256.fullmatch(p.sha256):
        raise ConfigError(
            "", f"{key}.sha256", f"{p.sha256!r} is not 64 hex digits (as sha256sum prints one)"
        )
    if not (math.isfinite(p.fetch_stall_s) and 0 < p.fetch_stall_s <= MAX_STARTUP_TIMEOUT_S):
        raise ConfigError(
            "",
            f"{key}.fetch_stall_s",
            f"must be greater than 0 and at most {MAX_STARTUP_TIMEOUT_S:g}, got {p.fetch_stall_s:g}",
        )


def _at_least(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError("", key, f"must be at least {minimum}, got {value}")


def _url_problem(url: str) -> str:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        return f"{url!r} is not a URL: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"{url!r} is not an http(s) URL"
    if not parts.hostname:
        return f"{url!r} has no host"
    return ""


# --- msgspec's errors, in the catalog's words --------------------------------------

_AT = re.compile(r"\s*-\s*at\s*`\$(?P<path>[^`]*)`\s*$")
_SEGMENT = re.compile(r"\.(?P<field>[^.\[]+)|\[(?P<index>\d+|\.\.\.)\]")
_GOT = re.compile(r"got `(?P<got>[^`]+)`")


def _explain(message: str, raw: dict[str, Any]) -> tuple[str, str]:
    """msgspec's "Expected `int`, got `str` - at `$.profiles[0].gpus`", for one model's
    table -> (".profiles[h100].gpus", "expected `int`, got `str`")."""
    m = _AT.search(message)
    path, problem = ("", message) if m is None else (m.group("path"), message[: m.start()])
    where = ""
    node: Any = raw
    parent = ""
    for seg in _SEGMENT.finditer(path):
        if seg.group("field") is not None:
            parent = seg.group("field")
            where += f".{parent}"
            node = node.get(parent) if isinstance(node, dict) else None
            continue
        index = seg.group("index")
        if index == "...":  # a value in a table: find which one, by the type msgspec got
            got = _GOT.search(problem)
            key = next(
                (
                    k
                    for k, v in (node.items() if isinstance(node, dict) else ())
                    if got is not None and _kind(v) == got.group("got")
                ),
                None,
            )
            where += "" if key is None else f".{key}"
            node = None if key is None else node[key]
            continue
        i = int(index)
        node = node[i] if isinstance(node, list) and i < len(node) else None
        label: str | int = i
        if parent == "profiles" and isinstance(node, dict):
            name = node.get("name")
            if isinstance(name, str) and name:
                label = name
        where += f"[{label}]"
    unknown = re.match(r"Object contains unknown field `([^`]*)`", problem)
    if unknown:
        return f"{where}.{unknown.group(1)}", "unknown key (is it misspelt?)"
    missing = re.match(r"Object missing required field `([^`]*)`", problem)
    if missing:
        return f"{where}.{missing.group(1)}", "required, but missing"
    if where.endswith(".affinity") and problem.startswith("Invalid enum value"):
        return where, f"{problem[len('Invalid enum value ') :]} is not one of off, prefix, session"
    if where == ".replicas" and problem.startswith("Expected `int | object`"):
        kind = problem.rpartition(", got ")[2]
        return where, f"expected a count or a range like {{ min = 0, max = 4 }}, got {kind}"
    problem = problem.replace("Expected", "expected", 1).replace("`object`", "`table`")
    return where, problem


def _kind(value: object, *, toml: bool = False) -> str:
    """A TOML value's type in msgspec's words (as in "got `array`"), or in TOML's."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table" if toml else "object"
    return type(value).__name__

"""What the control plane tells routers: the routing snapshot, as a value.

The control plane builds a ``Snapshot`` once per change of the fleet and
publishes it; routers only consume it, in process or over the admin API's
``GET /v1/routing`` watch. Both sides import this module and nothing of each
other. A snapshot's ``version`` is a hash of its content, so two control
planes (or one restarted) that see the same fleet give the same version, and
a router that already holds it is not woken for nothing.

A standalone router reports to the control plane apart from following it: a
``RouterReport`` (where its metrics are, what it holds wedged) posted to
``REPORT_PATH`` on a timer of its own and whenever what it holds wedged
changes, every report saying everything again. Routers older than the report
said the same as query parameters of their ``GET /v1/routing`` poll.

A control plane that has just started knows only the nodes that have come
back to it. Until it has been up for its lost-node timeout (or its settle
time, if longer), a node it has not heard from may still come back with
engines that serve, so its snapshot is not ``settled`` and says which nodes
it has ``heard`` from: a router keeps the routes it holds to any other node
(``carried``) rather than take their absence for news. A route goes once the
control plane has a reason: the node came back without it, or the timeout is
over (the node is then Lost).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping

import msgspec


class Route(msgspec.Struct, kw_only=True):
    key: str  # replica id, or the static URL
    model: str
    url: str
    engine: str = ""  # "" for static endpoints: no metrics to scrape
    weight: float = 1.0
    # its profile's own admission thresholds; None: its model's (``Snapshot.models``)
    target_waiting: float | None = None
    kv_ceiling: float | None = None
    ready: bool = True
    draining: bool = False
    # the engine's own key (``Authorization: Bearer``), "" for none; a secret: the
    # snapshot goes only to routers, never to an operator's screen
    engine_key: str = ""
    # the node its engine runs on (the head shard's); "" for a static endpoint
    node: str = ""
    # learned from its node's report and not probed yet (not ready): no news to a router
    # that already routes to it there, which keeps it as it was (``kept_ready``)
    verifying: bool = False
    # how requests are steered to what it holds: "prefix", "session" or "off"; and how
    # far past its share of the load it still takes what it holds
    affinity: str = "prefix"
    affinity_bound: float = 1.5
    # tokens of prompts it can keep (KV cache and prompt cache); None: not known
    cache_tokens: int | None = None


def kept_ready(route: Route, url: str, engine_key: str, ready: bool) -> bool:
    """Whether a router that holds a route (at ``url``, with ``engine_key``, ``ready`` or
    not) takes it as ready now: as ``route`` says, except that a replica being checked
    after its node reported it (a restarted control plane adopting what serves) stays
    as it was where it is the same engine; one the router never routed to waits."""
    if route.verifying and route.url == url and route.engine_key == engine_key:
        return ready
    return route.ready


KEY_PREFIX = "llmgw-"


def hash_key(key: str) -> str:
    """An API key as it is kept and compared: its SHA-256 (keys are long and random)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class Limits(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a tenant, or one of its keys, may use; None: no such limit."""

    rpm: int | None = None  # requests begun per minute (a sliding minute)
    tpm: int | None = None  # tokens (prompt and completion) per minute
    in_flight: int | None = None  # requests at once
    # tokens (prompt and completion) per calendar day, per calendar month (UTC)
    budget_day: int | None = None
    budget_month: int | None = None


LIMIT_NAMES = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "in_flight": "requests in flight",
    "budget_day": "tokens a day",
    "budget_month": "tokens a month",
}
BUDGETS = ("budget_day", "budget_month")


class RouterKey(msgspec.Struct, kw_only=True):
    """An API key as the control plane knows it: its hash, never the key."""

    name: str
    sha256: str
    models: list[str] = []  # empty: every model
    # the tenant it belongs to ("": a key of the server's config, no tenant's); when it
    # stops working (unix time; None: never); limits of its own, within its tenant's
    tenant: str = ""
    expires: float | None = None
    limits: Limits | None = None


class TenantRouting(msgspec.Struct, kw_only=True):
    """A tenant as routers need it: its limits, shared by all its keys."""

    name: str
    limits: Limits = msgspec.field(default_factory=Limits)
    weight: float = 1.0  # its turn in a full model's queue against others' (``fair``)


class ModelRouting(msgspec.Struct, kw_only=True):
    target_waiting: float | None = None
    kv_ceiling: float | None = None
    # the model follows demand (a range of replicas): a request that finds no replica
    # is held until one starts, and its load is reported; ``start_s``: how long a start
    # takes, as measured (a refused hold's Retry-After)
    scales: bool = False
    start_s: float = 0.0


class Snapshot(msgspec.Struct, kw_only=True):
    version: str = ""
    models: dict[str, ModelRouting] = {}  # every model the catalog knows
    routes: list[Route] = []
    # False while the control plane that built it has been up for less than its
    # lost-node timeout (or settle time, if longer): a node not in ``heard`` may still
    # come back with what it runs
    # (True from a control plane that does not say: routes absent are gone)
    settled: bool = True
    # the nodes that have registered with that control plane since it started, while
    # it is not settled (empty once it is)
    heard: list[str] = []
    # the API keys of the control plane's config ([[router.keys]]), which standalone
    # routers accept besides their own; empty from one that lists none (or is older)
    keys: list[RouterKey] = []
    # its tenants' keys, and the tenants with their limits: apart from ``keys``, so
    # that a router older than tenants, which would take them for plain keys (no
    # limits, no expiry), knows nothing of them and refuses them
    tenant_keys: list[RouterKey] = []
    tenants: list[TenantRouting] = []


def versioned(
    models: dict[str, ModelRouting],
    routes: list[Route],
    *,
    settled: bool = True,
    heard: Iterable[str] = (),
    keys: Iterable[RouterKey] = (),
    tenant_keys: Iterable[RouterKey] = (),
    tenants: Iterable[TenantRouting] = (),
) -> Snapshot:
    """A snapshot whose version is the hash of what it says (routes in key order)."""
    snap = Snapshot(
        models=models,
        routes=sorted(routes, key=lambda r: r.key),
        settled=settled,
        heard=[] if settled else sorted(heard),
        keys=sorted(keys, key=lambda k: (k.name, k.sha256)),
        tenant_keys=sorted(tenant_keys, key=lambda k: (k.name, k.sha256)),
        tenants=sorted(tenants, key=lambda t: t.name),
    )
    snap.version = hashlib.sha256(msgspec.json.encode(snap)).hexdigest()[:16]
    return snap


def carried(snap: Snapshot, held: Iterable[tuple[str, str, str]]) -> set[str]:
    """Which of the routes a router holds, ``(key, model, node)`` each, it keeps though
    ``snap`` lists them not: those on a node the control plane has not heard from since
    it started, while it is not settled, of a model it still knows."""
    if snap.settled:
        return set()
    listed = {r.key for r in snap.routes}
    heard = set(snap.heard)
    return {
        key
        for key, model, node in held
        if key not in listed and node and node not in heard and model in snap.models
    }


REPORT_PATH = "/v1/routing/report"


class RouterReport(msgspec.Struct, kw_only=True, frozen=True):
    """What a standalone router tells the control plane (``POST REPORT_PATH``, JSON)."""

    # its own id, random per process (each worker of a router is a router of its own);
    # what it holds wedged is kept under it
    router: str
    # "host:port" of its metrics listener, for the control plane's service discovery;
    # "" for none; a wildcard host stands for the address the report came from
    metrics: str = ""
    # the replicas it holds wedged now (work in flight, no progress); empty: none
    wedged: list[str] = []
    # what tenants' keys used through it since it started (counts that only grow: the
    # control plane adds what grew since its last report)
    usage: list[UsageRow] = []
    # each model's requests at it now, for the models that scale on demand (empty: none)
    load: dict[str, ModelLoad] = {}
    # the prompt blocks it believes each replica of a model that scales holds (its
    # affinity index): a scale-down lets the one with the least go. Empty: none
    cached: dict[str, int] = {}
    # each model's requests through it since it started (``ModelCounters``); empty: none
    traffic: dict[str, ModelCounters] = {}


class ModelCounters(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model's requests through one router since it started: counts that only grow
    (the control plane keeps the last hour of what grew, for the web console)."""

    requests: int = 0  # answered, any status
    errors: int = 0  # answered with a 5xx
    tokens: int = 0  # completion tokens of successful responses
    # time to first token of streamed responses: the histogram's bucket bounds
    # (seconds) and the count at or below each, cumulative
    ttft_le: list[float] = []
    ttft_counts: list[int] = []


class ModelLoad(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model's requests at one router now: in flight at its replicas, and waiting
    (queued for room, or held while the model has no replica); and how many arrived
    since it last said (short requests between two readings still count as use)."""

    in_flight: int = 0
    waiting: int = 0
    arrived: int = 0


def summed(loads: Iterable[Mapping[str, ModelLoad]]) -> dict[str, ModelLoad]:
    """Each model's load over several routers."""
    out: dict[str, ModelLoad] = {}
    for said in loads:
        for model, load in said.items():
            have = out.get(model)
            out[model] = (
                load
                if have is None
                else ModelLoad(
                    in_flight=have.in_flight + load.in_flight,
                    waiting=have.waiting + load.waiting,
                    arrived=have.arrived + load.arrived,
                )
            )
    return out


class UsageRow(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one tenant's keys used of one model: requests answered, tokens, and requests
    refused at a limit, by limit ("rpm", "tpm", "in_flight"). ``model`` is "" for
    refusals before the body named one."""

    tenant: str
    model: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refused: dict[str, int] = {}


class TrafficView(msgspec.Struct, kw_only=True):
    """A router's view of one replica, as the admin API shows it beside the replica."""

    in_flight: int  # requests this router has on it now
    breaker: str  # closed, open, half-open
    waiting: float | None = None  # engine gauges as last scraped
    running: float | None = None
    kv_usage: float | None = None
    load_age_s: float | None = None  # since that scrape; None: never scraped
    wedged: str = ""  # why the router holds it wedged (work, no progress); "" if not
    # the share of prompt tokens its engine reported reused from its cache, and the
    # share this router estimated it would (None: no reading yet)
    cache_hit_rate: float | None = None
    estimated_hit_rate: float | None = None
    # the prompt blocks (``router.prefix.BLOCK_BYTES`` each) this router believes the
    # replica holds: its affinity index. A scale-down lets the one with least go
    cached_blocks: int = 0
    # the share of the requests that preferred it that went elsewhere, as it was
    # past its load bound (None: none preferred it)
    affinity_overruled: float | None = None
    # its pace as its replies said (``router.pace``): a prompt token's prefill, and a
    # request's time in its slot (None: not said enough yet)
    prefill_ms_per_token: float | None = None
    slot_s: float | None = None
    # requests that waited for a slot of it holding the prompt they shared with requests
    # in flight there, rather than compute it again in another: in the router
    # (``router.computing``), or in the engine for the slot it chose (``router.slotmap``)
    prompt_waits: int = 0


LEASE_PATH = "/v1/leases"


class LeaseAsk(msgspec.Struct, kw_only=True, frozen=True):
    """A router asks for ``units`` more of a tenant's (or key's) limit ``kind``, of
    which ``needed`` for requests waiting on it now (0: ahead of need)."""

    scope: str  # "tenant" or "key"
    owner: str  # the tenant's or key's name
    kind: str  # a field of ``Limits``
    units: int
    needed: int = 0


class LeaseBack(msgspec.Struct, kw_only=True, frozen=True):
    """Units of a grant a router gives back unspent (in flight: slots it no longer
    holds)."""

    scope: str
    owner: str
    kind: str
    units: int
    grant: int  # the grant's id, as the control plane gave it


class LeaseGrant(msgspec.Struct, kw_only=True, frozen=True):
    """Units a router may spend within ``ttl_s`` (in flight: slots it holds until it
    gives them back); ``left``: what the limit had left after this grant."""

    scope: str
    owner: str
    kind: str
    units: int
    grant: int
    ttl_s: float
    left: int = 0


class LeaseDenied(msgspec.Struct, kw_only=True, frozen=True):
    """The limit has nothing left for what was needed: try again in ``retry_after_s``.
    Not ``final``: other routers hold enough of it unspent, and are told to give it
    back (``LeaseAnswer.contended``): ask again in a moment."""

    scope: str
    owner: str
    kind: str
    limit: int
    retry_after_s: float
    final: bool = True


class LeaseHold(msgspec.Struct, kw_only=True, frozen=True):
    """What a router holds of a limit and has not spent (in flight: slots not in
    use), and of tokens what its requests in flight reserved (``reserved``: what they
    do not use comes back to it); ``units`` 0 in ``LeaseAnswer.contended``."""

    scope: str
    owner: str
    kind: str
    units: int = 0
    reserved: int = 0


class LeaseExchange(msgspec.Struct, kw_only=True, frozen=True):
    """What a router says to the control plane about its leases (``POST LEASE_PATH``)."""

    router: str  # its own id, random per process (as in ``RouterReport``)
    asks: list[LeaseAsk] = []
    backs: list[LeaseBack] = []
    holds: list[LeaseHold] = []  # everything it holds unspent, after its backs


class LeaseAnswer(msgspec.Struct, kw_only=True, frozen=True):
    grants: list[LeaseGrant] = []
    denied: list[LeaseDenied] = []
    # limits another router waits on: give back what is not needed now, ask no more
    # ahead, for a moment
    contended: list[LeaseHold] = []

"""What the control plane tells routers: the routing snapshot, as a value.

The control plane builds a ``Snapshot`` once per change of the fleet and
publishes it; routers only consume it, in process or over the admin API's
``GET /v1/routing`` watch. Both sides import this module and nothing of each
other. A snapshot's ``version`` is a hash of its content, so two control
planes (or one restarted) that see the same fleet give the same version, and
a router that already holds it is not woken for nothing.
"""

from __future__ import annotations

import hashlib

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
    # how requests are steered to what it holds: "prefix", "session" or "off"; and how
    # far past its share of the load it still takes what it holds
    affinity: str = "prefix"
    affinity_bound: float = 1.5
    # tokens of prompts it can keep (KV cache and prompt cache); None: not known
    cache_tokens: int | None = None


class ModelRouting(msgspec.Struct, kw_only=True):
    target_waiting: float | None = None
    kv_ceiling: float | None = None


class Snapshot(msgspec.Struct, kw_only=True):
    version: str = ""
    models: dict[str, ModelRouting] = {}  # every model the catalog knows
    routes: list[Route] = []


def versioned(models: dict[str, ModelRouting], routes: list[Route]) -> Snapshot:
    """A snapshot whose version is the hash of what it says (routes in key order)."""
    snap = Snapshot(models=models, routes=sorted(routes, key=lambda r: r.key))
    snap.version = hashlib.sha256(msgspec.json.encode(snap)).hexdigest()[:16]
    return snap


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
    # the share of the requests that preferred it that went elsewhere, as it was
    # past its load bound (None: none preferred it)
    affinity_overruled: float | None = None

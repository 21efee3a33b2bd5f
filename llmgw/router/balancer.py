"""Which replica takes a request: by load, within admission thresholds.

Load comes from two places. The engines' own gauges (scraped from their
Prometheus /metrics on a short interval: requests waiting, requests running,
KV-cache usage) see traffic from every router and the engine's real queue,
but they are as old as the last scrape and can be missing altogether. The
router's own in-flight count per replica is always fresh but sees only this
router's traffic. The score uses both when the gauges are fresh and falls
back to the in-flight count when they are not.

Stale or missing gauges degrade to the in-flight count, **never to
"saturated"**: an unknown is not a full replica. llm-d failed closed on stale
metrics and a slow scrape blocked whole pools that were in fact idle; a
replica whose scrape is late here is simply balanced by what this router
knows about it.

Admission: ``target_waiting`` and ``kv_ceiling`` (set per model in the
catalog's ``routing`` table by the operator, as what a replica holds while
still meeting its SLO; unset, they never trigger) mark a replica as
saturated; a saturated replica takes no new work while another is below its
thresholds. When every candidate is above, the request is shed (429 with
Retry-After, or queued for a bounded time by the caller) rather than piled
onto replicas already past the point where latency holds.

Panic: when every replica of a model that could take the request is
refused by its own breaker (open, or half-open with its probes taken), the
request goes to the least bad of them (the fewest consecutive faults, then
the longest open) rather than a 503 for everyone (Envoy's panic threshold).
Breakers open on evidence, but evidence can be wrong, and a model that is
all open answers nobody; a replica that is truly down fails the request fast
(a refused connection), which is no worse than the 503.

Pure code with an explicit ``now`` (monotonic seconds) and an injectable
random value, so tests drive it without a network or a clock.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import attrs

from llmgw.engines.base import LoadSignals
from llmgw.router.affinity import Pick
from llmgw.router.affinity import pick as prefer
from llmgw.router.breaker import Breaker, BreakerState, Outcome
from llmgw.router.computing import Computing
from llmgw.router.pace import Pace
from llmgw.router.prefix import Mode, PrefixIndex, PromptKey
from llmgw.router.slotmap import SlotMap
from llmgw.router.validators import non_negative, optional_non_negative, positive


@attrs.frozen
class Admission:
    """When a replica counts as saturated, and what to say when all are.

    ``None`` thresholds never trigger (no threshold configured is not a
    threshold of zero). ``retry_after_s`` goes into the 429's Retry-After.
    How long a request may wait for room before it is shed is the router's
    ``queue_timeout_s``, not a model's.
    """

    target_waiting: float | None = attrs.field(default=None, validator=optional_non_negative)
    kv_ceiling: float | None = attrs.field(default=None, validator=optional_non_negative)
    retry_after_s: float = attrs.field(default=1.0, validator=non_negative)


class Cuttable(Protocol):
    """Work in flight on a replica that can be ended from outside (a stream relayed
    from it, an attempt waiting on it), when the replica is found wedged."""

    def cut(self, why: str) -> None: ...


@attrs.define(eq=False)
class Endpoint:
    """One replica (or static URL) as the router sees it."""

    key: str  # replica id, or the static URL
    model: str
    url: str  # base URL
    # the engine serving it, as a profile names it ("llama.cpp", "vllm", ...): what it
    # scrapes and how a stream broken elsewhere is carried on there; "": unknown
    engine: str = ""
    node: str = ""  # the node it runs on, as the control plane said; "": static
    weight: float = attrs.field(default=1.0, validator=positive)  # relative share
    ready: bool = True  # Ready in the control plane's table
    draining: bool = False  # no new requests; in-flight ones finish
    in_flight: int = 0  # this router's own count, always fresh
    sent: int = 0  # requests sent to it, ever (who was in flight when its engine died)
    # requests in flight on it that were in flight at another engine's death
    # (``llmgw.router.poison``): two such are not sent to one replica while another holds
    # none, so that a second death tells which of them killed the engines
    suspects: int = 0
    load: LoadSignals | None = None
    load_at: float | None = None  # when ``load`` was scraped
    in_flight_at_load: int = 0  # ``in_flight`` when ``load`` was read
    # the engine's progress counter as last read, and when it last moved (or the
    # engine had nothing to do): flat while work is in flight, the engine is wedged
    progress: float | None = None
    progress_at: float | None = None
    wedged: str = ""  # why it counts as wedged now, in words; "" while it progresses
    # chunks of response bodies read from it (the relays count them), and when it was
    # last heard from (a chunk or an answered scrape; restarted while it has no work):
    # work in flight and nothing heard for long, the engine answers nothing at all
    chunks: int = 0
    chunks_heard: int = 0
    heard_at: float | None = None
    breaker: Breaker = attrs.Factory(Breaker)
    # the work on it now that a wedged replica cuts (to be carried on elsewhere)
    streams: set[Cuttable] = attrs.Factory(set)
    # per-replica thresholds (replicas on different hardware hold different
    # queues); None: the ones passed to ``choose``
    admission: Admission | None = None
    # the engine's own key, sent as ``Authorization: Bearer`` in place of the client's
    # (which is the gateway's key, not the engine's); "" sends none. Never shown.
    engine_key: str = attrs.field(default="", repr=False)
    # how its model's requests are steered to what it holds ("off": by load alone), and
    # what this router sent it (``llmgw.router.affinity``)
    affinity: Mode = "prefix"
    # how far past its share of the load it still takes what it holds (affinity.BOUND)
    affinity_bound: float = 1.5
    prefix: PrefixIndex = attrs.Factory(PrefixIndex)
    # how fast it computes a prompt and frees a slot, as its replies say (``pace``):
    # how long what it holds is worth waiting for
    pace: Pace = attrs.Factory(Pace)
    # its requests in flight by the prompt they hold there, which others of the same
    # prompt wait for a copy of to come free (``llmgw.router.computing``)
    computing: Computing = attrs.Factory(Computing)
    # what this router sent each of its engine's slots, where it chooses them
    # (``llmgw.router.slotmap``)
    slot_map: SlotMap = attrs.Factory(SlotMap)

    def start(self, now: float) -> None:
        """A request was sent to it: count it, and tell the breaker."""
        self.in_flight += 1
        self.sent += 1
        self.breaker.on_start(now)

    def finish(self, now: float, outcome: Outcome | None) -> None:
        """A request ended; ``None`` outcome: abandoned with no verdict."""
        self.in_flight = max(0, self.in_flight - 1)
        if outcome == "success":
            self.breaker.on_success(now)
        elif outcome == "upstream_fault":
            self.breaker.on_upstream_fault(now)
        elif outcome == "client_error":
            self.breaker.on_client_error(now)
        else:
            self.breaker.on_cancel(now)


@attrs.frozen
class Choice:
    """The pick, or why there is none.

    ``endpoint`` None and ``shed`` True: every candidate is above its
    admission thresholds; answer 429 with ``retry_after_s`` (after queueing,
    if configured). ``endpoint`` None and ``shed`` False: no replica may take
    traffic at all (none Ready, all draining, all tried); that is the
    upstream's unavailability, a 503. ``panic``: every candidate's breaker
    refused, and ``endpoint`` is the least bad of them.
    """

    endpoint: Endpoint | None
    reason: str
    shed: bool = False
    retry_after_s: float = 1.0
    panic: bool = False
    # how affinity placed it (None: by load alone)
    affinity: Pick | None = None
    # asked to keep apart from other suspects, and every candidate holds one
    crowded: bool = False


def fresh_load(endpoint: Endpoint, now: float, stale_after_s: float) -> LoadSignals | None:
    """The endpoint's signals if they are recent enough to trust, else None."""
    if endpoint.load is None or endpoint.load_at is None:
        return None
    if now - endpoint.load_at > stale_after_s:
        return None
    return endpoint.load


def score(endpoint: Endpoint, load: LoadSignals | None) -> float:
    """Lower is less loaded: work on the replica per unit of weight.

    With fresh signals: ``(in_flight + others + waiting) / weight``, where
    ``others`` is what the engine ran beyond this router's own requests when it
    was read (``running - in_flight_at_load``, at least 0): other routers'
    traffic. The engine's count is up to a scrape old, and lags this router's
    sends and its completions alike, while ``in_flight`` is current but sees only
    this router; so this router's part is counted now and the rest as read. (The
    larger of the two, as before, held a replica busy for up to a second after its
    request ended: a one-slot replica read running 1 tied a four-slot one at 4 of
    4, and the next request went to the four, whole; a 4:1 weight split ran 5:1.)
    Waiting requests are work queued on top. Without fresh signals:
    ``in_flight / weight``.

    Dividing by weight is what makes a weight-2 replica take twice the share:
    least-loaded picking keeps the scores level, so in-flight counts settle
    in proportion to weights.
    """
    work = float(endpoint.in_flight)
    if load is not None:
        others = max(0.0, (load.running or 0.0) - endpoint.in_flight_at_load)
        work += others + (load.waiting or 0.0)
    return work / endpoint.weight


def queued(endpoint: Endpoint, load: LoadSignals) -> float | None:
    """The engine's queue as this router can best tell, for admission.

    A reading is up to a scrape interval old, and a burst between two readings
    would otherwise all be admitted against a queue that was empty when read:

    - an engine that says how many requests it runs at once (llama.cpp's slots)
      is judged as it would be with this request sent: this router's requests
      beyond its slots queue (the reading's own queue, other routers' included,
      stands if it is longer);
    - one that does not (vLLM) and was queueing when read queues every request
      sent since; one that was not queueing is taken to have room (an unknown is
      not saturation)."""
    if load.waiting is None:
        return None
    if load.slots is not None:
        return max(load.waiting, endpoint.in_flight + 1 - load.slots)
    sent = endpoint.in_flight - endpoint.in_flight_at_load
    if sent > 0 and load.waiting > 0:
        return load.waiting + sent
    return load.waiting


def note_progress(endpoint: Endpoint, load: LoadSignals, now: float) -> None:
    """Keep when the engine's progress counter last moved, from a fresh reading. An
    engine with nothing to do makes no progress and is not wedged: its clock restarts."""
    if load.progress is None:
        return
    if (
        endpoint.progress_at is None
        or load.progress != endpoint.progress
        or not _has_work(endpoint, load)
    ):
        endpoint.progress, endpoint.progress_at = load.progress, now


def _has_work(endpoint: Endpoint, load: LoadSignals) -> bool:
    return endpoint.in_flight > 0 or (load.running or 0) > 0 or (load.waiting or 0) > 0


_SILENT = "requests in flight and not a byte of them nor an answer to a metrics scrape"


def note_heard(endpoint: Endpoint, now: float) -> None:
    """Keep when the replica was last heard from: a chunk relayed since the last
    judgement, or a scrape it answered since. With nothing in flight its clock restarts,
    unless it is held silent: that lasts until it is heard from."""
    if (
        (endpoint.in_flight == 0 and _SILENT not in endpoint.wedged)
        or endpoint.chunks != endpoint.chunks_heard
        or endpoint.heard_at is None
        or (endpoint.load_at is not None and endpoint.load_at > endpoint.heard_at)
    ):
        endpoint.chunks_heard = endpoint.chunks
        endpoint.heard_at = now


def silent(endpoint: Endpoint, now: float, after_s: float) -> str:
    """Why the replica counts as wedged for answering nothing, in words; "" when not.

    Silent: this router has requests in flight on it, and for ``after_s`` not one
    chunk of any of their bodies came back and no scrape of its metrics was answered
    (a stopped process, a hung host, a link that went dark). An engine that is merely
    slow still answers its metrics between its steps; one busy on a long prefill still
    sends its streams' tokens or answers a scrape. Once found silent it stays so until
    it is heard from again: moving its work elsewhere does not make it answer, and the
    control plane restarts it only after it has been held wedged for a grace."""
    if after_s <= 0 or endpoint.heard_at is None:
        return ""
    quiet = now - endpoint.heard_at
    if quiet < after_s:
        return ""
    if endpoint.in_flight == 0:
        return endpoint.wedged if _SILENT in endpoint.wedged else ""
    return f"{endpoint.in_flight} {_SILENT} for {quiet:.0f} s"


def wedged(
    endpoint: Endpoint, now: float, after_s: float, stale_after_s: float = 5.0
) -> str | None:
    """Why the replica is wedged, in words; "" when it is not; None when this cannot be
    told (no fresh reading, or no progress counter).

    Wedged: it has work (this router's requests in flight, or the engine's own count
    of running and waiting), its metrics answer, and its progress counter has stayed
    flat for ``after_s``. Its health check may well pass meanwhile (vLLM #17972). An
    engine that is merely slow still moves its counter; one whose metrics do not
    answer is left to its requests' own timeouts."""
    load = fresh_load(endpoint, now, stale_after_s)
    if after_s <= 0:
        return ""
    if load is None or load.progress is None or endpoint.progress_at is None:
        return None
    flat = now - endpoint.progress_at
    if not _has_work(endpoint, load) or flat < after_s:
        return ""
    work = max(float(endpoint.in_flight), load.running or 0.0) + (load.waiting or 0.0)
    return (
        f"{work:g} requests in flight and no progress for {flat:.0f} s, though its metrics answer"
    )


def above_thresholds(
    load: LoadSignals | None, admission: Admission, endpoint: Endpoint | None = None
) -> list[str]:
    """Which thresholds fresh signals exceed, in words; empty when admissible.
    ``endpoint``: the replica the signals are of, to count what this router sent it
    since they were read (``queued``).

    No fresh signals → never above: an unknown is not saturated.
    """
    if load is None:
        return []
    over: list[str] = []
    waiting = load.waiting if endpoint is None else queued(endpoint, load)
    if (
        admission.target_waiting is not None
        and waiting is not None
        and waiting > admission.target_waiting
    ):
        over.append(f"waiting {waiting:g} > {admission.target_waiting:g}")
    if (
        admission.kv_ceiling is not None
        and load.kv_usage is not None
        and load.kv_usage > admission.kv_ceiling
    ):
        over.append(f"kv {load.kv_usage:.2f} > {admission.kv_ceiling:.2f}")
    return over


def _why_not(endpoint: Endpoint, exclude: frozenset[str]) -> str | None:
    """Why the endpoint may not take a new request, its breaker aside; None when it may."""
    if not endpoint.ready:
        return "not Ready"
    if endpoint.draining:
        return "draining"
    if endpoint.key in exclude:
        return "already tried"
    return None


def _breaker_refuses(endpoint: Endpoint) -> str:
    if endpoint.breaker.state is BreakerState.HALF_OPEN:
        return "breaker half-open, probe in flight"
    return "breaker open"


def _least_bad(endpoint: Endpoint) -> tuple[int, float, str]:
    """Panic's order: the fewest consecutive faults, then the longest open."""
    breaker = endpoint.breaker
    opened = breaker.opened_at if breaker.opened_at is not None else float("-inf")
    return breaker.consecutive_faults, opened, endpoint.key


def _describe(endpoint: Endpoint, load: LoadSignals | None, now: float, value: float) -> str:
    parts = [f"in-flight {endpoint.in_flight}"]
    if load is not None:
        if load.running is not None:
            parts.append(f"running {load.running:g}")
        if load.waiting is not None:
            parts.append(f"waiting {load.waiting:g}")
        if load.kv_usage is not None:
            parts.append(f"kv {load.kv_usage:.2f}")
    elif endpoint.load_at is None:
        parts.append("no metrics")
    else:
        parts.append(f"metrics stale ({now - endpoint.load_at:.0f}s old)")
    if endpoint.weight != 1.0:
        parts.append(f"weight {endpoint.weight:g}")
    return f"{endpoint.key} ({', '.join(parts)}; score {value:g})"


def choose(
    endpoints: Sequence[Endpoint],
    now: float,
    *,
    admission: Admission,
    stale_after_s: float = 5.0,
    exclude: frozenset[str] = frozenset(),
    model: str | None = None,
    rng_value: float | None = None,
    key: PromptKey | None = None,
    apart: bool = False,
    only: bool = False,
) -> Choice:
    """Pick the replica for one request (or one retry of it).

    Candidates: Ready, not draining, not in ``exclude`` (replicas this
    request already tried), and whose breaker allows a request now. Among
    them, those below their admission thresholds are preferred; if every
    candidate is above, the request is shed. When the breakers refused every
    replica that was otherwise a candidate, and none this request already
    tried has its breaker closed (a retry after a healthy replica failed is
    no panic), the least bad of those is the pick (``panic``). The least ``score`` wins; equal
    scores are broken by ``rng_value`` (in [0, 1); drawn when None) over the
    tied keys in sorted order, so identical replicas share load instead of
    the first in the list taking everything.

    ``model``: when given, only endpoints serving it are considered (and it
    names the model in the reason); otherwise the endpoints' own model.

    ``key``: the request's prompt, when its model routes by affinity: among the
    admissible replicas, ``affinity.pick`` decides (the one holding the most of
    it, within a load bound) in place of the least score; None, or no candidate
    routing by affinity, and the choice is by load alone, as described above.
    ``only``: this router is the fleet's only one (``affinity.pick``: new
    conversations are placed evenly, and what it knows of a conversation outranks its
    rendezvous first choice).

    ``apart``: the request was in flight at an engine's death (``poison``): only the
    admissible replicas where no other such request is in flight are considered,
    while there is one; when there is none, the pick is as without, and ``crowded``.

    Calling this may move a breaker from open to half-open (its cool-down is
    over); it does not count the request: call ``Endpoint.start`` on the
    chosen endpoint when the request is actually sent.
    """
    if model is not None:
        endpoints = [e for e in endpoints if e.model == model]
    name = model if model is not None else (endpoints[0].model if endpoints else "?")

    refused: list[str] = []
    admissible: list[tuple[float, Endpoint, LoadSignals | None]] = []
    saturated: list[str] = []
    broken: list[Endpoint] | None = None  # candidates but for their breakers
    healthy_tried = False  # a replica this request tried has its breaker closed
    for endpoint in endpoints:
        why = _why_not(endpoint, exclude)
        if why is None and not endpoint.breaker.allows(now):
            why = _breaker_refuses(endpoint)
            if broken is None:
                broken = []
            broken.append(endpoint)
        if why is not None:
            refused.append(f"{endpoint.key}: {why}")
            if (
                endpoint.key in exclude
                and endpoint.ready
                and not endpoint.draining
                and endpoint.breaker.state is BreakerState.CLOSED
            ):
                healthy_tried = True
            continue
        load = fresh_load(endpoint, now, stale_after_s)
        over = above_thresholds(load, endpoint.admission or admission, endpoint)
        if over:
            saturated.append(f"{' and '.join(over)} on {endpoint.key}")
            continue
        admissible.append((score(endpoint, load), endpoint, load))

    crowded = False
    if apart and admissible:
        clear = [entry for entry in admissible if entry[1].suspects == 0]
        crowded = not clear
        admissible = clear or admissible
    if admissible:
        if key is not None:
            found = prefer(admissible, key, only=only)
            if found is not None:
                why = f"{found.why}: {_describe(found.endpoint, found.load, now, found.value)}"
                return Choice(found.endpoint, why, affinity=found, crowded=crowded)
        best = min(s for s, _, _ in admissible)
        tied = sorted(
            (entry for entry in admissible if entry[0] <= best + 1e-9),
            key=lambda entry: entry[1].key,
        )
        r = random.random() if rng_value is None else rng_value
        index = min(int(r * len(tied)), len(tied) - 1)
        value, endpoint, load = tied[index]
        why = f"least loaded: {_describe(endpoint, load, now, value)}"
        return Choice(endpoint, why, crowded=crowded)
    if saturated:
        return Choice(
            None,
            "every replica of model "
            f"{name} is above its admission thresholds ({'; '.join(saturated)})",
            shed=True,
            retry_after_s=admission.retry_after_s,
        )
    if broken is not None and not healthy_tried:
        pick = min(broken, key=_least_bad)
        return Choice(
            pick,
            f"panic: every replica of model {name} is refused by its breaker; least bad: "
            f"{pick.key} ({pick.breaker.consecutive_faults} consecutive faults)",
            panic=True,
        )
    detail = f" ({'; '.join(refused)})" if refused else ""
    return Choice(None, f"no Ready replica for model {name}{detail}")


@attrs.define
class RetryBudget:
    """Bounds retries per request and across the router.

    ``max_attempts`` caps one request (first try included). The ratio budget
    caps retries to ``ratio`` of requests over a sliding ``window_s`` (as in
    Envoy and Finagle), with a floor of ``min_retries`` per window so a quiet
    router can still retry. Without it, a fleet-wide brown-out turns every
    request into ``max_attempts`` requests and multiplies the load on
    replicas that are failing because they are overloaded.

    Counts are kept in ``buckets`` slices of the window, so memory does not
    grow with traffic.
    """

    max_attempts: int = 3
    ratio: float = 0.2
    window_s: float = 10.0
    min_retries: int = 3
    buckets: int = 10
    # (bucket index, requests, retries), oldest first
    _slices: deque[list[int]] = attrs.field(factory=deque, init=False)

    def _bucket(self, now: float) -> int:
        return int(now // (self.window_s / self.buckets))

    def _prune(self, now: float) -> None:
        oldest = self._bucket(now) - self.buckets + 1
        while self._slices and self._slices[0][0] < oldest:
            self._slices.popleft()

    def _current(self, now: float) -> list[int]:
        self._prune(now)
        index = self._bucket(now)
        if not self._slices or self._slices[-1][0] != index:
            self._slices.append([index, 0, 0])
        return self._slices[-1]

    def totals(self, now: float) -> tuple[int, int]:
        """(requests, retries) within the window ending at ``now``."""
        self._prune(now)
        return sum(s[1] for s in self._slices), sum(s[2] for s in self._slices)

    def on_request(self, now: float) -> None:
        """A client request arrived (counted once, however many attempts it takes)."""
        self._current(now)[1] += 1

    def on_retry(self, now: float) -> None:
        """A retry was sent."""
        self._current(now)[2] += 1

    def can_retry(self, now: float, *, attempts: int = 1, failover: bool = False) -> bool:
        """Whether a request that has made ``attempts`` attempts may make another.

        Only the bounds: whether the failure may be retried at all is the
        attempt's ``verdict``. ``failover``: the attempt's replica is gone or
        wedged, and did no work for it, so a retry adds no load to a brown-out;
        only ``max_attempts`` bounds it (a replica dying with many requests
        waiting on it would otherwise spend the whole budget at once, and fail
        the rest).
        """
        if attempts >= self.max_attempts:
            return False
        if failover:
            return True
        requests, retries = self.totals(now)
        return retries < max(self.min_retries, self.ratio * requests)

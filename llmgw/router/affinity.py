"""Which of the replicas the balancer allows takes a request, by what they hold.

Theory of operation
-------------------
``balancer.choose`` decides who may take a request at all (Ready, not draining,
breaker, admission thresholds) and, among those, ``pick`` here decides who does,
when the model routes by affinity: it only reorders the candidates the balancer
allows, and every other rule (shedding, panic, retries) is the balancer's as
before.

The order of preference, from the request's ``PromptKey``:

1. a replica this router knows holds the prompt's whole first turn (it has seen
   this conversation): the one holding the most of the prompt first, and of those
   holding as much, for a later turn the one it was sent to last (where the latest
   turn went, and its reply, which blocks of 512 bytes do not tell apart), for a
   first turn the least loaded;
2. the anchor's rendezvous winner: the same in every router process, warm or
   cold, for every request of a conversation (or of one long system prompt, or
   of one session);
3. the others: where several routers share the fleet, in the rendezvous order of
   the request's spill key, which they all compute alike; at the fleet's only
   router, the least loaded first (by the balancer's score; of those as loaded, in
   that order). Spilled in the spill key's order by the only router too, a popular
   prompt's second replica was whichever that order put first, often one already
   computing another prompt, and the requests queued behind both met their TTFT SLO
   less often: on twelve seeds of ``tools/bench_goodput.py``'s shared system
   prompts at 3.7 requests a second, four sweeps each, run in pairs one after the
   other, by load was ahead in every pair (by 2-15%: 1.55-2.06 good/s by the spill
   key, 1.62-2.36 by load, the machine's speed drifting between pairs), the prompt
   tokens computed alike (85-91 against 85-88 thousand).

Knowledge (1) agrees with the rendezvous (2) unless load moved the
conversation, which is what lets a router that has never seen a conversation
make the same first choice as one that routed all its turns. Where load moved
it, only the router that sent the moved turn knows, so (1) comes first only at
the fleet's only router (``only``: the server's, while no standalone router
reports). Where several routers share the fleet (a standalone router's workers
each take whichever turn the kernel hands them), the anchor's winner comes
first and what this router knows next: a conversation whose first turn was
moved by load (its first choice looked busy, if only by an engine gauge read
before another router's request ended) comes back to its first choice at its
next turn through every router, where knowledge first left it on two replicas
for good, one per worker, each computing the other's turns again.

New conversations, placed evenly (``only``: this router is the fleet's only one,
the server's own while no standalone router reports). Rendezvous places few keys
unevenly, and a replica given more conversations than its cache holds evicts
them: sixteen on four replicas went 5/5/4/2 in ``tools/bench_goodput.py``, and
the replicas with five lost turns to eviction and had their later turns moved
by the load bound. So a new conversation (a first turn with no session hint,
of which no candidate holds anything) goes to the first replica in the
rendezvous order that has had fewer than ``EVEN`` more (per weight) of the
model's recent new conversations than the one that has had the fewest
(``PrefixIndex.placed``: counted where each went, all decayed by
1/``PLACEMENTS`` at each, so that a replica that joins takes its share from then
on). That run then moved no turn and lost none, and its engines computed 0.54x
the prompt tokens they had. (A first rule, no more than the ceiling of an even
share, let a replica whose early conversations' counts had decayed take a fifth
of sixteen one time in four: 5/4/4/3, and the fifth evicted the others.) Every
first turn counts, by the share of its prompt the replica computes (``work``;
the decay is by as much): a new conversation one, another user of a system
prompt the replica holds the rest of the prompt, its question. Counted only when
new, the replica that took a popular system prompt's users (18 of the shared
workload's 60) had had one prompt as the others had and took a second one's
users too, busy 1.40x the mean; counted one a request, it had had so many that
new prompts, each computed whole, piled on the others (1.53x). By work, six
seeds' imbalance was 1.06-1.22, where it had been 1.10-1.40. Evenness never
outranks load: where every replica with room is busier than its share, the new
conversation goes to the least loaded. (Sent instead to the least loaded of those
with room while within the bound later turns have, a new prompt waited for a busy
replica's prefill while another stood idle, 1-3 of 40 a run on prompts nothing
shares, whose TTFT p95 was 1.07x and 1.10x by load alone's over two sweeps of six
seeds; without, none was, and sixteen conversations on four replicas still moved
no turn and lost none.) A
router that has not seen the conversation cannot know where it was placed, so
where several routers share the fleet (standalone routers report to the control
plane, each worker one) every router, the server's included, places by
rendezvous alone and they agree; the server's router says in one log line which
it does, when it changes.

Load bound (consistent hashing with bounded loads): the first replica in that
order whose work after taking this request stays within ``ceil(bound x its share
of the work of all candidates, this request included)`` takes it; the least
loaded always is within it. A preferred replica past its bound is *overruled*
and the request goes on down the order (a spilled conversation spills to the
same replica each turn). Work is the requests on a replica, running or
waiting, each counted once (``_requests``: this router's, and where the engine's
gauges are fresh the other routers' as it said), not the balancer's score,
which counts a waiting request twice. ``bound`` is:

- the replica's ``affinity_bound`` (the catalog's ``routing.affinity_bound``,
  1.5 unless set) when the request is a later turn of a conversation (which
  every router tells from the request alone, so that a router that has not
  seen the earlier turns keeps to the first choice as the one that has), when
  this router knows the replica holds some of the prompt, or when the request
  is routed by its session hint alone; and such a request stays, past that
  bound, while the replica has a free slot to start it in at once (the engine
  says how many requests it runs at once: llama.cpp's slots), or while the wait
  for one is shorter than computing what the replica holds of the prompt again
  elsewhere (``pace``: how fast the replica computes a prompt and frees a slot,
  as its replies say; a replica not yet paced, as its model's others are), unless
  the prompt's own requests fill its slots (``Computing.holding``: users behind one
  popular system prompt): then the queue is the prompt's, which waiting never
  drains, and the prompt goes on down the order to a second replica (kept on one,
  the benchmark's most popular prompt, 25 of 60 requests, left that replica busy
  1.39-1.43x the mean on two seeds of six). A cache hit saves
  a whole prefill, and waiting behind one more request costs a share of a step,
  so the default leans to the cache: on two replicas a bound of 1.25 already sends a
  third request away from a replica holding two while the other holds none,
  and ``tools/bench_goodput.py``'s multi-turn workload reused 54% of its prompt
  tokens at 1.25 against 74% at 1.5 (an oracle's: 73%).
- 1 otherwise: a new conversation, or a prompt nothing else shares, goes to its
  first choice only while that is no busier than its share, so new work is
  spread by load, and only what a replica holds keeps it there past its share.
  (A first turn moved by load is where the only router sends the next turns;
  where several are, every one sends them back to the first choice while that is
  within its bound.) Rendezvous alone places few keys
  unevenly (six conversations on two replicas go 5-1 or worse about one time in
  five), and the bound then moved their later turns off the replica that held
  them: a run of the benchmark reused 39% of the multi-turn prompt tokens
  where others had reused 74%.

Each choice says which rule made it (``Pick.route``, the access log's ``route=``):
``held``, ``first``, ``even``, or ``spill:`` and the rule that turned its first
choice down (``SPILLS``), so that a prompt computed again on a second replica is
told apart by cause from the log alone: on the benchmark's shared system prompts,
twelve seeds at 3.8 requests a second, 28 of 40 such requests were ``spill:full``
and 5 ``spill:wait``, where counting requests in flight had guessed at them.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from llmgw.router.pace import Pace, fleet, held_bytes
from llmgw.router.prefix import PromptKey, rendezvous

if TYPE_CHECKING:
    from llmgw.engines.base import LoadSignals
    from llmgw.router.balancer import Endpoint

BOUND = 1.5  # a preferred replica takes at most this many times its share of the work
PLACEMENTS = 32  # new conversations counted per model (decayed), to place the next evenly
# a new conversation goes to a replica with fewer than this many (per weight) more of the
# recent ones than the one with the fewest
EVEN = 0.5
# why a preferred replica did not take a request (the access log's ``route=spill:<key>``)
SPILLS = {
    "share": "is past its share of the work, and holds none of the prompt",
    "bound": "is past its bound, and its engine has not said its slots",
    "full": "is past its bound, its slots full of this prompt's requests",
    "wait": "is past its bound, and its slots free later than the prompt computes elsewhere",
}


@attrs.frozen
class Pick:
    """The replica chosen, and what affinity had to do with it.

    ``preferred``: the first in the order of preference; ``overruled``: it was past
    its load bound, so ``endpoint`` is another (``route`` says why); ``held``: the
    blocks of the prompt this router's index says ``endpoint`` holds."""

    endpoint: Endpoint
    value: float  # its balancer score
    load: LoadSignals | None
    preferred: Endpoint
    held: int
    why: str
    # the access log's ``route=``: held, first, even, or spill:<SPILLS' key>
    route: str
    # a new conversation placed evenly (``pick``'s ``only``): none of its prompt was held
    new: bool = False
    # a first turn placed by the only router (a new conversation, or another user of a
    # shared prompt): the share of its prompt the replica computes, which the proxy
    # counts where it went (``placed``); 0: not counted
    work: float = 0.0

    @property
    def overruled(self) -> bool:
        return self.route.startswith("spill:")


def pick(
    admissible: Sequence[tuple[float, Endpoint, LoadSignals | None]],
    key: PromptKey,
    *,
    only: bool = False,
) -> Pick | None:
    """The choice among ``admissible`` (the balancer's candidates below their
    thresholds: score, endpoint, fresh load); None when none of them routes by
    affinity (the balancer's own choice stands). ``only``: this router is the fleet's
    only one: a new conversation goes where about the fewest of the recent ones went,
    and what it knows of a conversation comes before the anchor's winner (see the
    module docstring)."""
    ranked = _order(admissible, key, only)
    if not ranked:
        return None
    requests = {ep.key: _requests(ep, load) for _, ep, load in admissible}
    total = sum(requests.values())
    weights = sum(ep.weight for _, ep, _ in admissible)

    def within(ep: Endpoint, bound: float) -> bool:
        """``ep`` stays within ``bound`` x its share of the work with this request."""
        return requests[ep.key] + 1 <= math.ceil(bound * ep.weight * (total + 1) / weights - 1e-9)

    # a new conversation (a first turn, no session hint) placed evenly: among the
    # replicas that hold none of it, those with room for another of the recent ones
    fresh = only and bool(key.blocks) and not key.later and not key.session
    least = min(ep.prefix.placed / ep.weight for _, (_, ep, _) in ranked) if fresh else 0.0

    def room(held: int, ep: Endpoint) -> bool:
        if not fresh or held:
            return True
        return ep.prefix.placed / ep.weight < least + EVEN

    preferred = next((ep for held, (_, ep, _) in ranked if room(held, ep)), ranked[0][1][1])

    def refuses(held: int, ep: Endpoint, load: LoadSignals | None) -> str:
        """Why ``ep`` does not take the request ("": it does; else ``SPILLS``' key)."""
        kept = bool(held or key.later or not key.blocks)
        if within(ep, ep.affinity_bound if kept else 1.0):
            return ""
        if not kept:
            return "share"
        slots = math.floor(load.slots) if load is not None and load.slots else 0
        if not slots:
            return "bound"
        # a free slot starts it at once; a slot that frees sooner than what it holds
        # would take to compute again elsewhere is worth waiting for (``pace``), unless
        # the prompt's own requests fill its slots: then its queue is the prompt's, which
        # waiting never drains, and the prompt spreads to a second replica
        if ep.computing.holding(key.blocks, held) >= slots:
            return "full"
        shared = held_bytes(held, key.size, ep.prefix.kept)
        # and a move waits where it goes too, if every other replica is busy
        others = (entry for entry in admissible if entry[1] is not ep)
        paces = [e.pace for _, e, _ in admissible]
        elsewhere = min(
            (_queue_s(e, signals, requests, paces) for _, e, signals in others), default=0.0
        )
        pace = fleet(ep.pace, paces)
        return (
            ""
            if requests[ep.key] + 1 <= slots + pace.patience(shared, slots, elsewhere)
            else "wait"
        )

    spill = ""  # why the preferred replica did not take it
    chosen = None
    for entry in ranked:
        if not room(entry[0], entry[1][1]):
            continue
        why_not = refuses(entry[0], *entry[1][1:])
        if not why_not:
            chosen = entry
            break
        if entry[1][1] is preferred:
            spill = why_not
    # the least loaded is always within the bound; this is for weights that bend it, and
    # for a new conversation whose replicas with room are busier than their share: load
    # comes first (see the module docstring)
    held, (value, ep, load) = chosen or min(ranked, key=lambda entry: entry[1][0])
    new = fresh and not held
    route = _route(held, key, (spill or "bound") if ep is not preferred else "", new)
    why = _why(ep, held, key, preferred, route)
    work = _work(ep, held, key) if fresh else 0.0
    return Pick(ep, value, load, preferred, held, why, route, new=new, work=work)


def _work(ep: Endpoint, held: int, key: PromptKey) -> float:
    """The share of the prompt ``ep`` computes, holding ``held`` of its blocks."""
    return 1.0 - held_bytes(held, key.size, ep.prefix.kept) / key.size if key.size else 1.0


def _requests(ep: Endpoint, load: LoadSignals | None) -> float:
    """The requests on ``ep``, running or waiting, each once: this router's now, and
    (where its gauges are fresh) the others' as the engine said when read. The
    balancer's score counts a waiting request again, as worse than a running one, for
    the least-loaded choice; counted so here, a replica with a queue was past its
    bound at half its share of requests, and a popular prompt moved while every
    replica was busy and the move only added work."""
    if load is None:
        return float(ep.in_flight)
    others = (load.running or 0.0) + (load.waiting or 0.0) - ep.in_flight_at_load
    return ep.in_flight + max(0.0, others)


def _queue_s(
    ep: Endpoint, load: LoadSignals | None, requests: dict[str, float], paces: list[Pace]
) -> float:
    """How long a request sent to ``ep`` now would wait for a slot there (0: one is
    free, or the engine has not said its slots, or no replica's replies the pace)."""
    if load is None or not load.slots:
        return 0.0
    return fleet(ep.pace, paces).queue_s(requests[ep.key], math.floor(load.slots))


def placed(endpoints: Sequence[Endpoint], chosen: Endpoint, work: float = 1.0) -> None:
    """A first turn went to ``chosen``, which computes ``work`` of its prompt (1: a new
    conversation): counted there by that, and every count of its model's ``endpoints``
    decays by as much, so that the counts are of about the last ``PLACEMENTS`` new
    conversations' worth."""
    for ep in endpoints:
        ep.prefix.placed *= (1.0 - 1.0 / PLACEMENTS) ** work
    chosen.prefix.placed += work


def _order(
    admissible: Sequence[tuple[float, Endpoint, LoadSignals | None]],
    key: PromptKey,
    only: bool,
) -> list[tuple[int, tuple[float, Endpoint, LoadSignals | None]]]:
    """The candidates that route by affinity, most preferred first, each with the
    blocks this router knows it holds. ``only``: this router is the fleet's only one,
    and what it knows comes before the anchor's winner; otherwise after it.

    Of replicas holding as much of the prompt, a conversation's later turn prefers
    the one its last turn went to (its reply is there, which blocks of 512 bytes do
    not tell apart), and a first turn the least loaded (by the balancer's score): what
    they hold is a prompt it shares with others (a system prompt, or the same first
    turn), alike in each, and the one sent it last may still be computing it, which
    llama.cpp does again for a request that finds another slot free."""
    entries = [entry for entry in admissible if entry[1].affinity != "off"]
    if not entries:
        return []
    blocks = key.blocks
    held = [entry[1].prefix.held(blocks) if blocks else 0 for entry in entries]
    anchor = [rendezvous(key.anchor, entry[1].key, entry[1].weight) for entry in entries]
    top = max(range(len(entries)), key=lambda i: anchor[i])
    seen = max(1, key.turn_blocks)

    def tie(i: int) -> float:
        if key.later:  # of equal holders, where the last turn went: its reply is there too
            return -entries[i][1].prefix.last_sent(blocks, held[i])
        return entries[i][0]  # a first turn: the least loaded

    known = sorted(
        (i for i in range(len(entries)) if held[i] >= seen),
        key=lambda i: (-held[i], tie(i), -anchor[i]),
    )
    rest = [i for i in range(len(entries)) if i != top and i not in known]
    spill: Mapping[int, float] | list[float] = (
        {i: rendezvous(key.spill, entries[i][1].key, entries[i][1].weight) for i in rest}
        if key.spill != key.anchor
        else anchor
    )
    # those holding none of it: the only router's spill goes where it waits least, and
    # what it sent there is known at the prompt's next request; where several routers
    # are, each spills as the others do (a moved turn is known only to its sender)
    rest.sort(key=lambda i: (entries[i][0], -spill[i]) if only else -spill[i])
    if only:  # what this router knows first, then the anchor's winner
        order = [*known, *([] if top in known else [top]), *rest]
    else:  # the anchor's winner first, as every router has it, then what this one knows
        order = [top, *(i for i in known if i != top), *rest]
    return [(held[i], entries[i]) for i in order]


def _route(held: int, key: PromptKey, spill: str, new: bool) -> str:
    """The access log's ``route=``: ``spill:<why>`` (``SPILLS``), ``even``, ``held``,
    or ``first`` (the rendezvous winner for the prompt or its session)."""
    if spill:
        return f"spill:{spill}"
    if new:
        return "even"
    if held and held >= max(1, key.turn_blocks):
        return "held"
    return "first"


def _why(ep: Endpoint, held: int, key: PromptKey, preferred: Endpoint, route: str) -> str:
    if route.startswith("spill:"):
        why_not = SPILLS[route.removeprefix("spill:")]
        return f"affinity overruled by load: {preferred.key} {why_not}; {ep.key} next"
    if route == "even":
        return f"affinity: {ep.key} is first for the new conversation of those with room for one"
    if route == "held":
        return f"affinity: {ep.key} holds {held} of the prompt's {len(key.blocks)} blocks"
    return f"affinity: {ep.key} is first for the {'session' if key.session else 'prompt'}"

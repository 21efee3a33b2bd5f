"""Affinity: what a prompt is read as, what a replica is known to hold, and who takes it.

The choice's invariants, without a network: a conversation's turns go to one
replica while it is within its load bound and move when it is not; two routers
that share nothing (one warm, one cold) make the same first choice; a session hint
pulls a user's requests together; an engine's reading that contradicts the index
shrinks it; and with affinity off the choice is exactly the balancer's before
affinity existed (a property test against a frozen copy of it).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.engines.base import LoadSignals, Timings
from llmgw.router.affinity import placed
from llmgw.router.balancer import (
    Admission,
    Choice,
    Endpoint,
    _breaker_refuses,
    _describe,
    _least_bad,
    _why_not,
    above_thresholds,
    choose,
    fresh_load,
    score,
)
from llmgw.router.breaker import Breaker, BreakerState
from llmgw.router.pace import FLEET, QUEUE_PER_SLOT, READINGS, Pace, held_bytes
from llmgw.router.prefix import (
    ANCHOR_BYTES,
    BLOCK_BYTES,
    MIN_BLOCKS,
    PrefixIndex,
    PromptKey,
    Reading,
    chain,
    prompt_key,
)

NOW = 1000.0
OPEN = Admission()
SYSTEM = {"role": "system", "content": "You answer questions about the documents you are given."}


def ep(key: str, **kw: object) -> Endpoint:
    return Endpoint(key=key, model="m", url=f"http://{key}:8000", **kw)  # type: ignore[arg-type]


def fleet(n: int = 4) -> list[Endpoint]:
    return [ep(f"r{i}") for i in range(n)]


def body(messages: list[dict[str, str]], **more: object) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": messages, **more})


def conversation(seed: int, turns: int, doc_bytes: int = 3000) -> list[list[dict[str, str]]]:
    """The message lists of a conversation's turns: its own long document first."""
    rng = random.Random(seed)
    doc = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(doc_bytes // 6))
    messages = [SYSTEM, {"role": "user", "content": f"Document {seed}: {doc}\nSummarise it."}]
    out = [list(messages)]
    for t in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"Answer {t} of conversation {seed}."},
            {"role": "user", "content": f"Question {t}: and then?"},
        ]
        out.append(list(messages))
    return out


def send(endpoints: list[Endpoint], key: PromptKey, **kw: object) -> Choice:
    """Choose as the proxy does, and record the prompt where it went (and a first turn
    placed there, by its work)."""
    choice = choose(endpoints, NOW, admission=OPEN, key=key, **kw)  # type: ignore[arg-type]
    assert choice.endpoint is not None
    choice.endpoint.prefix.record(key.blocks)
    if choice.affinity is not None and choice.affinity.work:
        placed(endpoints, choice.endpoint, choice.affinity.work)
    return choice


# --- what a prompt is read as ----------------------------------------------------------


def test_a_conversations_turns_share_their_leading_blocks_and_their_anchor() -> None:
    turns = [prompt_key(body(m), "prefix") for m in conversation(1, 4)]
    assert all(k is not None for k in turns)
    keys = [k for k in turns if k is not None]
    assert len({k.anchor for k in keys}) == 1 and len({k.spill for k in keys}) == 1
    for earlier, later in itertools.pairwise(keys):
        assert later.blocks[: len(earlier.blocks)] == earlier.blocks
        assert len(later.blocks) >= len(earlier.blocks)
    assert keys[0].turn_blocks == len(keys[0].blocks)  # its first turn is all of it
    other = prompt_key(body(conversation(2, 1)[0]), "prefix")
    assert other is not None and other.anchor != keys[0].anchor
    # the shared system prompt is shorter than a block: no leading block in common
    assert other.blocks[0] != keys[0].blocks[0]


def test_the_key_is_what_the_client_said_not_how_its_json_was_written() -> None:
    messages = conversation(3, 2)[1]
    compact = body(messages)
    spaced = b'{"messages": ' + msgspec.json.encode(messages).replace(b'","', b'", "') + b"}"
    reordered = msgspec.json.encode(
        {
            "stream": True,
            "messages": [{"content": m["content"], "role": m["role"]} for m in messages],
        }
    )
    keys = {prompt_key(b, "prefix") for b in (compact, spaced, reordered)}
    assert len(keys) == 1


def test_a_long_shared_system_prompt_is_the_anchor_of_everyone_behind_it() -> None:
    system = {"role": "system", "content": "Rules. " * (ANCHOR_BYTES // 6)}
    a = prompt_key(body([system, {"role": "user", "content": "What is 2+2?"}]), "prefix")
    b = prompt_key(body([system, {"role": "user", "content": "Name a colour."}]), "prefix")
    assert a is not None and b is not None
    assert a.anchor == b.anchor  # grouped by the system prompt
    assert a.spill != b.spill  # but each first turn spills its own way


def test_session_hints_and_modes() -> None:
    one = body(conversation(4, 1)[0], user="alice")
    two = body(conversation(5, 1)[0], user="alice")
    a, b = prompt_key(one, "prefix"), prompt_key(two, "prefix")
    assert a is not None and b is not None and a.session and a.anchor == b.anchor
    assert a.blocks != b.blocks  # still read, for what each replica holds
    header = prompt_key(two, "prefix", session="s-1")
    assert header is not None and header.anchor != b.anchor  # the header wins over user
    only = prompt_key(one, "session")
    assert only is not None and only.blocks == () and only.anchor == a.anchor
    assert prompt_key(body(conversation(4, 1)[0]), "session") is None  # no hint, no key
    assert prompt_key(one, "off") is None
    assert prompt_key(b"{not json", "prefix") is None
    assert prompt_key(msgspec.json.encode({"model": "m", "input": "x"}), "prefix") is None


def test_completion_prompts_text_and_token_ids() -> None:
    text = "A" * 3000
    a = prompt_key(msgspec.json.encode({"prompt": text}), "prefix")
    b = prompt_key(msgspec.json.encode({"prompt": text + " and more"}), "prefix")
    c = prompt_key(msgspec.json.encode({"prompt": text + "B" * ANCHOR_BYTES}), "prefix")
    assert a is not None and b is not None and c is not None
    assert b.blocks[: len(a.blocks)] == a.blocks and a.anchor == b.anchor
    assert c.blocks[: len(a.blocks)] == a.blocks and c.turn_blocks == ANCHOR_BYTES // BLOCK_BYTES
    ids = prompt_key(msgspec.json.encode({"prompt": list(range(2000))}), "prefix")
    assert ids is not None and len(ids.blocks) > 1


def test_blocks_are_keyed_by_everything_before_them() -> None:
    one = chain(b"x" * BLOCK_BYTES + b"y" * BLOCK_BYTES)
    two = chain(b"z" * BLOCK_BYTES + b"y" * BLOCK_BYTES)
    assert one[1] != two[1]  # the same second block after another first one
    assert len(chain(b"x" * (BLOCK_BYTES - 1))) == 0


# --- what a replica is known to hold ---------------------------------------------------


def test_the_index_evicts_tails_before_heads_and_stays_bounded() -> None:
    index = PrefixIndex(limit=10, capacity=10)
    first = tuple(range(8))
    index.record(first)
    index.record(tuple(range(100, 104)))  # 12 in all: 2 of ``first`` must go, its tail
    assert len(index) == 10
    assert index.held(first) == 6


def test_an_engine_that_reused_less_than_estimated_shrinks_the_index() -> None:
    index = PrefixIndex()
    for i in range(400):
        index.record(tuple(range(i * 10, i * 10 + 10)))
    before = len(index)
    key = tuple(range(0, 10))
    held = index.held(key)
    assert held == 10
    # the engine says it reused nothing of a prompt the index said it held whole
    estimated = index.observe(held, 10, Reading(cached=0, prompt=1200), size=10 * BLOCK_BYTES)
    assert estimated == 1200 and index.evicted == 1
    assert MIN_BLOCKS <= len(index) < before
    # a reading that bears the estimate out is no miss, and lets it grow back
    capacity = index.capacity
    index.record(key)
    index.observe(10, 10, Reading(cached=1150, prompt=1200), size=10 * BLOCK_BYTES)
    assert index.evicted == 1 and index.capacity > capacity
    assert index.prompt_tokens == 2400 and index.cached_tokens == 1150


# --- who takes it ------------------------------------------------------------------------


def test_a_conversations_turns_land_on_one_replica_while_it_is_not_overloaded() -> None:
    endpoints = fleet()
    places: dict[int, set[str]] = {}
    for seed in range(20):
        for messages in conversation(seed, 4):
            key = prompt_key(body(messages), "prefix")
            assert key is not None
            choice = send(endpoints, key)
            assert choice.affinity is not None and not choice.affinity.overruled
            places.setdefault(seed, set()).add(choice.endpoint.key)  # type: ignore[union-attr]
    assert all(len(p) == 1 for p in places.values()), places
    spread = Counter(next(iter(p)) for p in places.values())
    assert len(spread) >= 3  # conversations spread over the replicas


def test_a_cold_router_makes_the_same_first_choice_as_a_warm_one() -> None:
    warm = fleet()
    for seed in range(30):  # the warm router routed every turn so far
        for messages in conversation(seed, 3):
            key = prompt_key(body(messages), "prefix")
            assert key is not None
            send(warm, key)
    for seed in range(30):
        cold = fleet()  # a router that has seen nothing of any of them
        nxt = prompt_key(body(conversation(seed, 4)[3]), "prefix")
        assert nxt is not None
        a, b = send(warm, nxt), send(cold, nxt)
        assert a.endpoint is not None and b.endpoint is not None
        assert a.endpoint.key == b.endpoint.key
        assert a.affinity is not None and a.affinity.held > 0  # the warm one knew it
        assert b.affinity is not None and b.affinity.held == 0


def homed(seed: int, turns: int) -> tuple[list[Endpoint], list[PromptKey], Endpoint]:
    """A fleet of four, a conversation's turns' keys, and where its first turn went."""
    endpoints = fleet()
    keys = [prompt_key(body(messages), "prefix") for messages in conversation(seed, turns)]
    assert all(key is not None for key in keys)
    home = send(endpoints, keys[0]).endpoint  # type: ignore[arg-type]
    assert home is not None
    return endpoints, keys, home  # type: ignore[return-value]


def test_turns_move_when_their_replica_is_past_its_load_bound_and_come_back() -> None:
    """Moved by load, a conversation's turns spill to one replica. Once its first
    choice has room again, the fleet's only router keeps them where they were moved
    (that replica holds the most of them); where several routers are, each sends
    them back to the first choice, as a router that saw none of them does."""
    for only in (True, False):
        endpoints, turns, home = homed(7, 4)
        home.in_flight = 3  # others idle: the mean with this request is 1, the bound 2
        moved = send(endpoints, turns[1], only=only)
        assert moved.endpoint is not home
        assert moved.affinity is not None and moved.affinity.overruled
        assert moved.affinity.preferred is home
        again = send(endpoints, turns[2], only=only)
        assert again.endpoint is moved.endpoint  # spilled the same way again
        home.in_flight = 0
        back = send(endpoints, turns[3], only=only)
        assert back.affinity is not None and not back.affinity.overruled
        cold = choose(fleet(), NOW, admission=OPEN, key=turns[3]).endpoint
        assert cold is not None and cold.key == home.key
        if only:  # both hold it now: the one holding more of it (the last turns went there)
            assert back.endpoint is moved.endpoint, only
        else:
            assert back.endpoint is home, only


def test_a_first_turn_goes_to_the_least_loaded_of_the_replicas_holding_its_system_prompt() -> None:
    """A hot system prompt spilled from its replica to another, which holds it too now,
    and was sent it last; its own replica is idle again. A new user's first turn goes to
    the idle one: both hold all of the prompt it shares, and the one sent it last may
    still be computing it (llama.cpp computes it again in a free slot). A conversation's
    later turn does go where the last turn went, its reply with it (the test above)."""
    endpoints = fleet()
    system = {"role": "system", "content": "Rules. " * (ANCHOR_BYTES // 6)}

    def user(i: int) -> PromptKey:
        key = prompt_key(body([system, {"role": "user", "content": f"q{i}"}]), "prefix")
        assert key is not None
        return key

    home = send(endpoints, user(0)).endpoint
    assert home is not None
    home.in_flight = 6  # past its bound (no engine gauges: no slots to wait for)
    spilled = send(endpoints, user(1)).endpoint
    assert spilled is not None and spilled is not home
    spilled.start(NOW)
    for e in endpoints:
        if e not in (home, spilled):
            e.in_flight = 2  # the others busy, so that the spilled one is within its bound
    home.in_flight = 0
    back = send(endpoints, user(2))
    assert back.endpoint is home, back.reason
    assert back.affinity is not None and back.affinity.held == spilled.prefix.held(user(2).blocks)


def test_a_turn_stays_past_its_bound_while_its_replica_has_a_free_slot() -> None:
    """Four replicas, the conversation's with one request of two slots busy, the rest
    idle: past 1.5 times its share (one of the two in flight), but a free slot starts
    the turn at once, where moving computes its whole prompt again; with both slots
    busy it moves."""
    endpoints, turns, home = homed(8, 3)
    for e in endpoints:
        e.load, e.load_at = LoadSignals(running=0, waiting=0, slots=2), NOW
    home.in_flight = home.in_flight_at_load = 1
    home.load = LoadSignals(running=1, waiting=0, slots=2)
    kept = send(endpoints, turns[1])
    assert kept.endpoint is home and not kept.affinity.overruled  # type: ignore[union-attr]
    assert kept.affinity.route == "held"  # type: ignore[union-attr]
    home.in_flight = home.in_flight_at_load = 2
    home.load = LoadSignals(running=2, waiting=0, slots=2)
    moved = send(endpoints, turns[2])
    assert moved.endpoint is not home and moved.affinity.overruled  # type: ignore[union-attr]
    # the access log's word for it: its slots free later than computing it elsewhere
    assert moved.affinity.route == "spill:wait", moved.reason  # type: ignore[union-attr]


def test_a_turn_waits_for_a_slot_while_that_is_shorter_than_computing_it_again() -> None:
    """Both of its replica's slots busy, the others idle: the bound moves the turn (the
    test above) until the replica's replies have said how fast it works. Where a slot
    frees in a second and the ~2,000 tokens it holds of the conversation take seven
    seconds to compute (a CPU), it waits, up to a queue as long as that prefill;
    where a slot is held for twenty seconds and the prefill takes a fifth of one (a GPU
    with long replies), it moves."""
    endpoints, turns, home = homed(8, 3)
    for e in endpoints:
        e.load, e.load_at = LoadSignals(running=0, waiting=0, slots=2), NOW

    def busy(n: int) -> None:
        home.in_flight = home.in_flight_at_load = n
        home.load = LoadSignals(running=min(n, 2), waiting=max(0, n - 2), slots=2)

    def taught(prompt_ms: float, predicted_ms: float) -> None:
        home.pace = Pace()
        for _ in range(READINGS):  # replies that computed 1,000 tokens of 1,400 bytes
            home.pace.observe(Timings(1000, prompt_ms, predicted_ms), 1000, 1400)

    def where(key: PromptKey) -> Choice:  # as ``send``, but nothing recorded
        return choose(endpoints, NOW, admission=OPEN, key=key)

    busy(2)
    assert where(turns[1]).endpoint is not home  # nothing said yet: it moves
    taught(prompt_ms=3500.0, predicted_ms=500.0)  # 3.5 ms a token; a slot frees in 4 s
    held = home.prefix.held(turns[1].blocks)
    saved = home.pace.saved_s(held_bytes(held, turns[1].size, home.prefix.kept))
    assert 6.0 < saved < 9.0, saved  # ~2,000 tokens at 3.5 ms
    kept = where(turns[1])
    assert kept.endpoint is home and not kept.affinity.overruled  # type: ignore[union-attr]
    # it waits while the queue ahead frees within twice that (its own wait, and the
    # fleet's time a move would take): 2 slots of 4 s each, one freeing every 2 s
    queue = math.floor(FLEET * saved * 2 / home.pace.slot_s)
    assert 4 <= queue <= 8, queue
    busy(2 + queue - 1)
    assert where(turns[1]).endpoint is home
    busy(2 + queue)
    moved = where(turns[2])
    assert moved.endpoint is not home and moved.affinity.overruled  # type: ignore[union-attr]
    # a replica whose replies said they reused little of what the index held (it evicted
    # them, or ran them in another slot) is not waited for as if it held them
    busy(3)
    assert where(turns[1]).endpoint is home
    for _ in range(8):
        home.prefix.observe(held, len(turns[1].blocks), Reading(40, 2000), turns[1].size)
    assert home.prefix.held(turns[1].blocks) == held and home.prefix.kept < 0.25
    assert where(turns[1]).endpoint is not home
    # a GPU's pace: prefill at 0.1 ms a token, a slot held 20 s by a long reply
    endpoints, turns, home = homed(9, 2)
    for e in endpoints:
        e.load, e.load_at = LoadSignals(running=0, waiting=0, slots=2), NOW
    taught(prompt_ms=100.0, predicted_ms=20000.0)
    busy(2)
    shared = held_bytes(home.prefix.held(turns[1].blocks), turns[1].size, home.prefix.kept)
    assert home.pace.patience(shared, 2) == 0
    assert where(turns[1]).endpoint is not home


def test_a_turn_waits_longer_for_its_replica_when_the_others_are_busy_too() -> None:
    """Past the queue its prefill is worth, a turn moves while the other replicas have
    a slot free (the test above). Where every other replica has both slots busy and
    two waiting, a move would wait there too, and compute the prompt again after: the
    turn waits at home for as long again (to ``QUEUE_PER_SLOT``)."""
    endpoints, turns, home = homed(8, 3)

    def busy(e: Endpoint, n: int) -> None:
        e.in_flight = e.in_flight_at_load = n
        e.load = LoadSignals(running=min(n, 2), waiting=max(0, n - 2), slots=2)
        e.load_at = NOW

    for e in endpoints:
        busy(e, 0)
        for _ in range(READINGS):  # 3.5 ms a token; a slot frees in 4 s
            e.pace.observe(Timings(1000, 3500.0, 500.0), 1000, 1400)
    shared = held_bytes(home.prefix.held(turns[1].blocks), turns[1].size, home.prefix.kept)
    queue = home.pace.patience(shared, 2)
    assert 4 <= queue < QUEUE_PER_SLOT * 2, queue
    busy(home, 2 + queue)
    moved = choose(endpoints, NOW, admission=OPEN, key=turns[1])
    assert moved.endpoint is not home and moved.affinity.overruled  # type: ignore[union-attr]
    for e in endpoints:
        if e is not home:
            busy(e, 4)
    stays = choose(endpoints, NOW, admission=OPEN, key=turns[1])
    assert stays.endpoint is home, stays.reason
    busy(home, 2 + QUEUE_PER_SLOT * 2)  # the bound on patience still holds
    assert choose(endpoints, NOW, admission=OPEN, key=turns[1]).endpoint is not home


def test_a_replica_not_yet_paced_waits_as_its_models_other_replicas_say() -> None:
    """A replica that has not said its pace (a new one, or every one in a fleet's first
    seconds) is given its model's other replicas' pace: a turn waits for its slot as
    long as theirs say it is worth, rather than moving at once."""
    endpoints, turns, home = homed(8, 3)
    for e in endpoints:
        e.load, e.load_at = LoadSignals(running=0, waiting=0, slots=2), NOW
    home.in_flight = home.in_flight_at_load = 3
    home.load = LoadSignals(running=2, waiting=1, slots=2)
    moved = choose(endpoints, NOW, admission=OPEN, key=turns[1])
    assert moved.endpoint is not home  # none has said its pace: the bound alone
    for e in endpoints:
        if e is not home:
            for _ in range(READINGS):  # 3.5 ms a token; a slot frees in 4 s
                e.pace.observe(Timings(1000, 3500.0, 500.0), 1000, 1400)
    assert not home.pace.known
    stays = choose(endpoints, NOW, admission=OPEN, key=turns[1])
    assert stays.endpoint is home, stays.reason


def test_patience_is_bounded_so_that_a_hot_prompt_still_spreads() -> None:
    """However slow the prefill against the slot time, a replica takes at most
    ``QUEUE_PER_SLOT`` waiting requests per slot of a prompt it holds; the next goes on
    down the order."""
    endpoints = fleet()
    for e in endpoints:
        e.load, e.load_at = LoadSignals(running=0, waiting=0, slots=2), NOW
        for _ in range(READINGS):  # 100 ms a prompt token, a slot free every second
            e.pace.observe(Timings(1000, 100_000.0, 0.0), 1000, 4000)
    system = {"role": "system", "content": "Rules. " * 2000}  # 14 KB: ~6 min to compute
    key = prompt_key(body([system, {"role": "user", "content": "q"}]), "prefix")
    assert key is not None
    home = send(endpoints, key).endpoint
    assert home is not None
    shared = held_bytes(home.prefix.held(key.blocks), key.size, home.prefix.kept)
    assert home.pace.patience(shared, 2) == QUEUE_PER_SLOT * 2
    home.in_flight = home.in_flight_at_load = 2 + QUEUE_PER_SLOT * 2 - 1
    home.load = LoadSignals(running=2, waiting=QUEUE_PER_SLOT * 2 - 1, slots=2)
    assert choose(endpoints, NOW, admission=OPEN, key=key).endpoint is home
    home.in_flight = home.in_flight_at_load = 2 + QUEUE_PER_SLOT * 2
    home.load = LoadSignals(running=2, waiting=QUEUE_PER_SLOT * 2, slots=2)
    assert choose(endpoints, NOW, admission=OPEN, key=key).endpoint is not home


def popular_prompt() -> tuple[list[Endpoint], list[PromptKey], Endpoint, int]:
    """Four paced replicas with two slots each; one holds a long system prompt (sent
    it by its first user) and has three requests on it. Returns the replicas, four
    users' keys behind that prompt, the replica holding it and the blocks it holds."""
    endpoints = fleet()
    for e in endpoints:
        e.load, e.load_at = LoadSignals(running=0, waiting=0, slots=2), NOW
        for _ in range(READINGS):  # 3.5 ms a token; a slot frees in 4 s
            e.pace.observe(Timings(1000, 3500.0, 500.0), 1000, 1400)
    system = {"role": "system", "content": "Rules. " * 400}
    keys = [
        prompt_key(body([system, {"role": "user", "content": f"question {i}"}]), "prefix")
        for i in range(4)
    ]
    assert all(k is not None for k in keys)
    home = send(endpoints, keys[0]).endpoint  # type: ignore[arg-type]
    assert home is not None
    held = home.prefix.held(keys[1].blocks)  # type: ignore[union-attr]
    home.in_flight = home.in_flight_at_load = 3
    home.load = LoadSignals(running=2, waiting=1, slots=2)
    return endpoints, keys, home, held  # type: ignore[return-value]


def fill(home: Endpoint, keys: list[PromptKey], held: int) -> None:
    """Two of the prompt's own requests in ``home``'s two slots."""
    for k in keys[2:]:
        home.computing.enter(k.blocks, held, NOW, streamed=True, slots=2)


def test_a_prompt_whose_own_requests_fill_its_replica_spreads_past_the_bound() -> None:
    """Patience waits for a replica's other work to drain. Where the requests filling
    its slots are the prompt's own (users behind one popular system prompt), its queue
    never drains by waiting: past the load bound, the prompt goes to a second replica
    (and computes it there once), where the same queue of other prompts' requests
    would have kept it home."""
    endpoints, keys, home, held = popular_prompt()
    assert held and home.pace.patience(held_bytes(held, keys[1].size, 1.0), 2) >= 2
    # three of other prompts ahead: it waits
    assert choose(endpoints, NOW, admission=OPEN, key=keys[1]).endpoint is home
    # two of its own among them, in the two slots: it spreads
    fill(home, keys, held)
    moved = choose(endpoints, NOW, admission=OPEN, key=keys[1])
    assert moved.endpoint is not home and moved.affinity.overruled  # type: ignore[union-attr]
    assert moved.affinity.route == "spill:full", moved.reason  # type: ignore[union-attr]
    assert "its slots full of this prompt's requests" in moved.reason


def test_the_only_router_spills_to_the_least_loaded_of_those_holding_none_of_it() -> None:
    """A popular prompt's replica is full of its own requests, and the prompt spreads.
    Where several routers share the fleet, each sends it on down the spill key's
    rendezvous order, which they all compute alike, to a replica within its share even
    if another is idler. The fleet's only router sends it to the least loaded of those
    holding none of it: in the benchmark's shared system prompts, a spill by rendezvous
    landed on a replica already computing another prompt, and the requests queued
    behind both met their TTFT SLO less often (see ``llmgw.router.affinity``)."""
    endpoints, keys, home, held = popular_prompt()
    fill(home, keys, held)
    by_rendezvous = choose(endpoints, NOW, admission=OPEN, key=keys[1]).endpoint
    assert by_rendezvous is not home and by_rendezvous is not None
    by_rendezvous.in_flight = 1  # busier than the other two, within its share
    several = choose(endpoints, NOW, admission=OPEN, key=keys[1])
    assert several.endpoint is by_rendezvous, several.reason
    only = choose(endpoints, NOW, admission=OPEN, key=keys[1], only=True)
    assert only.endpoint not in (home, by_rendezvous), only.reason
    assert only.affinity is not None and only.affinity.route == "spill:full", only.reason


def test_new_conversations_are_placed_evenly_by_the_only_router() -> None:
    """Sixteen conversations started one after another on an idle fleet of four: their
    anchors' rendezvous winners split them unevenly (these seeds: 5/5/3/3), and a
    replica given more conversations than its cache holds evicts them. Where this
    router is the only one (``only``), each goes to its first choice among the replicas
    with room for an even share of the recent ones: four each, and their later turns
    follow. Where several routers are (not ``only``), rendezvous alone, which every
    router computes alike."""
    seeds = range(100, 116)
    firsts = [prompt_key(body(conversation(seed, 2)[0]), "prefix") for seed in seeds]
    seconds = [prompt_key(body(conversation(seed, 2)[1]), "prefix") for seed in seeds]
    several = fleet()
    split = Counter(send(several, key).endpoint.key for key in firsts)  # type: ignore[arg-type, union-attr]
    assert sorted(split.values()) == [3, 3, 5, 5], split
    only = fleet()
    homes = [send(only, key, only=True) for key in firsts]  # type: ignore[arg-type]
    spread = Counter(c.endpoint.key for c in homes)  # type: ignore[union-attr]
    assert sorted(spread.values()) == [4, 4, 4, 4], spread
    # the next sixteen: a replica whose early conversations' counts had decayed was
    # below the ceiling of an even share and took a fifth (3/4/4/5); within half a
    # conversation of the fewest, it does not
    again = fleet()
    keys = [prompt_key(body(conversation(seed, 2)[0]), "prefix") for seed in range(116, 132)]
    went = Counter(send(again, key, only=True).endpoint.key for key in keys)  # type: ignore[arg-type, union-attr]
    assert sorted(went.values()) == [4, 4, 4, 4], went
    assert all(c.affinity is not None and not c.affinity.overruled for c in homes)
    assert any(c.affinity.why.endswith("of those with room for one") for c in homes)  # type: ignore[union-attr]
    assert {c.affinity.route for c in homes} == {"even"}  # type: ignore[union-attr]
    for home, key in zip(homes, seconds, strict=True):
        later = send(only, key, only=True)  # type: ignore[arg-type]
        assert later.endpoint is home.endpoint and not later.affinity.new  # type: ignore[union-attr]
    # the counts are of the recent ones: a replica that joins takes its share from now
    only.append(ep("r4"))
    more = [prompt_key(body(conversation(seed, 1)[0]), "prefix") for seed in range(200, 210)]
    went = Counter(send(only, key, only=True).endpoint.key for key in more)  # type: ignore[arg-type, union-attr]
    assert 2 <= went["r4"] <= 6, went  # not none, nor every one


def test_a_new_conversation_goes_to_a_replica_with_room_only_while_within_its_share() -> None:
    """The replicas that have had the fewest of the recent conversations are busier
    than their share, the others idle: the new conversation goes to an idle one, as by
    load alone (sent to one with room while within the bound later turns have, a new
    prompt waited for a busy replica's prefill while another stood idle, and on
    prompts that nothing shares the TTFT p95 was 1.07-1.10x by load's). Once a replica
    with room is within its share, it goes there."""
    endpoints = fleet()
    for e, placed_here, busy in zip(endpoints, (3.0, 3.0, 2.0, 2.0), (0, 0, 2, 1), strict=True):
        e.prefix.placed, e.in_flight = placed_here, busy
    key = prompt_key(body(conversation(300, 1)[0]), "prefix")
    assert key is not None
    choice = choose(endpoints, NOW, admission=OPEN, key=key, only=True)
    assert choice.endpoint in endpoints[:2] and choice.affinity.new  # type: ignore[union-attr]
    endpoints[0].in_flight = endpoints[1].in_flight = 1  # r3 is within its share now
    assert choose(endpoints, NOW, admission=OPEN, key=key, only=True).endpoint is endpoints[3]


def user(system: str, question: int) -> PromptKey:
    """A user's first turn behind a long shared system prompt (its two full blocks)."""
    messages = [
        {"role": "system", "content": f"{system} " * (ANCHOR_BYTES // 6)},
        {"role": "user", "content": f"q{question} " * 100},
    ]
    key = prompt_key(body(messages), "prefix")
    assert key is not None
    return key


def test_new_prompts_are_placed_by_the_work_their_replicas_took() -> None:
    """Every first turn counts where it went by the share of its prompt that replica
    computes: a new prompt the whole, another user of a held system prompt the rest.
    The replica taking a popular prompt's users has had more than its share of the
    recent work, and a new prompt goes past it (counted only when new, it had had one
    prompt as the others had, and took a second prompt's users on top of the popular
    one's: busy 1.40x the mean in the benchmark's shared workload); but it has had less
    work than a replica that computed as many new prompts as it took users (counted by
    request, new prompts piled on the replicas without a popular one: 1.53x)."""
    endpoints = fleet()
    home = send(endpoints, user("Popular", 0), only=True).endpoint
    assert home is not None
    others = iter(f"Rules{i}" for i in range(1000))
    while min(e.prefix.placed for e in endpoints) == 0:  # a prompt on each of the others
        send(endpoints, user(next(others), 0), only=True)
    for question in range(1, 7):  # the popular prompt's users, each where it is held
        went = send(endpoints, user("Popular", question), only=True)
        assert went.endpoint is home and went.affinity is not None and not went.affinity.new
        assert 0.1 < went.affinity.work < 0.5, went.affinity.work  # the question's part
    # a new prompt whose first choice is the popular prompt's replica
    system = next(
        name
        for name in others
        if choose(fleet(), NOW, admission=OPEN, key=user(name, 0)).endpoint.key == home.key  # type: ignore[union-attr]
    )
    new = send(endpoints, user(system, 0), only=True)
    assert new.affinity is not None and new.affinity.new and new.affinity.work == 1.0
    assert new.endpoint is not home

    # the others computed three new prompts each; the popular one's replica one, and
    # three users' questions: a new prompt goes there
    endpoints = fleet()
    for e in endpoints[1:]:
        e.prefix.placed = 3.0
    home = send(endpoints, user("Popular", 0), only=True).endpoint
    assert home is endpoints[0]
    for question in range(1, 4):
        send(endpoints, user("Popular", question), only=True)
    assert home.prefix.placed < 2.5 < min(e.prefix.placed for e in endpoints[1:])
    assert send(endpoints, user(next(others), 0), only=True).endpoint is home


def test_the_load_bound_keeps_a_hot_prompt_from_taking_everything() -> None:
    endpoints = fleet()
    system = {"role": "system", "content": "Rules. " * (ANCHOR_BYTES // 6)}
    for i in range(40):  # 40 at once behind one long system prompt
        key = prompt_key(body([system, {"role": "user", "content": f"q{i}"}]), "prefix")
        assert key is not None
        choice = send(endpoints, key)
        choice.endpoint.start(NOW)  # type: ignore[union-attr]
    loads = sorted(e.in_flight for e in endpoints)
    assert sum(loads) == 40 and loads[-1] <= math.ceil(1.5 * 40 / 4), loads
    # a tighter bound, tighter loads
    for e in endpoints:
        e.in_flight, e.affinity_bound = 0, 1.0
    for i in range(40):
        key = prompt_key(body([system, {"role": "user", "content": f"q{i}"}]), "prefix")
        send(endpoints, key).endpoint.start(NOW)  # type: ignore[arg-type, union-attr]
    assert sorted(e.in_flight for e in endpoints) == [10, 10, 10, 10]


def test_a_session_hint_pulls_a_users_requests_together() -> None:
    endpoints = fleet()
    where = {
        send(endpoints, prompt_key(body(conversation(s, 1)[0], user="bob"), "prefix")).endpoint  # type: ignore[arg-type]
        for s in range(10)
    }
    assert len(where) == 1


def test_replicas_with_affinity_off_are_chosen_by_load_alone() -> None:
    endpoints = [ep("a", affinity="off"), ep("b", affinity="off", in_flight=1)]
    key = prompt_key(body(conversation(1, 1)[0]), "prefix")
    choice = choose(endpoints, NOW, admission=OPEN, key=key)
    assert choice.endpoint is endpoints[0] and choice.affinity is None


# --- with affinity off, the choice is exactly today's --------------------------------------


def choose_before(
    endpoints: Sequence[Endpoint],
    now: float,
    *,
    admission: Admission,
    stale_after_s: float = 5.0,
    exclude: frozenset[str] = frozenset(),
    model: str | None = None,
    rng_value: float | None = None,
) -> Choice:
    """``balancer.choose`` as it was before affinity, verbatim."""
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

    if admissible:
        best = min(s for s, _, _ in admissible)
        tied = sorted(
            (entry for entry in admissible if entry[0] <= best + 1e-9),
            key=lambda entry: entry[1].key,
        )
        r = random.random() if rng_value is None else rng_value
        index = min(int(r * len(tied)), len(tied) - 1)
        value, endpoint, load = tied[index]
        return Choice(endpoint, f"least loaded: {_describe(endpoint, load, now, value)}")
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


_replica = st.fixed_dictionaries(
    {
        "in_flight": st.integers(0, 6),
        "ready": st.booleans(),
        "draining": st.booleans(),
        "weight": st.sampled_from([0.5, 1.0, 2.0]),
        "faults": st.integers(0, 6),
        "waiting": st.none() | st.integers(0, 8),
        "running": st.none() | st.integers(0, 8),
        "kv": st.none() | st.floats(0, 1),
        "age": st.sampled_from([None, 1.0, 30.0]),
        "own": st.booleans(),  # thresholds of its own
    }
)


def _world(spec: list[dict[str, object]], affinity: str) -> list[Endpoint]:
    out = []
    for i, s in enumerate(spec):
        breaker = Breaker(failure_threshold=3, cooldown_s=10)
        for _ in range(int(s["faults"])):  # type: ignore[call-overload]
            breaker.on_upstream_fault(NOW - 5)
        load = None
        if s["age"] is not None:
            load = LoadSignals(waiting=s["waiting"], running=s["running"], kv_usage=s["kv"])  # type: ignore[arg-type]
        out.append(
            ep(
                f"r{i}",
                in_flight=s["in_flight"],
                ready=s["ready"],
                draining=s["draining"],
                weight=s["weight"],
                breaker=breaker,
                load=load,
                load_at=None if s["age"] is None else NOW - s["age"],  # type: ignore[operator]
                admission=Admission(target_waiting=2) if s["own"] else None,
                affinity=affinity,
            )
        )
    return out


def _said(c: Choice) -> tuple[object, ...]:
    return (None if c.endpoint is None else c.endpoint.key, c.reason, c.shed, c.panic, c.retry_after_s)  # fmt: skip


def _same(a: Choice, b: Choice) -> bool:
    return _said(a) == _said(b) and b.affinity is None


@settings(max_examples=300, deadline=None)
@given(
    spec=st.lists(_replica, min_size=0, max_size=5),
    exclude=st.sets(st.sampled_from(["r0", "r1", "r2"])),
    rng=st.floats(0, 0.999),
    strict=st.booleans(),
)
def test_with_affinity_off_the_choice_is_exactly_the_one_before(
    spec: list[dict[str, object]], exclude: set[str], rng: float, strict: bool
) -> None:
    admission = Admission(target_waiting=3, kv_ceiling=0.8) if strict else OPEN
    key = prompt_key(body(conversation(1, 2)[1]), "prefix")
    before = choose_before(
        _world(spec, "off"), NOW, admission=admission, exclude=frozenset(exclude), rng_value=rng
    )
    # affinity off for the model: the proxy reads no key at all
    plain = choose(
        _world(spec, "prefix"), NOW, admission=admission, exclude=frozenset(exclude), rng_value=rng
    )
    # off on every replica, a key read anyway: still the same
    offs = choose(
        _world(spec, "off"),
        NOW,
        admission=admission,
        exclude=frozenset(exclude),
        rng_value=rng,
        key=key,
    )
    assert _same(before, plain) and _same(before, offs)


@settings(max_examples=300, deadline=None)
@given(
    spec=st.lists(_replica, min_size=1, max_size=5), strict=st.booleans(), seed=st.integers(0, 50)
)
def test_affinity_only_reorders_the_replicas_the_balancer_allows(
    spec: list[dict[str, object]], strict: bool, seed: int
) -> None:
    """Whatever the fleet: affinity on picks among the replicas the old choice would
    have picked among (the admissible ones), sheds, panics and refuses exactly when it
    did, and its pick is within the load bound of the candidates' mean."""
    admission = Admission(target_waiting=3, kv_ceiling=0.8) if strict else OPEN
    key = prompt_key(body(conversation(seed, 2)[1]), "prefix")
    before = choose_before(_world(spec, "off"), NOW, admission=admission, rng_value=0.0)
    world = _world(spec, "prefix")
    after = choose(world, NOW, admission=admission, key=key)
    assert (after.shed, after.panic, after.endpoint is None) == (
        before.shed,
        before.panic,
        before.endpoint is None,
    )
    if after.affinity is None:
        assert _same(before, after)
        return
    # the admissible ones: those with the old choice's least score among them, or not
    chosen = after.endpoint
    assert chosen is not None and chosen.ready and not chosen.draining
    assert chosen.breaker.state is not BreakerState.OPEN
    load = fresh_load(chosen, NOW, 5.0)
    assert not above_thresholds(load, chosen.admission or admission, chosen)


def test_new_work_is_spread_by_load_and_only_what_is_held_stays_past_its_share() -> None:
    """A first turn goes to its first choice only while that is as little loaded as the
    rest; a later turn stays with the replica that holds it up to its bound (the fleet's
    only router), or goes to its first choice as every router's does (several)."""
    for only in (True, False):
        endpoints = fleet(2)
        first = conversation(3, 2)
        key = prompt_key(body(first[0]), "prefix")
        assert key is not None
        top = choose(endpoints, NOW, admission=OPEN, key=key).endpoint
        assert top is not None
        top.in_flight = 1  # one more than the other: a new conversation goes elsewhere
        spilled = send(endpoints, key, only=only)
        assert spilled.endpoint is not top and spilled.affinity is not None
        assert spilled.affinity.overruled and spilled.affinity.route == "spill:share"
        # its next turn is known where the first went, which may take it past an even
        # share; where several routers are, the others cannot know it
        spilled.endpoint.in_flight = 1  # type: ignore[union-attr]
        top.in_flight = 0
        later = send(endpoints, prompt_key(body(first[1]), "prefix"), only=only)  # type: ignore[arg-type]
        assert later.affinity is not None and not later.affinity.overruled
        assert later.endpoint is (spilled.endpoint if only else top), only


def test_a_cold_router_keeps_a_later_turn_on_its_first_choice_as_a_warm_one_does() -> None:
    """A later turn (it carries an assistant message) stays with its first choice past an
    even share on a router that never saw the conversation too: both agree."""
    warm, cold = fleet(2), fleet(2)
    turns = conversation(4, 2)
    first = prompt_key(body(turns[0]), "prefix")
    later = prompt_key(body(turns[1]), "prefix")
    assert first is not None and later is not None and later.later and not first.later
    home = send(warm, first).endpoint
    assert home is not None
    for fleet_ in (warm, cold):
        [ep_] = [e for e in fleet_ if e.key == home.key]
        ep_.in_flight = 1  # the engine still says the first turn runs
    a, b = send(warm, later), send(cold, later)
    assert a.endpoint is not None and b.endpoint is not None
    assert a.endpoint.key == b.endpoint.key == home.key

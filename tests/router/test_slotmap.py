"""Which slot of a llama.cpp replica the router sends a request to, without a network
(the real engine's side is ``test_affinity_llama``)."""

from __future__ import annotations

from llmgw.engines.base import Timings
from llmgw.router.pace import FLEET, READINGS, Pace
from llmgw.router.prefix import BLOCK_BYTES
from llmgw.router.slotmap import SlotMap
from llmgw.router.usage import lead

P = (11, 12, 13)  # a system prompt's blocks
Q = (31, 32, 33)  # another's
SIZE = 4 * BLOCK_BYTES
UNPACED = Pace()


def paced(slot_s: float, prefill_ms: float) -> Pace:
    """A replica whose replies said a request holds its slot ``slot_s`` and a prompt
    token takes ``prefill_ms`` (4 bytes a token)."""
    pace = Pace()
    timings = Timings(prompt_n=400, prompt_ms=400 * prefill_ms, predicted_ms=0.0)
    for _ in range(READINGS):
        pace.observe(timings, 400, 1600)
    pace.slot_s = slot_s
    return pace


def test_a_prompt_goes_to_the_idle_slot_holding_it_and_new_ones_to_the_least_recent() -> None:
    slots = SlotMap()
    p = slots.choose((*P, 1), 2, UNPACED, SIZE, 1.0)
    q = slots.choose((*Q, 2), 2, UNPACED, SIZE, 1.0)
    assert {p.slot, q.slot} == {0, 1}  # new prompts: the idle slot
    p.end()
    q.end()
    p.end()  # once
    again = slots.choose((*P, 3), 2, UNPACED, SIZE, 1.0)
    assert again.slot == p.slot  # where P is, not the least recently used
    again.end()
    new = slots.choose((41, 42), 2, UNPACED, SIZE, 1.0)
    assert new.slot == q.slot  # a prompt none holds: the least recently given slot


def test_a_busy_slot_holding_the_prompt_is_waited_for_rather_than_computed_again() -> None:
    """The shape llama-server gets wrong by itself: P generating in one slot, Q in the
    other, and a request of each waiting. Each goes to the slot holding its prompt."""
    slots = SlotMap()
    q1 = slots.choose((*Q, 1), 2, UNPACED, SIZE, 1.0)
    p1 = slots.choose((*P, 2), 2, UNPACED, SIZE, 1.0)
    p2 = slots.choose((*P, 3), 2, UNPACED, SIZE, 1.0)
    q2 = slots.choose((*Q, 4), 2, UNPACED, SIZE, 1.0)
    assert (p2.slot, q2.slot) == (p1.slot, q1.slot)
    # not paced: no more than one more ahead of it than in the other slot
    more = [slots.choose((*P, 5 + i), 2, UNPACED, SIZE, 1.0) for i in range(3)]
    # two, then three ahead at P's slot, two at Q's; then four: P is computed again
    assert [m.slot for m in more] == [p1.slot, p1.slot, q1.slot]


def test_how_long_a_busy_slot_is_waited_for_is_what_computing_it_again_costs() -> None:
    """Paced: a slot frees in ``slot_s``, and computing the prompt again costs FLEET
    times its prefill; the request waits for P's slot while the requests ahead there
    take no longer than that plus the wait at the other slot."""
    held = 3.5 * BLOCK_BYTES  # what P's slot holds of a 4-block prompt, by the estimate
    again_s = held / 4 * 2.0 / 1e3  # 4 bytes a token, 2 ms a token
    for slot_s, waits in ((0.2, int(FLEET * again_s / 0.2)), (5.0, 0)):
        slots = SlotMap()
        pace = paced(slot_s, 2.0)
        p = slots.choose((*P, 1), 2, pace, SIZE, 1.0)
        other = slots.choose((51, 52), 2, pace, SIZE, 1.0)
        other.end()  # the other slot idle: only P's queue counts
        sent = [slots.choose((*P, 2 + i), 2, pace, SIZE, 1.0) for i in range(waits + 1)]
        assert [s.slot for s in sent[:waits]] == [p.slot] * waits, slot_s
        assert sent[waits].slot != p.slot, (slot_s, waits)


def test_a_slot_count_that_changes_starts_the_map_again() -> None:
    slots = SlotMap()
    slots.choose(P, 2, UNPACED, SIZE, 1.0)
    pins = [slots.choose((60 + i,), 3, UNPACED, SIZE, 1.0) for i in range(3)]
    assert sorted(p.slot for p in pins) == [0, 1, 2]  # new prompts: one each, least busy


def test_the_slot_goes_first_in_the_body_and_a_clients_own_still_wins() -> None:
    assert lead(b'{"model":"m"}', b'"id_slot":1,') == b'{"id_slot":1,"model":"m"}'
    assert lead(b" { }", b'"id_slot":1,') == b" { }"  # no members: as it came
    assert lead(b"[1]", b'"id_slot":1,') == b"[1]"

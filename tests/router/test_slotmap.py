"""Which slot of a llama.cpp replica the router sends a request to, without a network
(the real engine's side is ``test_affinity_llama``)."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.router.slotmap import Pin, SlotMap
from llmgw.router.usage import lead


class Clocked(SlotMap):
    """A slot map whose requests are sent a second apart."""

    now = 0.0

    def choose_at(
        self,
        blocks: tuple[int, ...],
        slots: int,
        *,
        again: bool = False,
        awaited: Callable[[tuple[int, ...]], bool] = lambda _: False,
    ) -> Pin:
        self.now += 1.0
        return self.choose(blocks, slots, self.now, again=again, awaited=awaited)


P = (11, 12, 13)  # a system prompt's blocks
Q = (31, 32, 33)  # another's


def test_a_prompt_goes_to_the_slot_holding_it_and_new_ones_to_the_least_recent() -> None:
    slots = Clocked()
    p = slots.choose_at((*P, 1), 2)
    q = slots.choose_at((*Q, 2), 2)
    assert {p.slot, q.slot} == {0, 1} and p.outcome == q.outcome == "new"
    p.end()
    q.end()
    p.end()  # once
    again = slots.choose_at((*P, 3), 2)
    assert (again.slot, again.outcome) == (p.slot, "idle")  # not the least recently used
    again.end()
    new = slots.choose_at((41, 42), 2)
    assert new.slot == q.slot  # a prompt none holds: the least recently given slot


def test_a_request_the_router_let_go_takes_the_slot_holding_its_prompt_not_the_first_free() -> None:
    """The shape llama-server gets wrong by itself: P generating in one slot, Q in the
    other, and a request of each queued. Each goes to the slot holding its prompt,
    however the two free."""
    slots = Clocked()
    q1 = slots.choose_at((*Q, 1), 2)
    p1 = slots.choose_at((*P, 2), 2)
    p2 = slots.choose_at((*P, 3), 2)
    q2 = slots.choose_at((*Q, 4), 2)
    assert (p2.slot, q2.slot) == (p1.slot, q1.slot) and p2.outcome == q2.outcome == "waits"


def test_a_request_that_would_not_wait_goes_to_the_least_busy_slot() -> None:
    """The router would not wait for P's slot (``again``): the least busy slot takes
    it, computing P again, unless P's is as little busy."""
    slots = Clocked()
    p1 = slots.choose_at((*P, 1), 2)
    q1 = slots.choose_at((*Q, 2), 2)
    p2 = slots.choose_at((*P, 3), 2)  # P's slot: two
    q1.end()  # Q's slot idle
    p3 = slots.choose_at((*P, 4), 2, again=True)
    assert (p3.slot, p3.outcome) == (q1.slot, "again")
    p1.end()
    p2.end()  # P in both now, P's first slot idle, the other busy
    p4 = slots.choose_at((*P, 5), 2, again=True)
    assert (p4.slot, p4.outcome) == (p1.slot, "idle")


def test_a_request_that_gave_up_waiting_with_no_slot_idle_waits_for_its_prompts_slot() -> None:
    """The router gave up waiting for P's slot (``again``) and every slot is busy: the
    request waits in the engine either way, so it waits for P's slot, not for whichever
    frees first, where it would compute P again."""
    slots = Clocked()
    p1 = slots.choose_at((*P, 1), 2)
    q1 = slots.choose_at((*Q, 2), 2)
    p2 = slots.choose_at((*P, 3), 2, again=True)
    assert (p2.slot, p2.outcome) == (p1.slot, "waits")
    q1.end()  # Q's slot frees first: P's request is not the engine's to place there
    q2 = slots.choose_at((*Q, 4), 2)
    assert (q2.slot, q2.outcome) == (q1.slot, "idle")


def test_with_every_slot_busy_a_new_prompt_goes_to_the_first_to_free_unless_one_is_awaited() -> (
    None
):
    """Every slot busy: a new prompt's request names no slot (the engine gives it the
    first to free, and the map follows: it takes the first slot that frees with
    nothing else sent to it); but while a request in the router waits for one slot's
    prompt, it goes to the other, so as not to take the waited slot as it frees."""
    slots = Clocked()
    p1 = slots.choose_at((*P, 1), 2)
    q1 = slots.choose_at((*Q, 2), 2)
    r1 = slots.choose_at((71, 72), 2)
    assert (r1.slot, r1.outcome) == (None, "first")
    q1.end()  # Q's slot frees first: the engine gives it to R
    assert r1.slot == q1.slot
    q2 = slots.choose_at((*Q, 3), 2)
    assert (q2.slot, q2.outcome) == (None, "first")  # Q's slot holds R now, none idle
    r1.end()
    assert q2.slot == q1.slot  # it took R's slot as it freed
    q2.end()
    waited = set(P)  # a request in the router waits for P's slot
    s1 = slots.choose_at((81, 82), 2, awaited=lambda blocks: bool(waited & set(blocks)))
    assert s1.slot == q1.slot != p1.slot and s1.outcome == "new"
    left = slots.choose_at((91, 92), 2)  # every slot busy again: the engine's first
    left.end()  # its client left before a slot freed: out of the engine's line
    s1.end()
    assert left.slot is None


def test_a_slot_count_that_changes_starts_the_map_again() -> None:
    slots = Clocked()
    slots.choose_at(P, 2)
    pins = [slots.choose_at((60 + i,), 3) for i in range(3)]
    assert sorted(p.slot for p in pins) == [0, 1, 2]  # new prompts: one each, least busy


def test_the_slot_goes_first_in_the_body_and_a_clients_own_still_wins() -> None:
    assert lead(b'{"model":"m"}', b'"id_slot":1,') == b'{"id_slot":1,"model":"m"}'
    assert lead(b" { }", b'"id_slot":1,') == b" { }"  # no members: as it came
    assert lead(b"[1]", b'"id_slot":1,') == b"[1]"

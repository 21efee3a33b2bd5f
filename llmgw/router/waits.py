"""The wait of a request for a slot holding its prompt to come free: the clock's side of
``llmgw.router.computing``, whose module docstring says when a request waits and for
how long."""

from __future__ import annotations

import trio

from llmgw.router.computing import Computing, Entry

WAIT_S = 30.0  # the longest a request waits for a copy of its prompt to come free


async def _change(computing: Computing) -> None:
    """Until a request in flight there ends or has its first token, or one waiting goes."""
    event = trio.Event()
    computing.on_change(event.set)
    await event.wait()


async def enter(
    computing: Computing,
    blocks: tuple[int, ...],
    held: int,
    budget_s: float,
    *,
    streamed: bool,
    slots: int,
) -> tuple[Entry, float, bool]:
    """Wait while every copy of the held part is busy, or an earlier request waits for
    one, as the module docstring bounds it (``budget_s``: what computing the held part
    again would cost, by the replica's pace; 0: not known), then go. Returns the
    request's entry, how long it waited and whether it found a copy idle."""
    start = trio.current_time()
    deadline = start + (min(WAIT_S, budget_s) if budget_s > 0 else WAIT_S)
    waited = False
    line = computing.line(blocks[held - 1]) if held else None
    ticket = object()
    if line is not None:
        line.append(ticket)
    try:
        while (users := computing.busy(blocks, held)) is not None or (
            line and line[0] is not ticket
        ):
            until = deadline
            if users and budget_s <= 0:  # unpaced: by the first in flight's time to its first token
                oldest = min(users, key=lambda e: e.sent_at)
                if not oldest.streamed:
                    break
                if oldest.first:
                    until = min(until, oldest.first_at + (oldest.first_at - oldest.sent_at))
            if trio.current_time() >= until:
                break
            waited = True
            with trio.move_on_at(until):
                await _change(computing)
    finally:
        if line is not None:
            computing.out_of_line(blocks[held - 1], ticket)
    now = trio.current_time()
    idle = computing.busy(blocks, held) is None
    entry = computing.enter(blocks, held, now, streamed=streamed, slots=slots)
    return entry, now - start if waited else 0.0, idle

"""Waiting for a replica to compute a prompt it is computing already, without a network:
whose blocks are whose, and how long a request waits by what is known of the replica's
pace (the real engine's side is ``test_affinity_llama``)."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.router.computing import WAIT_S, Computation, Computing, wait

BLOCKS = (11, 12, 13, 14)


def test_a_request_computes_only_the_blocks_no_one_holds_or_computes() -> None:
    computing = Computing()
    first = computing.begin(BLOCKS[:3], 1, 0.0, streamed=True)  # held 11 already
    assert first is not None and first.blocks == (12, 13)
    assert computing.of(BLOCKS, 1) is None  # 11: held and idle, nothing to wait for
    assert computing.of(BLOCKS, 3) is first
    second = computing.begin(BLOCKS, 3, 0.0, streamed=True)  # 12, 13: first's
    assert second is not None and second.blocks == (14,)
    assert computing.of(BLOCKS, 4) is second  # the deepest block's computation
    assert computing.begin(BLOCKS, 4, 0.0, streamed=True) is None
    first.end()
    first.end()  # once
    assert computing.of(BLOCKS, 3) is None and computing.of(BLOCKS, 4) is second
    assert len(computing) == 1
    second.end()
    assert len(computing) == 0


async def test_unpaced_a_request_waits_for_the_first_token_then_as_long_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()
    start = trio.current_time()
    computation = computing.begin(BLOCKS, 0, start, streamed=True)
    assert computation is not None

    async def engine(first_after: float, ends_after: float) -> None:
        await trio.sleep(first_after)
        computation.first_token(trio.current_time())
        await trio.sleep(ends_after)
        computation.end()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine, 3.0, 2.5)  # prefill 3 s, then 2.5 s of tokens
        assert await wait(computation, 0.0)
        assert trio.current_time() - start == 5.5
    # a reply longer than its prefill again: computing it again costs less than that
    computation = computing.begin(BLOCKS, 0, trio.current_time(), streamed=True)
    assert computation is not None
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine, 2.0, 10.0)
        assert not await wait(computation, 0.0)
        assert trio.current_time() - start == 4.0
        nursery.cancel_scope.cancel()


async def test_paced_a_request_waits_at_most_its_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()
    computation = computing.begin(BLOCKS, 0, trio.current_time(), streamed=False)
    assert computation is not None
    start = trio.current_time()
    assert not await wait(computation, 1.5)
    assert trio.current_time() - start == 1.5
    # unpaced and not streamed, no first token to go by: it does not wait
    assert not await wait(computation, 0.0)
    assert trio.current_time() - start == 1.5
    # however slow the pace says the prompt is, never more than WAIT_S
    assert not await wait(computation, 10 * WAIT_S)
    assert trio.current_time() - start == 1.5 + WAIT_S
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_end_after, computation, 0.5)
        assert await wait(computation, 1.5)


async def test_a_request_that_ends_with_no_first_token_lets_its_waiters_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    computing = Computing()
    computation = computing.begin(BLOCKS, 0, trio.current_time(), streamed=True)
    assert computation is not None
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_end_after, computation, 0.5)  # it failed before any token
        assert await wait(computation, 0.0)
    assert trio.current_time() - start == 0.5


async def _end_after(computation: Computation, seconds: float) -> None:
    await trio.sleep(seconds)
    computation.end()

"""Health checks of ready engines: the verdict on a threshold, over a simulated clock;
and the wire's ``healthy`` field, which older peers neither send nor read."""

from __future__ import annotations

import msgspec
import trio

from llmgw.agent.health import HealthSettings, watch
from llmgw.protocol.messages import ShardReport, ShardSpec, ShardStatus


async def run(answers: list[bool | None], settings: HealthSettings) -> list[tuple[bool, str]]:
    """``answers``: each check's outcome in turn; None: it never answers (a hung engine)."""
    changes: list[tuple[bool, str]] = []
    left = list(answers)

    async def check() -> bool:
        answer = left.pop(0)
        if answer is None:
            await trio.sleep_forever()
        return bool(answer)

    await watch(check, lambda: bool(left), settings, lambda ok, why: changes.append((ok, why)))
    return changes


async def test_unhealthy_only_after_enough_checks_in_a_row_and_back_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    s = HealthSettings.every(2.0, 3)
    assert s.timeout_s == 2.0
    # two misses, then an answer: nothing to say; then three hung checks: unhealthy once
    answers: list[bool | None] = [False, False, True, None, None, None, None, True, True]
    changes = await run(answers, s)
    assert changes == [
        (False, "no answer to 3 health checks in a row (2 s apart, 2 s each)"),
        (True, "answers its health check again"),
    ]


async def test_a_check_that_hangs_is_bounded_by_the_interval(
    autojump_clock: trio.abc.Clock,
) -> None:
    s = HealthSettings.every(0.5, 1)
    assert s.timeout_s == 0.5
    start = trio.current_time()
    assert await run([None, None], s) == [
        (False, "no answer to 1 health checks in a row (0.5 s apart, 0.5 s each)")
    ]
    assert trio.current_time() - start <= 2.0  # two checks, each at most interval + timeout


def test_healthy_is_omitted_on_the_wire_when_true_and_defaults_to_true() -> None:
    spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", engine="llama.cpp")
    assert b"healthy" not in msgspec.msgpack.encode(ShardStatus(shard_id="s", state="ready"))
    old = msgspec.msgpack.encode(ShardReport(spec=spec, state="ready"))
    assert msgspec.msgpack.decode(old, type=ShardReport).healthy is True
    sick = ShardStatus(shard_id="s", state="ready", healthy=False)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sick), type=ShardStatus) == sick

"""A node's weights budget, through the real fetcher against the hub stand-in: the
weights unused for longest go to make room, never one in use or being fetched,
and a fetch that cannot fit fails with the one line an operator reads."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw.weights.budget import Budget, Held, plan_room
from llmgw.weights.errors import NoRoom
from llmgw.weights.fetch import fetch
from llmgw.weights.part import Part, commit_path, record_path, sidecars
from llmgw.weights.source import parse_source
from tests.weights.conftest import SIZE, Model, model_file
from tests.weights.test_fetch_limits import tmpfs
from tools.support.hubstandin import HubStandIn

DAY = 86400.0


@pytest.fixture
def models(hub_root: Path) -> dict[str, Model]:
    return {
        name: model_file(hub_root, f"acme/{name}", f"{name}.gguf", seed=seed)
        for seed, name in enumerate("abcx", start=1)
    }


def files(weights: Path) -> list[str]:
    """The names of every file under ``weights``, hidden ones too."""
    return sorted(p.name for p in weights.rglob("*") if p.is_file() or p.is_symlink())


async def land(hub: HubStandIn, m: Model, weights: Path, budget: Budget) -> Path:
    with trio.fail_after(30):
        return await fetch(parse_source(m.source), weights, endpoint=hub.url, budget=budget)


async def test_the_file_unused_for_longest_goes_to_make_room(
    hub: HubStandIn,
    models: dict[str, Model],
    weights: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = Budget(weights, 2 * SIZE + SIZE // 2)  # two files, not three
    a = await land(hub, models["a"], weights, budget)
    b = await land(hub, models["b"], weights, budget)
    now = time.time()
    budget.mark_used(a, at=now - 60)  # an engine started on it a minute ago
    budget.mark_used(b, at=now - DAY)  # and on this one, landed after it, yesterday
    stale = b.with_name("b.gguf.0123456789abcdef.part")  # left by a fetch of another version
    stale.write_bytes(b"x" * 1000)
    assert [h.path for h in budget.held()] == [b, a, stale]  # the .part: by its mtime

    caplog.set_level(logging.INFO, "llmgw.weights")
    c = await land(hub, models["c"], weights, budget)

    assert c.read_bytes() == models["c"].data
    assert not b.exists()
    # with everything kept about it, and its stale .part
    assert [p for p in [*sidecars(b), stale] if p.exists()] == []
    assert a.read_bytes() == models["a"].data
    assert record_path(a).exists() and commit_path(a).exists()
    assert [h.path for h in budget.held()] == [a, c]
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted")]
    day_ago = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now - DAY))
    assert said == (
        f"evicted {b} (3.0 MiB, last used {day_ago}) from {weights}: room for c.gguf"
        " within its budget of 7.5 MiB"
    )


async def test_a_file_in_use_is_never_evicted_and_a_fetch_that_cannot_fit_says_so(
    hub: HubStandIn, models: dict[str, Model], weights: Path
) -> None:
    budget = Budget(weights, 2 * SIZE + SIZE // 2)
    a = await land(hub, models["a"], weights, budget)
    b = await land(hub, models["b"], weights, budget)
    budget.mark_used(a, at=time.time() - DAY)
    budget.set_in_use([a, b])  # both replicas run
    before = files(weights)

    with trio.fail_after(30), pytest.raises(NoRoom) as caught:
        await fetch(parse_source(models["c"].source), weights, endpoint=hub.url, budget=budget)
    assert str(caught.value) == (
        f"no room for c.gguf in {weights} within its budget of 7.5 MiB: 3.0 MiB needed,"
        " 6.0 MiB held by files no fetch may evict; in use or being fetched: a.gguf 3.0 MiB,"
        " b.gguf 3.0 MiB; raise the budget ([weights] budget_gb) or stop a replica using one"
    )
    assert files(weights) == before  # nothing evicted for a fetch that fails anyway
    assert hub.gets("/acme/c/") == []  # and not a byte fetched

    # the oldest in use stays; the other goes
    budget.set_in_use([a])
    c = await land(hub, models["c"], weights, budget)
    assert a.exists() and c.exists() and not b.exists()


async def test_the_bytes_of_a_fetch_in_flight_count(
    hub: HubStandIn, models: dict[str, Model], weights: Path
) -> None:
    """A fetch holds its file's whole size from its start: a second that would
    fit beside what is on disk so far, but not beside the whole file, fails."""
    budget = Budget(weights, SIZE + SIZE // 2)
    hub.rate = 2 << 20  # about a second and a half for a file
    landed: list[Path] = []

    async def first() -> None:
        landed.append(await land(hub, models["x"], weights, budget))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        with trio.fail_after(30):
            while not [p for p in weights.rglob("*.part") if p.stat().st_size > 0]:
                await trio.sleep(0.01)
        with trio.fail_after(30), pytest.raises(NoRoom) as caught:
            await fetch(parse_source(models["a"].source), weights, endpoint=hub.url, budget=budget)
        [part] = weights.rglob("*.part")
        assert part.stat().st_size < SIZE // 2  # on disk: room for a.gguf beside it
    assert str(caught.value).startswith(
        f"no room for a.gguf in {weights} within its budget of 4.5 MiB: 3.0 MiB needed,"
        " 3.0 MiB held by files no fetch may evict; in use or being fetched: x.gguf 3.0 MiB;"
    )
    [x] = landed
    assert x.read_bytes() == models["x"].data
    # landed, x.gguf holds nothing more: it is the one unused for longest, and goes
    hub.rate = None
    a = await land(hub, models["a"], weights, budget)
    assert a.exists() and not x.exists()


async def test_a_file_copied_by_hand_counts_as_used_when_written_and_links_are_left(
    hub: HubStandIn, models: dict[str, Model], weights: Path, tmp_path: Path
) -> None:
    budget = Budget(weights, 2 * SIZE + SIZE // 2)
    a = await land(hub, models["a"], weights, budget)
    budget.mark_used(a, at=time.time() - DAY)
    by_hand = weights / "mine" / "copied.gguf"
    by_hand.parent.mkdir()
    by_hand.write_bytes(models["b"].data)
    os.utime(by_hand, (time.time(), time.time() - 2 * DAY))
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(b"o" * SIZE)
    (weights / "mine" / "linked.gguf").symlink_to(outside)
    budget.mark_used(outside)  # not the budget's: nothing written beside it
    assert [(h.path, h.last_used) for h in budget.held()] == [
        (by_hand, by_hand.stat().st_mtime),
        (a, pytest.approx(time.time() - DAY, abs=5)),
    ]

    await land(hub, models["c"], weights, budget)

    assert not by_hand.exists() and a.exists()  # written two days ago, used one
    assert (weights / "mine" / "linked.gguf").is_symlink()
    assert outside.read_bytes() == b"o" * SIZE
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


async def test_the_disk_counts_too(
    hub: HubStandIn, models: dict[str, Model], tmp_path: Path
) -> None:
    """A budget larger than the disk: the disk's free bytes are what is short,
    and the file unused for longest goes for them."""
    with tmpfs(tmp_path / "4m", "4m") as disk:
        budget = Budget(disk, 1 << 30)
        a = await land(hub, models["a"], disk, budget)
        b = await land(hub, models["b"], disk, budget)
        assert b.read_bytes() == models["b"].data and not a.exists()
        budget.set_in_use([b])
        with trio.fail_after(30), pytest.raises(NoRoom) as caught:
            await fetch(parse_source(models["c"].source), disk, endpoint=hub.url, budget=budget)
        said = str(caught.value)
        assert said.startswith(f"no room for c.gguf in {disk}: 3.0 MiB needed, ")
        assert said.endswith(
            " free on its disk even with every file not in use evicted; in use or being"
            " fetched: b.gguf 3.0 MiB; free space on the disk or stop a replica using one"
        )


def test_a_part_that_shrank_before_its_lock_is_not_filled_with_zeros(tmp_path: Path) -> None:
    """Another process removed the .part between the look at its size and the
    lock (an eviction): the fetch keeps what is there, not zeros."""
    path = tmp_path / "m.gguf.0123456789abcdef.part"
    with Part.open(path, tmp_path / "m.gguf") as part:
        assert part.keep(1000) == 0
    assert path.stat().st_size == 0


held_files = st.lists(
    st.builds(
        Held,
        path=st.integers(0, 10**6).map(lambda n: Path(f"/w/f{n}")),
        size=st.integers(0, 100),
        last_used=st.floats(0, 1000),
        pinned=st.booleans(),
        partial=st.booleans(),
    ),
    max_size=12,
    unique_by=lambda h: h.path,
)


@given(
    held=held_files, needed=st.integers(0, 300), limit=st.integers(1, 600), free=st.integers(0, 600)
)
def test_the_choice_is_the_fewest_unused_for_longest_never_a_pinned_one(
    held: list[Held], needed: int, limit: int, free: int
) -> None:
    plan = plan_room(held, needed=needed, limit=limit, free=free)
    evictable = sorted((h for h in held if not h.pinned), key=lambda h: (h.last_used, str(h.path)))
    total = sum(h.size for h in held)

    def fits(gone: int) -> bool:
        return total - gone + needed <= limit and needed <= free + gone

    if not plan.fits:
        assert plan.evict == ()
        assert not fits(sum(h.size for h in evictable))
        return
    assert list(plan.evict) == evictable[: len(plan.evict)]  # oldest first, none pinned
    assert fits(sum(h.size for h in plan.evict))
    assert not plan.evict or not fits(sum(h.size for h in plan.evict[:-1]))  # the fewest


def test_a_second_fetch_of_the_same_file_releases_only_its_own_room(tmp_path: Path) -> None:
    """Two fetches of one file in one process: the second fails on the .part's
    lock and releases its room; the first's stays held."""
    budget = Budget(tmp_path, 10 * SIZE)
    target = tmp_path / "m.gguf"
    part = tmp_path / "m.gguf.0123456789abcdef.part"
    part.write_bytes(b"x" * 100)
    first = budget.reserve(target, part, SIZE, 100)
    second = budget.reserve(target, part, SIZE, 100)
    second.release()
    assert [(h.path, h.pinned) for h in budget.held()] == [(part, True)]
    first.release()
    assert [(h.path, h.pinned) for h in budget.held()] == [(part, False)]

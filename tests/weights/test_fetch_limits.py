"""What bounds a fetch: the room on the disk, a source that stops sending, and how
often it reports."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from llmgw.weights.errors import NoRoom, Stalled
from llmgw.weights.fetch import fetch
from llmgw.weights.source import parse_source
from llmgw.weights.transfer import PROGRESS_S, Progress
from tests.weights.conftest import Model
from tools.support.hubstandin import HubStandIn


@contextmanager
def tmpfs(d: Path, size: str) -> Iterator[Path]:
    """``d``, a tmpfs of ``size`` of its own: a real disk that fills."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small tmpfs needs root and mount")
    d.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "llmgw-test", str(d)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "--lazy", str(d)], check=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small", "1m") as d:
        yield d


@pytest.fixture
def disk_4m(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "4m", "4m") as d:
        yield d


async def test_no_room_fails_before_writing_in_one_line(
    hub: HubStandIn, model: Model, small_disk: Path
) -> None:
    with trio.fail_after(30), pytest.raises(NoRoom) as caught:
        await fetch(parse_source(model.source), small_disk, endpoint=hub.url)
    assert str(caught.value) == (
        f"no room for tiny-Q4_K_M.gguf in {small_disk}: 3.0 MiB needed, 1.0 MiB free"
    )
    assert list(small_disk.iterdir()) == []  # not a byte, not a folder
    assert hub.gets() == []


async def test_a_disk_that_fills_during_the_fetch_says_so_and_keeps_the_part(
    hub: HubStandIn, model: Model, disk_4m: Path
) -> None:
    """Room when it began (checked), none before the end: the write says so."""
    hub.rate = 2 << 20
    filler = disk_4m / "filler"

    async def fill() -> None:
        while not [p for p in disk_4m.rglob("*.part") if p.stat().st_size >= 1 << 20]:
            await trio.sleep(0.01)
        # what another writer takes meanwhile
        await trio.to_thread.run_sync(filler.write_bytes, b"\0" * (2 << 20))

    failed: list[NoRoom] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill)
            try:
                await fetch(parse_source(model.source), disk_4m, endpoint=hub.url)
            except NoRoom as exc:
                failed.append(exc)
            nursery.cancel_scope.cancel()
    [caught] = failed
    said = str(caught)
    assert said.startswith(
        f"no room left for tiny-Q4_K_M.gguf in {disk_4m}/hf/acme/tiny-GGUF/main after "
    )
    assert said.endswith(" free): the partial file is kept for when there is")
    [part] = disk_4m.rglob("*.part")
    kept = part.stat().st_size
    assert 1 << 20 <= kept < len(model.data)
    # room again: the next fetch resumes it
    filler.unlink()
    hub.rate = None
    asked = len(hub.requests)
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), disk_4m, endpoint=hub.url)
    assert path.read_bytes() == model.data
    [get] = [r for r in hub.requests[asked:] if r.method == "GET"]
    assert get.headers["range"] == f"bytes={kept}-"


async def test_a_source_that_stops_sending_is_given_up_on_after_stall_s(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    hub.stall_after = 300_000
    start = trio.current_time()
    with trio.fail_after(10), pytest.raises(Stalled) as caught:
        await fetch(parse_source(model.source), weights, endpoint=hub.url, stall_s=0.5)
    took = trio.current_time() - start
    assert 0.5 <= took < 4
    said = str(caught.value)
    assert said.startswith(f"{model.source}: no byte arrived for 0.5 s, at 293.0 KiB of 3.0 MiB")
    assert said.endswith("; the partial file is kept and the next fetch resumes it")
    [part] = weights.rglob("*.part")
    assert part.stat().st_size == 300_000


async def test_a_slow_source_that_keeps_sending_is_not_given_up_on(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    """stall_s bounds the wait for a byte, not the fetch: at 2 MiB/s the file takes
    longer than stall_s, and arrives."""
    hub.rate = 2 << 20
    seen: list[Progress] = []
    start = trio.current_time()
    with trio.fail_after(30):
        path = await fetch(
            parse_source(model.source), weights, endpoint=hub.url, stall_s=1, progress=seen.append
        )
    took = trio.current_time() - start
    assert took > 1
    assert path.read_bytes() == model.data
    # a few times a second, not once a block
    assert len(seen) <= took / PROGRESS_S + 2
    assert len(seen) >= 3
    rates = [p.rate for p in seen[1:-1]]
    assert all(0.5 * hub.rate < r < 2 * hub.rate for r in rates), rates


async def test_a_fast_fetch_reports_a_few_times_a_second_not_once_a_block(
    hub: HubStandIn, hub_root: Path, weights: Path
) -> None:
    from tests.weights.conftest import model_file

    model = model_file(hub_root, "acme/big", "big.gguf", size=48 << 20)
    seen: list[Progress] = []
    start = trio.current_time()
    with trio.fail_after(60):
        await fetch(parse_source(model.source), weights, endpoint=hub.url, progress=seen.append)
    took = trio.current_time() - start
    assert len(seen) <= took / PROGRESS_S + 2  # 48 blocks were written
    assert seen[-1].done == seen[-1].total == len(model.data)

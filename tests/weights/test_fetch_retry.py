"""What a fetch does with a server that refuses a HEAD, or is busy, and with a hub
revision that moves: through the real fetcher, over loopback, against the hub
stand-in."""

from __future__ import annotations

import itertools
import logging
import time
from email.utils import formatdate
from pathlib import Path

import pytest
import trio

from llmgw.weights import transfer
from llmgw.weights.errors import FetchError, Stalled
from llmgw.weights.fetch import fetch, fetch_file
from llmgw.weights.part import commit_path
from llmgw.weights.source import parse_source
from tests.weights.conftest import Model
from tools.support.hubstandin import COMMIT, HubStandIn


def gaps(hub: HubStandIn, path_part: str) -> list[float]:
    """Seconds between the GETs of ``path_part``, in order."""
    at = [r.at for r in hub.gets(path_part)]
    return [b - a for a, b in itertools.pairwise(at)]


@pytest.mark.parametrize("refused", [403, 405])
async def test_a_url_that_refuses_a_head_is_asked_with_a_get_of_its_first_byte(
    hub: HubStandIn, model: Model, weights: Path, refused: int
) -> None:
    """A presigned URL is signed for GET only: its size is the total of a ranged
    GET's Content-Range, and its ETag what a cut answer resumes onto."""
    hub.head_refused = refused
    hub.cut_after = len(model.data) // 2 + 1  # once
    url = f"{hub.url}/plain/{model.repo}/{model.path}"
    with trio.fail_after(30):
        path = await fetch(parse_source(url), weights, sha256=model.sha256)
    assert path.read_bytes() == model.data
    asked = [(r.method, r.headers.get("range")) for r in hub.requests]
    assert asked == [
        ("HEAD", None),
        ("GET", "bytes=0-0"),
        ("GET", None),
        ("GET", f"bytes={hub.cut_after}-"),
    ]
    assert hub.gets()[-1].headers["if-range"] == f'"{model.sha256}"'
    assert hub.served == len(model.data) + 1  # and the one byte that told the size


async def test_a_url_that_refuses_both_says_so(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    hub.head_refused = 403
    hub.busy = [(403, None)]  # the GET too: a signature that has expired
    url = f"{hub.url}/plain/{model.repo}/{model.path}"
    with trio.fail_after(30), pytest.raises(FetchError) as caught:
        await fetch(parse_source(url), weights)
    assert str(caught.value) == (
        f"{url}: the server answered 403 to a HEAD and 403 to a GET of its first byte:"
        " has the URL's signature expired?"
    )
    assert not weights.exists() or list(weights.rglob("*.part")) == []


async def test_a_busy_server_is_asked_again_when_its_retry_after_says(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    hub.busy = [(503, "1"), (429, formatdate(time.time() + 4, usegmt=True))]
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights, endpoint=hub.url, stall_s=5)
    assert path.read_bytes() == model.data
    first, second = gaps(hub, "/resolve/")
    assert 1.0 <= first < 1.5  # not RETRY_S: what the server asked for
    # an HTTP date is to the second: 4 s from when it was set, less the first wait,
    # less up to a second the date does not say
    assert 1.5 <= second < 3.2


async def test_a_busy_server_that_says_nothing_is_asked_again_later_each_time(
    hub: HubStandIn, model: Model, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfer, "RETRY_S", 0.1)
    monkeypatch.setattr(transfer, "RETRY_MAX_S", 0.4)
    busy: list[tuple[int, str | None]] = [(503, None)] * 4
    hub.busy = [*busy, (502, None)]
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights, endpoint=hub.url, stall_s=5)
    assert path.read_bytes() == model.data
    waited = gaps(hub, "/resolve/")
    assert len(waited) == 5
    for got, wanted in zip(waited, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert wanted <= got < wanted + 0.15, waited  # doubling, then capped


async def test_a_cut_that_brought_bytes_starts_the_doubling_over(
    hub: HubStandIn, model: Model, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfer, "RETRY_S", 0.2)
    monkeypatch.setattr(transfer, "RETRY_MAX_S", 10.0)
    hub.cut_after = len(model.data) // 4 + 1
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights, endpoint=hub.url, stall_s=5)
    assert path.read_bytes() == model.data
    waited = gaps(hub, "/resolve/")
    assert len(waited) == 3
    assert all(0.2 <= w < 0.35 for w in waited), waited


async def test_a_server_that_asks_for_longer_than_stall_s_is_given_up_on_at_once(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    hub.busy = [(503, "120")]
    start = trio.current_time()
    with trio.fail_after(30), pytest.raises(Stalled) as caught:
        await fetch(parse_source(model.source), weights, endpoint=hub.url, stall_s=10)
    assert trio.current_time() - start < 5
    assert str(caught.value) == (
        f"{model.source}: the server answered 503 (Retry-After: 120) and asks to be asked"
        " again in 120 s, later than this fetch waits for a byte (10 s), at 0 B of 3.0 MiB;"
        " the partial file is kept and the next fetch resumes it"
    )


async def test_retry_after_is_read_as_seconds_or_an_http_date() -> None:
    now = 1_700_000_000.0
    assert transfer.retry_after("7", now) == 7.0
    assert transfer.retry_after(formatdate(now + 30, usegmt=True), now) == 30.0
    assert transfer.retry_after(formatdate(now - 30, usegmt=True), now) == 0.0
    for nonsense in (None, "", "soon", "-3", "1.5e9"):
        assert transfer.retry_after(nonsense, now) is None
    assert transfer.retry_wait(1, 0.0) == transfer.RETRY_S  # never a tight loop
    assert transfer.retry_wait(40, None) == transfer.RETRY_MAX_S


async def test_the_hubs_commit_is_recorded_and_a_moved_revision_is_noticed(
    hub: HubStandIn, model: Model, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = parse_source(model.source)  # at `main`, which moves
    with trio.fail_after(30):
        first = await fetch_file(source, weights, endpoint=hub.url)
    assert first.commit == COMMIT
    assert commit_path(first.path).read_text() == f"{COMMIT}\n"
    assert (first.fetched, first.resumed, first.moved) == (len(model.data), 0, None)

    # main moves on, the file the same (a README changed): nothing to say
    hub.commit = "1" * 40
    with trio.fail_after(30):
        same = await fetch_file(source, weights, endpoint=hub.url, check_revision=True)
    assert (same.commit, same.moved, same.fetched) == (COMMIT, None, 0)

    # main moves on with another file: said, returned, and the node keeps its own
    model.file.write_bytes(model.data[::-1])
    hub.commit = "2" * 40
    caplog.set_level(logging.INFO, "llmgw.weights")
    with trio.fail_after(30):
        moved = await fetch_file(source, weights, endpoint=hub.url, check_revision=True)
    assert (moved.path, moved.commit, moved.moved) == (first.path, COMMIT, "2" * 40)
    assert moved.path.read_bytes() == model.data
    [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == (
        f"{model.source}: main is now at commit {'2' * 40} on the hub, with another file than"
        f" the one this node holds ({first.path}, from commit {COMMIT}); the node keeps using"
        " its own: pin the commit or the sha256 the profile means to fetch the new one"
    )
    assert hub.gets() == hub.gets()[:1]  # asked, never fetched again

    # a hub that does not answer changes nothing: the node starts on what it has
    hub.close()
    with trio.fail_after(90):
        down = await fetch_file(source, weights, endpoint=hub.url, check_revision=True)
    assert (down.path, down.moved) == (first.path, None)

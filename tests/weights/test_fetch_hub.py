"""Fetching hf:// sources through real huggingface_hub calls and real HTTP on loopback,
from the hub stand-in (``tools/support/hubstandin.py``)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from llmgw.weights.errors import Corrupt, FetchError
from llmgw.weights.fetch import fetch, fetch_file
from llmgw.weights.part import commit_path, record_path
from llmgw.weights.source import parse_source
from llmgw.weights.transfer import Progress
from tests.weights.conftest import Model
from tools.support.hubstandin import COMMIT, HubStandIn

ROOT = Path(__file__).resolve().parents[2]


def leftovers(weights: Path) -> list[str]:
    """What a fetch left under ``weights``, files only, relative."""
    return sorted(str(p.relative_to(weights)) for p in weights.rglob("*") if p.is_file())


async def test_a_hub_file_lands_whole_and_verified_under_its_name(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    seen: list[Progress] = []
    with trio.fail_after(30):
        path = await fetch(
            parse_source(model.source), weights, endpoint=hub.url, progress=seen.append
        )
    assert path == weights / "hf/acme/tiny-GGUF/main/tiny-Q4_K_M.gguf"
    assert path.read_bytes() == model.data
    # the hash it was verified against, recorded as sha256sum writes it
    assert record_path(path).read_text() == f"{model.sha256}  tiny-Q4_K_M.gguf\n"
    # and the commit `main` was at when it was fetched
    assert commit_path(path).read_text() == f"{COMMIT}\n"
    assert leftovers(weights) == [
        "hf/acme/tiny-GGUF/main/.tiny-Q4_K_M.gguf.commit",
        "hf/acme/tiny-GGUF/main/.tiny-Q4_K_M.gguf.sha256",
        "hf/acme/tiny-GGUF/main/tiny-Q4_K_M.gguf",
    ]
    assert hub.served == len(model.data)  # each byte once
    heads = [r for r in hub.requests if r.method == "HEAD"]
    assert [r.path for r in heads] == ["/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"]
    n = len(model.data)
    assert seen[-1] == Progress(done=n, total=n, rate=seen[-1].rate, fetched=n, resumed=0)
    assert all(p.total == len(model.data) for p in seen)
    assert [p.done for p in seen] == sorted(p.done for p in seen)


async def test_a_file_already_there_is_used_without_asking_the_hub(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    source = parse_source(model.source)
    with trio.fail_after(30):
        first = await fetch(source, weights, endpoint=hub.url)
        asked = len(hub.requests)
        hub.close()  # the hub is down: the node still has its weights
        again = await fetch(source, weights, endpoint=hub.url, sha256=model.sha256)
    assert again == first
    assert len(hub.requests) == asked


async def test_a_revision_lands_under_its_own_name_and_is_asked_for(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    source = parse_source(f"hf://{model.repo}@{COMMIT}/{model.path}")
    with trio.fail_after(30):
        path = await fetch(source, weights, endpoint=hub.url)
    assert path == weights / f"hf/acme/tiny-GGUF/{COMMIT}/tiny-Q4_K_M.gguf"
    assert hub.requests[0].path == f"/acme/tiny-GGUF/resolve/{COMMIT}/tiny-Q4_K_M.gguf"


async def test_a_connection_cut_mid_way_is_resumed_without_reading_a_byte_twice(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    hub.cut_after = len(model.data) // 3 + 1000  # every answer: three and a bit cuts
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights, endpoint=hub.url, stall_s=5)
    assert path.read_bytes() == model.data
    gets = hub.gets("/resolve/")
    assert len(gets) == 3
    assert "range" not in gets[0].headers
    assert [g.headers["range"] for g in gets[1:]] == [f"bytes={n * hub.cut_after}-" for n in (1, 2)]
    assert hub.served == len(model.data)


async def test_a_fetch_killed_mid_way_resumes_from_its_part_file(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    """A real crash: the fetching process is SIGKILLed, its .part and lock left as
    they are; the next fetch reads only the bytes the .part lacks from the hub."""
    hub.rate = 2 << 20  # bytes/s: about a second and a half for the file
    script = textwrap.dedent(
        f"""
        import trio
        from pathlib import Path
        from llmgw.weights.fetch import fetch, fetch_file
        from llmgw.weights.source import parse_source
        trio.run(lambda: fetch(parse_source({model.source!r}), Path({str(weights)!r}),
                               endpoint={hub.url!r}))
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        with trio.fail_after(30):
            while True:
                parts = list(weights.rglob("*.part"))
                if parts and parts[0].stat().st_size >= len(model.data) // 3:
                    break
                await trio.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    [part] = weights.rglob("*.part")
    kept = part.stat().st_size
    assert 0 < kept < len(model.data)
    assert not (weights / "hf/acme/tiny-GGUF/main/tiny-Q4_K_M.gguf").exists()
    hub.rate = None
    asked_before = len(hub.requests)  # the killed fetch's answer may still be ending
    seen: list[Progress] = []
    with trio.fail_after(30):
        got = await fetch_file(
            parse_source(model.source), weights, endpoint=hub.url, progress=seen.append
        )
    assert got.path.read_bytes() == model.data
    [get] = [r for r in hub.requests[asked_before:] if r.method == "GET"]
    assert get.headers["range"] == f"bytes={kept}-"
    assert get.sent == len(model.data) - kept
    assert list(weights.rglob("*.part")) == []
    # what a caller counts by source: the bytes read now, and those not read again
    assert (got.fetched, got.resumed) == (len(model.data) - kept, kept)
    assert (seen[0].fetched, seen[0].resumed) == (0, kept)
    assert (seen[-1].fetched, seen[-1].resumed) == (len(model.data) - kept, kept)


async def test_corrupted_bytes_fail_and_leave_nothing_under_the_real_name(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    hub.corrupt = True
    with trio.fail_after(30), pytest.raises(Corrupt) as caught:
        await fetch(parse_source(model.source), weights, endpoint=hub.url)
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith(f"{model.source}: the bytes fetched have sha256 ")
    assert f"not {model.sha256} as the source says" in said
    assert leftovers(weights) == []  # no file, no .part, no record
    # and once the hub serves the right bytes, the next fetch starts over and lands
    hub.corrupt = False
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights, endpoint=hub.url)
    assert path.read_bytes() == model.data


async def test_a_profile_whose_sha256_is_not_the_hubs_fails_before_a_byte_moves(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    wrong = "ab" * 32
    with trio.fail_after(30), pytest.raises(Corrupt) as caught:
        await fetch(parse_source(model.source), weights, endpoint=hub.url, sha256=wrong)
    assert str(caught.value) == (
        f"{model.source}: the source's file has sha256 {model.sha256}, the profile says"
        f" {wrong}: pin the revision the profile means, or correct its sha256"
    )
    assert hub.gets() == []
    assert leftovers(weights) == []


async def test_a_landed_file_another_sha256_is_wanted_for_is_fetched_again(
    hub: HubStandIn, hub_root: Path, model: Model, weights: Path
) -> None:
    source = parse_source(model.source)
    with trio.fail_after(30):
        path = await fetch(source, weights, endpoint=hub.url)
        # `main` moved on: the profile now pins the new file's sha256
        new = model.file.read_bytes()[::-1]
        model.file.write_bytes(new)
        record_path(path).unlink()  # a crash lost the record: the file is hashed instead
        again = await fetch(
            source, weights, endpoint=hub.url, sha256=hashlib.sha256(new).hexdigest()
        )
    assert again == path
    assert path.read_bytes() == new


async def test_the_token_the_hub_wants_is_sent_and_none_without_it_says_why(
    hub: HubStandIn, model: Model, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.token = "hf_s3cret"
    source = parse_source(model.source)
    with trio.fail_after(30), pytest.raises(FetchError) as caught:
        await fetch(source, weights, endpoint=hub.url)
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith(
        f"{model.source} (at {hub.url}): the hub has no repository acme/tiny-GGUF"
    )
    assert "sends no token that may read it (set HF_TOKEN)" in said
    assert leftovers(weights) == []
    with trio.fail_after(30):
        path = await fetch(source, weights, endpoint=hub.url, token="hf_s3cret")
    assert path.read_bytes() == model.data
    assert {r.headers.get("authorization") for r in hub.requests[1:]} == {"Bearer hf_s3cret"}


async def test_hf_token_and_hf_endpoint_from_the_environment(
    hub: HubStandIn, model: Model, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.token = "hf_fr0m_env"
    monkeypatch.setenv("HF_TOKEN", "hf_fr0m_env")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights)
    assert path.read_bytes() == model.data
    assert {r.headers.get("authorization") for r in hub.requests} == {"Bearer hf_fr0m_env"}


async def test_bytes_from_a_cdn_are_fetched_without_the_hubs_token(
    hub: HubStandIn, model: Model, weights: Path
) -> None:
    """The hub redirects to a signed URL on another host, which refuses a second
    authority (as S3 does): the token goes to the hub only."""
    hub.token = "hf_s3cret"
    hub.cdn = True
    hub.cut_after = len(model.data) // 2  # and a resume from the CDN
    with trio.fail_after(30):
        path = await fetch(parse_source(model.source), weights, endpoint=hub.url, token="hf_s3cret")
    assert path.read_bytes() == model.data
    cdn = hub.gets("/cdn/")
    assert len(cdn) == 3
    assert all("authorization" not in r.headers for r in cdn)
    assert hub.gets("/resolve/") == []  # the bytes came from the CDN only
    assert hub.served == len(model.data)


async def test_a_missing_file_says_so(hub: HubStandIn, model: Model, weights: Path) -> None:
    source = parse_source(f"hf://{model.repo}/nope.gguf")
    with trio.fail_after(30), pytest.raises(FetchError) as caught:
        await fetch(source, weights, endpoint=hub.url)
    assert str(caught.value) == (
        f"{source} (at {hub.url}): acme/tiny-GGUF at main has no file 'nope.gguf':"
        " check the name against the repository's files"
    )


async def test_an_unreachable_hub_says_so(model: Model, weights: Path) -> None:
    from tests.ports import own_port

    endpoint = f"http://127.0.0.1:{own_port()}"
    with trio.fail_after(30), pytest.raises(FetchError) as caught:
        await fetch(parse_source(model.source), weights, endpoint=endpoint)
    said = str(caught.value)
    assert said.startswith(f"{model.source} (at {endpoint}): cannot reach the hub: ")
    assert "\n" not in said

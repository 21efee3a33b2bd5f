"""Fetching an https:// source from a plain web server (the stand-in's ``/plain``,
over real TLS with the suite's CA), and using a file on a shared mount in place."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from llmgw.weights.errors import Corrupt, FetchError
from llmgw.weights.fetch import fetch
from llmgw.weights.source import parse_source
from tests.conftest import Pki
from tests.weights.conftest import Model
from tools.support.hubstandin import HubStandIn


@pytest.fixture
def tls_hub(hub_root: Path, pki: Pki) -> Iterator[HubStandIn]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    with HubStandIn(hub_root, tls=ctx) as h:
        yield h


@pytest.fixture
def trust(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca))


async def test_an_https_file_lands_under_its_host_and_path(
    tls_hub: HubStandIn, model: Model, weights: Path, trust: ssl.SSLContext
) -> None:
    url = f"{tls_hub.url}/plain/{model.repo}/{model.path}"
    with trio.fail_after(30):
        path = await fetch(parse_source(url), weights, verify=trust, sha256=model.sha256)
    port = tls_hub.port
    assert path == weights / f"url/127.0.0.1:{port}/plain/acme/tiny-GGUF/tiny-Q4_K_M.gguf"
    assert path.read_bytes() == model.data
    assert tls_hub.served == len(model.data)


async def test_an_https_file_resumes_only_onto_the_same_bytes(
    tls_hub: HubStandIn, model: Model, weights: Path, trust: ssl.SSLContext
) -> None:
    """A cut answer is resumed with If-Range: the server's ETag, so a file that
    changed since is sent whole, never spliced onto the old bytes."""
    tls_hub.cut_after = len(model.data) // 2
    url = f"{tls_hub.url}/plain/{model.repo}/{model.path}"
    with trio.fail_after(30):
        path = await fetch(parse_source(url), weights, verify=trust)
    assert path.read_bytes() == model.data
    resumed = tls_hub.gets("/plain/")[1]
    assert resumed.headers["range"] == f"bytes={len(model.data) // 2}-"
    assert resumed.headers["if-range"] == f'"{model.sha256}"'


async def test_an_https_file_not_the_sha256_given_fails(
    tls_hub: HubStandIn, model: Model, weights: Path, trust: ssl.SSLContext
) -> None:
    tls_hub.corrupt = True
    url = f"{tls_hub.url}/plain/{model.repo}/{model.path}"
    with trio.fail_after(30), pytest.raises(Corrupt) as caught:
        await fetch(parse_source(url), weights, verify=trust, sha256=model.sha256)
    assert f"not {model.sha256} as the profile says" in str(caught.value)
    assert [p for p in weights.rglob("*") if p.is_file()] == []


async def test_an_https_server_not_trusted_says_so(
    tls_hub: HubStandIn, model: Model, weights: Path
) -> None:
    url = f"{tls_hub.url}/plain/{model.repo}/{model.path}"
    with trio.fail_after(30), pytest.raises(FetchError) as caught:
        await fetch(parse_source(url), weights)  # the system's CAs: not the suite's
    said = str(caught.value)
    assert said.startswith(f"{url}: cannot ask the server for the file: ")
    assert "CERTIFICATE_VERIFY_FAILED" in said


async def test_a_missing_https_file_says_the_status(
    tls_hub: HubStandIn, model: Model, weights: Path, trust: ssl.SSLContext
) -> None:
    url = f"{tls_hub.url}/plain/nope.gguf"
    with trio.fail_after(30), pytest.raises(FetchError) as caught:
        await fetch(parse_source(url), weights, verify=trust)
    assert str(caught.value) == f"{url}: the server answered 404 to a HEAD"


async def test_a_file_on_a_shared_mount_is_used_in_place(model: Model, weights: Path) -> None:
    with trio.fail_after(10):
        path = await fetch(parse_source(str(model.file)), weights, size=len(model.data))
    assert path == model.file
    assert not weights.exists()  # nothing copied
    with trio.fail_after(10), pytest.raises(FetchError) as caught:
        await fetch(parse_source("/mnt/nowhere/x.gguf"), weights)
    assert str(caught.value) == (
        "/mnt/nowhere/x.gguf is not on this node: is the shared mount mounted here?"
    )
    with trio.fail_after(10), pytest.raises(Corrupt) as wrong:
        await fetch(parse_source(str(model.file)), weights, size=1)
    assert (
        str(wrong.value) == f"{model.file} has {len(model.data)} bytes, not the 1 the profile says"
    )

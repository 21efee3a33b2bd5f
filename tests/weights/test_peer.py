"""Weights taken from other agents (``llmgw.weights.peer``), over real TLS on
loopback with the fleet's own CA, between listeners in this process and takers
here or in a child process.

Chunks are small here (``CHUNK``), so a file of a few MiB has a dozen of them,
the last one short."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import ssl
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path, PurePosixPath

import pytest
import trio

from llmgw.tls.contexts import server_context
from llmgw.weights import chunks as chunk_files
from llmgw.weights.chunks import Chunks
from llmgw.weights.errors import FetchError
from llmgw.weights.fetch import fetch
from llmgw.weights.part import record_path, write_record
from llmgw.weights.peer import Peer, PeerServer, PeerTrust, ServeLimits, fetch_from_peer
from llmgw.weights.peerfetch import _Link
from llmgw.weights.peerwire import target as request_target
from llmgw.weights.source import HubFile, parse_source, where
from llmgw.weights.transfer import Progress
from tests.cluster.proxy import Proxy
from tests.conftest import Pki
from tests.weights.conftest import Model
from tools.support.hubstandin import HubStandIn

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256 << 10
LIMITS = ServeLimits(chunk_size=CHUNK)


def hub_source(model: Model) -> HubFile:
    source = parse_source(model.source)
    assert isinstance(source, HubFile)
    return source


def land(weights: Path, model: Model) -> Path:
    """``model``'s file landed on a node, as a fetch from the hub leaves it."""
    path = where(hub_source(model), weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.data)
    write_record(path, model.sha256)
    return path


def files(weights: Path) -> list[str]:
    return sorted(str(p.relative_to(weights)) for p in weights.rglob("*") if p.is_file())


def trust(pki: Pki, node: str) -> PeerTrust:
    return PeerTrust.load(pki.ca, *pki.agent(node))


@asynccontextmanager
async def listener(
    weights: Path, pki: Pki, node: str, server: type[PeerServer] = PeerServer
) -> AsyncIterator[tuple[PeerServer, Peer]]:
    """``node``'s transfer listener over ``weights``, on a free loopback port."""
    s = server(weights, server_context(pki.ca, *pki.agent(node)), LIMITS)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(s.serve, "127.0.0.1", 0)
        port = listeners[0].socket.getsockname()[1]
        yield s, Peer(node, "127.0.0.1", port)
        nursery.cancel_scope.cancel()


class SlowServer(PeerServer):
    """Reads each chunk slowly, so a taker can be caught in the middle."""

    def read_chunk(self, path: Path, manifest: Chunks, index: int) -> bytes | None:
        import time

        time.sleep(0.15)
        return super().read_chunk(path, manifest, index)


class LyingServer(PeerServer):
    """Sends chunk 2 with a byte flipped, after its own check: a peer with a bug,
    or one that lies."""

    def read_chunk(self, path: Path, manifest: Chunks, index: int) -> bytes | None:
        data = super().read_chunk(path, manifest, index)
        if data is not None and index == 2:
            data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        return data


async def test_a_node_takes_a_file_another_has_landed(
    pki: Pki, model: Model, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    landed_a = land(a, model)
    seen: list[Progress] = []
    with trio.fail_after(30):
        async with listener(a, pki, "n1") as (server, peer):
            path = await fetch_from_peer(
                hub_source(model),
                b,
                [peer],
                trust(pki, "n2"),
                sha256=model.sha256,
                progress=seen.append,
            )
    # the same file, in the same place, with the same record as a fetch from the hub
    assert path == where(hub_source(model), b)
    assert path.read_bytes() == model.data
    assert record_path(path).read_text() == f"{model.sha256}  {path.name}\n"
    assert files(b) == [
        "hf/acme/tiny-GGUF/main/.tiny-Q4_K_M.gguf.chunks",
        "hf/acme/tiny-GGUF/main/.tiny-Q4_K_M.gguf.sha256",
        "hf/acme/tiny-GGUF/main/tiny-Q4_K_M.gguf",
    ]
    assert server.sent == len(model.data)  # each byte once
    # both nodes now keep the manifest, the one A made the first time it was asked
    kept = chunk_files.load(path)
    assert kept is not None and kept == chunk_files.load(landed_a)
    assert kept.complete and kept.sha256 == model.sha256 and kept.chunk_size == CHUNK
    assert kept.hashes[0] == hashlib.sha256(model.data[:CHUNK]).hexdigest()
    assert seen[-1].done == seen[-1].total == len(model.data)


async def test_a_third_node_takes_chunks_from_a_second_while_it_still_takes_them(
    pki: Pki, hub: HubStandIn, model: Model, tmp_path: Path
) -> None:
    """hub -> A (fetching, slowly) -> B (taking from A) -> C (taking from B): the
    hub is read once, and each node takes chunks before the one before it has
    the whole file."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    hub.rate = 1 << 20  # 3 s for the file
    source = hub_source(model)
    first: dict[str, float] = {}
    landed: dict[str, float] = {}

    def watch(node: str) -> Callable[[Progress], None]:
        def seen(p: Progress) -> None:
            if p.done and node not in first:
                first[node] = trio.current_time()

        return seen

    async def run(node: str, take: Callable[[], Awaitable[object]]) -> None:
        await take()
        landed[node] = trio.current_time()

    with trio.fail_after(60):
        async with (
            listener(a, pki, "n1") as (server_a, peer_a),
            listener(b, pki, "n2") as (server_b, peer_b),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(
                run, "a", lambda: fetch(source, a, endpoint=hub.url, progress=watch("a"))
            )
            while not list(a.rglob("*.part")):
                await trio.sleep(0.05)
            nursery.start_soon(
                run,
                "b",
                # a peer fetching from its source is found by the version: sha256 and size
                lambda: fetch_from_peer(
                    source,
                    b,
                    [peer_a],
                    trust(pki, "n2"),
                    sha256=model.sha256,
                    size=len(model.data),
                    progress=watch("b"),
                ),
            )
            while not list(b.rglob("*.part")):
                await trio.sleep(0.05)
            nursery.start_soon(
                run,
                "c",
                lambda: fetch_from_peer(
                    source, c, [peer_b], trust(pki, "n3"), sha256=model.sha256, progress=watch("c")
                ),
            )
    for node in (a, b, c):
        assert where(source, node).read_bytes() == model.data
    assert hub.served == len(model.data)  # the hub read once
    assert first["b"] < landed["a"]  # B took chunks A held before A had them all
    assert first["c"] < landed["b"]  # and C from B, before B had them all
    assert server_a.sent == server_b.sent == len(model.data)


async def test_a_chunk_damaged_on_a_peer_is_taken_from_another(
    pki: Pki, model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a1, a2, b = tmp_path / "a1", tmp_path / "a2", tmp_path / "b"
    land(a2, model)
    damaged = land(a1, model)
    manifest = chunk_files.Hashing(damaged, len(model.data), CHUNK)
    while manifest.step():
        pass
    chunk_files.save(damaged, manifest.manifest(model.sha256))  # made while it was whole
    with damaged.open("r+b") as fh:  # then the disk damages chunk 3
        fh.seek(3 * CHUNK + 10)
        fh.write(b"\0" * 4)
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with (
            listener(a1, pki, "n1") as (server1, peer1),
            listener(a2, pki, "n2") as (server2, peer2),
        ):
            path = await fetch_from_peer(
                hub_source(model), b, [peer1, peer2], trust(pki, "n3"), sha256=model.sha256
            )
    assert path.read_bytes() == model.data
    # A1 refused to send the damaged chunk (and said so); A2 sent it, and what followed
    assert server1.refused == {409: 1}
    assert server1.sent == 3 * CHUNK
    assert server2.sent == len(model.data) - 3 * CHUNK
    assert any(
        "chunk 3 does not match its manifest: this node's copy is damaged" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR
    )


async def test_a_chunk_a_peer_sends_wrong_is_never_written_and_taken_again(
    pki: Pki, model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    liar_dir, honest_dir, b = tmp_path / "liar", tmp_path / "honest", tmp_path / "b"
    land(liar_dir, model)
    land(honest_dir, model)
    with trio.fail_after(30):
        async with (
            listener(liar_dir, pki, "n1", LyingServer) as (liar, liar_peer),
            listener(honest_dir, pki, "n2") as (honest, honest_peer),
        ):
            path = await fetch_from_peer(
                hub_source(model),
                b,
                [liar_peer, honest_peer],
                trust(pki, "n3"),
                sha256=model.sha256,
            )
    assert path.read_bytes() == model.data
    assert liar.sent == 3 * CHUNK  # chunks 0, 1, and the bad 2
    assert honest.sent == len(model.data) - 2 * CHUNK  # 2 again, and the rest
    assert any("chunk 2 from n1" in r.getMessage() for r in caplog.records)


async def test_a_chunk_bad_on_every_peer_fails_and_the_hub_resumes_after_it(
    pki: Pki, hub: HubStandIn, model: Model, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    damaged = land(a, model)
    with damaged.open("r+b") as fh:
        fh.seek(5 * CHUNK + 1)
        fh.write(b"\xff\xfe")
    source = hub_source(model)
    with trio.fail_after(30):
        async with listener(a, pki, "n1") as (server, peer):
            # A finds its own file damaged as it makes its manifest: it serves none
            with pytest.raises(FetchError, match=r"no peer holds it.*damaged on this node"):
                await fetch_from_peer(source, b, [peer], trust(pki, "n2"), sha256=model.sha256)
            assert server.sent == 0
            # A manifest made before the damage: A serves chunks 0-4, then refuses 5
            manifest = Chunks(
                size=len(model.data),
                chunk_size=CHUNK,
                sha256=model.sha256,
                hashes=[
                    hashlib.sha256(model.data[i : i + CHUNK]).hexdigest()
                    for i in range(0, len(model.data), CHUNK)
                ],
            )
            chunk_files.save(damaged, manifest)
            with pytest.raises(FetchError, match="chunk 5 is damaged on every peer that holds it"):
                await fetch_from_peer(source, b, [peer], trust(pki, "n2"), sha256=model.sha256)
        assert server.sent == 5 * CHUNK
        assert not where(source, b).exists()  # nothing partial under the real name
        # a fetch from the hub resumes the peer's .part: its name is the version's
        await fetch(source, b, endpoint=hub.url)
    assert where(source, b).read_bytes() == model.data
    assert hub.served == len(model.data) - 5 * CHUNK


async def test_only_the_fleets_agents_take_and_are_taken_from(
    pki: Pki, model: Model, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    land(a, model)
    source = hub_source(model)
    foreign = PeerTrust.load(pki.ca, *pki.foreign_agent("n1"))  # trusts our CA, not of it
    expired = PeerTrust.load(pki.ca, *pki.expired_agent("n1"))
    control_plane = PeerTrust.load(pki.ca, pki.server_cert, pki.server_key)  # serverAuth only
    with trio.fail_after(30):
        async with listener(a, pki, "n1") as (server, peer):
            for who in (foreign, expired, control_plane):
                with pytest.raises(FetchError, match="no peer holds it"):
                    await fetch_from_peer(source, b, [peer], who, sha256=model.sha256, stall_s=1)
            # a client without a certificate is refused in the handshake
            bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
            tls = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", peer.port), bare)

            async def ask_without_certificate() -> None:
                await tls.do_handshake()
                await tls.send_all(b"GET /v1/weights/x HTTP/1.1\r\nhost: x\r\n\r\n")
                assert not await tls.receive_some(1000)  # TLS 1.3: refused after the handshake

            with trio.fail_after(5), pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
                await ask_without_certificate()
            await trio.aclose_forcefully(tls)
            # and one speaking plain HTTP is closed at once
            tcp = await trio.open_tcp_stream("127.0.0.1", peer.port)
            await tcp.send_all(b"GET /v1/weights/x HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(5):
                assert await tcp.receive_some(1000) == b""
            await tcp.aclose()
            # the taker checks the listener too: the address must be n1's, and of the fleet
            with pytest.raises(FetchError, match=r"is 'n1', not 'n4'"):
                await fetch_from_peer(
                    source, b, [Peer("n4", "127.0.0.1", peer.port)], trust(pki, "n2")
                )
        async with listener(a, pki, "n1") as (_, good):
            wrong_ca = PeerTrust.load(pki.other_ca_dir / "ca.pem", *pki.agent("n2"))
            with pytest.raises(FetchError, match="not an agent of this fleet"):
                await fetch_from_peer(source, b, [good], wrong_ca)
    assert server.sent == 0
    assert not list(b.rglob("*.gguf"))


async def test_paths_outside_the_weights_directory_are_refused(
    pki: Pki, model: Model, tmp_path: Path
) -> None:
    a = tmp_path / "a"
    landed = land(a, model)
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"not yours")
    (a / "escape.gguf").symlink_to(secret)
    (a / "hf" / "up").symlink_to(tmp_path)
    rel = landed.relative_to(a)
    asks = {
        "../secret.gguf": 403,
        "hf/../../secret.gguf": 403,
        "escape.gguf": 403,  # a link out of the directory
        "hf/up/secret.gguf": 403,
        f"{rel.parent}/.{rel.name}.sha256": 403,  # a record, not a weights file
        f"{rel}.0123456789abcdef.part": 403,
        "hf/nothing.gguf": 404,
    }
    with trio.fail_after(30):
        async with listener(a, pki, "n1") as (server, peer):
            link = _Link(peer, trust(pki, "n2"))
            try:
                for path, status in asks.items():
                    got, body = await link.get(
                        request_target(PurePosixPath(path), None, None, 0), 1 << 20, 5
                    )
                    assert (path, got) == (path, status), body
                    assert b"not yours" not in body
                # written raw: %2e%2e, an absolute path, an encoded slash
                for raw in (b"%2e%2e/secret.gguf", b"%2Fetc%2Fpasswd", b"/etc/passwd"):
                    got, body = await link.get(b"/v1/weights/" + raw + b"?chunk=0", 1 << 20, 5)
                    assert got == 403, (raw, body)
                got, _ = await link.get(request_target(PurePosixPath(rel), None, None, 0), CHUNK, 5)
                assert got == 200  # and the real one is served
            finally:
                await link.close()
    assert server.sent == CHUNK


async def test_a_cut_connection_resumes_at_the_chunk_it_was_taking(
    pki: Pki, model: Model, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    land(a, model)
    with trio.fail_after(30):
        async with (
            listener(a, pki, "n1", SlowServer) as (server, peer),
            trio.open_nursery() as nursery,
        ):
            proxy = Proxy(peer.port)
            port = await nursery.start(proxy.serve)
            cuts = 0

            async def sever() -> None:
                nonlocal cuts
                for at in (3, 7):
                    while server.sent < at * CHUNK:
                        await trio.sleep(0.01)
                    cuts += proxy.sever()

            nursery.start_soon(sever)
            path = await fetch_from_peer(
                hub_source(model),
                b,
                [Peer("n1", "127.0.0.1", port)],
                trust(pki, "n2"),
                sha256=model.sha256,
            )
            nursery.cancel_scope.cancel()
    assert cuts == 2 and proxy.opened >= 3
    assert path.read_bytes() == model.data
    # at most the chunk in flight at each cut again, never what was taken before
    assert server.sent <= len(model.data) + 2 * CHUNK


async def test_a_taker_killed_midway_resumes_without_taking_whole_chunks_again(
    pki: Pki, model: Model, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    land(a, model)
    source = hub_source(model)
    target = where(source, b)
    with trio.fail_after(60):
        async with listener(a, pki, "n1", SlowServer) as (server, peer):
            script = textwrap.dedent(
                f"""
                import trio
                from pathlib import Path
                from llmgw.weights.peer import Peer, PeerTrust, fetch_from_peer
                from llmgw.weights.source import parse_source
                trust = PeerTrust.load(*{[str(p) for p in (pki.ca, *pki.agent("n2"))]!r})
                trio.run(lambda: fetch_from_peer(
                    parse_source({model.source!r}), Path({str(b)!r}),
                    [Peer("n1", "127.0.0.1", {peer.port})], trust, sha256={model.sha256!r}))
                """
            )
            child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
            try:
                while True:
                    held = [p.stat().st_size for p in target.parent.glob("*.part")]
                    if held and held[0] >= 4 * CHUNK + 1000:
                        break
                    assert child.poll() is None, "the taker ended before it was killed"
                    await trio.sleep(0.01)
                os.kill(child.pid, signal.SIGKILL)
            finally:
                child.kill()
                child.wait(timeout=10)
            (part,) = target.parent.glob("*.part")
            kept = part.stat().st_size // CHUNK * CHUNK  # the whole chunks it holds
            sent_before = server.sent
            path = await fetch_from_peer(source, b, [peer], trust(pki, "n2"), sha256=model.sha256)
    assert path.read_bytes() == model.data
    assert server.sent - sent_before == len(model.data) - kept


async def test_transfers_are_bounded_and_a_taker_turned_away_comes_back(
    pki: Pki, model: Model, tmp_path: Path
) -> None:
    a = tmp_path / "a"
    land(a, model)
    limits = ServeLimits(chunk_size=CHUNK, max_transfers=1, slot_s=0.05)
    s = SlowServer(a, server_context(pki.ca, *pki.agent("n1")), limits)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = (await nursery.start(s.serve, "127.0.0.1", 0))[0].socket.getsockname()[1]
            peer = Peer("n1", "127.0.0.1", port)
            async with trio.open_nursery() as takers:
                for node in ("n2", "n3", "n4"):
                    takers.start_soon(
                        lambda n=node: fetch_from_peer(
                            hub_source(model), tmp_path / n, [peer], trust(pki, n)
                        )
                    )
            nursery.cancel_scope.cancel()
    for node in ("n2", "n3", "n4"):
        assert where(hub_source(model), tmp_path / node).read_bytes() == model.data
    assert s.refused.get(503, 0) > 0  # one chunk at a time: the others were told to wait
    assert s.sent == 3 * len(model.data)


async def test_a_client_that_says_nothing_is_let_go(pki: Pki, tmp_path: Path) -> None:
    limits = ServeLimits(chunk_size=CHUNK, handshake_s=0.3, idle_s=0.3)
    s = PeerServer(tmp_path, server_context(pki.ca, *pki.agent("n1")), limits)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = (await nursery.start(s.serve, "127.0.0.1", 0))[0].socket.getsockname()[1]
            silent = await trio.open_tcp_stream("127.0.0.1", port)  # no handshake
            link = _Link(Peer("n1", "127.0.0.1", port), trust(pki, "n2"))
            await link._open()  # a handshake, then no request
            await trio.sleep(0.1)
            assert s.connections == 2
            assert await silent.receive_some(100) == b""  # closed by the listener
            while s.connections:
                await trio.sleep(0.05)
            await link.close()
            await silent.aclose()
            nursery.cancel_scope.cancel()

"""Taking a weights file from other agents of the fleet, a chunk at a time, each
chunk checked before it is written.

Theory of operation
-------------------
``fetch_from_peer`` brings a source's file to where it lands on this node, as
``fetch`` does, but from the agents named (``Peer``: the control plane says
which hold it, or are fetching it, and where their transfer listeners are):

1. A file already there, of the sha256 wanted, is used (``fetch``'s rule).
2. Each peer is asked what it holds of the file (``peerwire.Holding``), again
   until one holds some of it (a peer may be about to begin its own fetch),
   for at most ``stall_s``. The
   manifest taken as the reference is a landed peer's (it checked its whole
   file against its sha256 when it landed it), else the one that knows most
   hashes. Peers whose manifest is of another file (size, chunk size, sha256)
   are not used. The caller's sha256 and size, where given, name the version
   asked, so a peer holding another answers that it has none.
3. The bytes go to the same ``.part`` a fetch from the source would fill (its
   name is set by the sha256 and size alone), so either resumes the other's,
   and the landed file is the same, with the same record. What the ``.part``
   holds is kept in whole chunks, each checked against the reference as it is
   re-read; the first that fails, and all after it, are fetched again. The
   reference is saved beside the ``.part`` (``chunks.chunks_path``), so this
   node's own listener serves the chunks it holds to a third node while it
   takes the rest.
4. Chunks are asked in order, each of a peer that holds it whole, the same
   peer while it answers. A chunk whose bytes are not its listed hash is
   written nowhere; it is asked of another peer (409, a peer that finds its
   own copy damaged, counts the same). When every peer that holds the chunk
   has failed it and none is still fetching, the fetch fails saying so, the
   chunks before it kept for a fetch from the source to resume.
5. A peer that is still fetching serves the chunks it holds so far: when no
   peer holds the next chunk, they are asked again every ``POLL_S``, and the
   reference grows with the hashes they learnt. A peer that lands its file
   meanwhile tells its full manifest; where it disagrees with what was
   written (a first node whose source sent wrong bytes), this node's ``.part``
   is cut back to the first chunk that differs.
6. One clock bounds it all, as ``transfer``'s: its deadline moves ``stall_s``
   ahead each time a chunk is written here, or a peer is seen to hold more
   bytes than before (a peer still fetching from a slow source is progress).
   Each connection, handshake and answer is bounded within it too.
7. When whole, the size and the whole sha256 are checked (against the
   caller's, else the reference's, which the peers checked against theirs),
   and the file lands as a fetch lands it, with its manifest beside it.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import ssl
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import attrs
import h11
import trio

from llmgw.weights import chunks as chunk_files
from llmgw.weights import part as parts
from llmgw.weights.chunks import Chunks, digest
from llmgw.weights.errors import Corrupt, FetchError, Stalled
from llmgw.weights.fetch import have, tag  # the rules a fetch from the source follows
from llmgw.weights.peerwire import (
    DAMAGED,
    MAX_HEAD,
    MAX_MANIFEST,
    NOT_HERE,
    OK,
    TOO_EARLY,
    Holding,
    PeerRefused,
    PeerTrust,
    next_event,
    read_holding,
    send,
)
from llmgw.weights.peerwire import target as request_target
from llmgw.weights.source import HubFile, UrlFile, where
from llmgw.weights.transfer import ProgressCallback, Remote, Reporter

log = logging.getLogger("llmgw.weights.peer")

CONNECT_S = 10.0  # a connection and its TLS handshake
ASK_S = 30.0  # a manifest's answer (a peer may hash for a while first)
POLL_S = 0.25  # between asking peers that do not yet hold the next chunk
RETRY_S = 1.0  # before a peer that failed is asked again
SAVE_S = 1.0  # at most this often, the manifest beside the .part rewritten

_SHA256 = re.compile(r"[0-9a-f]{64}")


@attrs.frozen
class Peer:
    """An agent to take from: its node id (its certificate's CN) and where its
    transfer listener is."""

    node_id: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.node_id} ({host}:{self.port})"


class _Down(Exception):
    """The peer could not be reached, or broke off: ask it again later."""


class _Link:
    """One kept-alive connection to a peer, opened when needed, dropped at any error."""

    def __init__(self, peer: Peer, trust: PeerTrust) -> None:
        self.peer = peer
        self.trust = trust
        self.tls: trio.SSLStream[trio.SocketStream] | None = None
        self.conn: h11.Connection | None = None

    async def _open(self) -> tuple[trio.SSLStream[trio.SocketStream], h11.Connection]:
        if self.tls is not None and self.conn is not None:
            return self.tls, self.conn
        where_ = f"{self.peer.host}:{self.peer.port}"
        try:
            with trio.fail_after(CONNECT_S):
                tcp = await trio.open_tcp_stream(self.peer.host, self.peer.port)
                tls = trio.SSLStream(tcp, self.trust.context, server_hostname=None)
                try:
                    await tls.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(tls)
                    raise
        except trio.TooSlowError:
            raise _Down(f"no connection and TLS handshake in {CONNECT_S:g} s") from None
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            raise _Down(f"cannot connect: {_why(exc)}") from None
        try:
            self.trust.check(tls.getpeercert(binary_form=True), self.peer.node_id, where_)
        except PeerRefused:
            await trio.aclose_forcefully(tls)
            raise
        self.tls, self.conn = tls, h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        return self.tls, self.conn

    async def get(self, target: bytes, limit: int, wait_s: float) -> tuple[int, bytes]:
        """The status and body of a GET; ``wait_s`` bounds each wait for a byte.

        Raises:
            _Down: the peer could not be reached, broke off, or took too long.
            PeerRefused: the peer is not the one meant.
        """
        tls, conn = await self._open()
        body = bytearray()
        try:
            with trio.CancelScope(deadline=trio.current_time() + wait_s) as clock:
                headers = [("host", self.peer.node_id), ("accept-encoding", "identity")]
                await send(conn, tls, h11.Request(method="GET", target=target, headers=headers))
                await send(conn, tls, h11.EndOfMessage())
                head = await next_event(conn, tls)
                if not isinstance(head, h11.Response):
                    raise _Down(f"answered {type(head).__name__}, not a response")
                status = head.status_code
                while True:
                    event = await next_event(conn, tls)
                    clock.deadline = trio.current_time() + wait_s
                    if isinstance(event, h11.Data):
                        body += event.data
                        if len(body) > limit:
                            raise _Down(f"answered more than the {limit} bytes asked")
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        raise _Down(f"answered {type(event).__name__} in the middle of a body")
            if clock.cancelled_caught:
                raise _Down(f"no byte for {wait_s:g} s")
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:
                await self.close()
            return status, bytes(body)
        except (OSError, trio.BrokenResourceError, ssl.SSLError, h11.ProtocolError) as exc:
            await self.close()
            raise _Down(f"broke off: {_why(exc)}") from None
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        tls, self.tls, self.conn = self.tls, None, None
        if tls is not None:
            await trio.aclose_forcefully(tls)


@attrs.define
class _State:
    """What this fetch knows of one peer."""

    peer: Peer
    link: _Link
    holding: Holding | None = None
    held: int = 0  # bytes it was last seen to hold
    down_until: float = 0.0  # not asked before then
    failed: set[int] = attrs.field(factory=set)  # chunks it gave wrong, or said were damaged
    gone: str = ""  # why it is of no use to this fetch (for good)
    why: str = ""  # the last thing that went wrong with it

    def has(self, index: int) -> bool:
        return (
            not self.gone
            and self.holding is not None
            and self.holding.have > index
            and index not in self.failed
        )


async def fetch_from_peer(
    source: HubFile | UrlFile,
    weights_dir: Path,
    peers: Sequence[Peer],
    trust: PeerTrust,
    *,
    target: Path | None = None,
    sha256: str | None = None,
    size: int | None = None,
    stall_s: float = 60.0,
    progress: ProgressCallback | None = None,
) -> Path:
    """The path of ``source``'s file on this node, taken from ``peers`` into
    ``weights_dir`` when it is not there yet; the same path, and the same file,
    as ``fetch`` would give.

    ``peers``: the agents that hold the file or are fetching it, in the order
    to ask them. ``trust``: this node's identity, and the fleet CA.
    ``target``, ``sha256``, ``size``, ``stall_s``, ``progress``: as ``fetch``'s.

    Raises:
        ValueError: ``sha256`` is not 64 hex digits.
        NoRoom: the weights directory has no room for the bytes still to come.
        Corrupt: the bytes are not the ones expected; nothing of them is kept.
        Stalled: nothing arrived, and no peer made progress, for ``stall_s``;
            the ``.part`` is kept, for this or a fetch from the source to resume.
        FetchError: no peer holds the file, or each that held the next chunk
            gave it wrong; the ``.part`` is kept.
    """
    if sha256 is not None:
        sha256 = sha256.lower()
        if not _SHA256.fullmatch(sha256):
            raise ValueError(f"sha256 {sha256!r} is not 64 hex digits (as sha256sum prints one)")
    if target is None:
        target = where(source, weights_dir)
    else:
        weights_dir = target.parent
    if await have(target, sha256):
        return target
    what = str(source)
    name = source.landing()
    states = [_State(p, _Link(p, trust)) for p in peers]
    try:
        reference = await _first(what, states, name, sha256, size, stall_s)
        fetch = _Fetch(what, name, target, states, reference, stall_s)
        part = parts.part_path(
            target,
            tag(
                Remote(url="", headers={}, size=reference.size, sha256=reference.sha256, etag=None)
            ),
        )
        kept = await trio.to_thread.run_sync(_prepare, weights_dir, target, part, reference.size)
        with parts.Part.open(part, target) as writing:
            fetch.writing, fetch.part = writing, part
            await fetch.run(kept, Reporter(progress, reference.size))
    finally:
        for s in states:
            await s.link.close()
    return target


class _Fetch:
    def __init__(
        self,
        what: str,
        name: PurePosixPath,
        target: Path,
        states: list[_State],
        reference: Chunks,
        stall_s: float,
    ) -> None:
        self.what = what
        self.name = name
        self.target = target
        self.states = states
        self.reference = reference
        self.stall_s = stall_s
        self.writing: parts.Part
        self.part: Path
        self.saved = 0  # hashes in the manifest saved beside the .part
        self.saved_at = -SAVE_S
        self.current: _State | None = None
        self.taken = 0  # bytes taken from peers by this call

    @property
    def size(self) -> int:
        return self.reference.size

    async def run(self, kept: int, report: Reporter) -> None:
        writing = self.writing
        await trio.to_thread.run_sync(self._keep, kept)
        await self._save(force=True)
        log.info(
            "taking %s (%s) from %s into %s%s",
            self.what,
            parts.human(self.size),
            ", ".join(str(s.peer) for s in self.states if not s.gone),
            self.target.parent,
            f", resuming at {parts.human(writing.size)}" if writing.size else "",
        )
        report(writing.size)
        with trio.CancelScope(deadline=trio.current_time() + self.stall_s) as clock:
            while writing.size < self.size:
                index = writing.size // self.reference.chunk_size
                data = await self._next(index, clock)
                if data is None:
                    continue
                await trio.to_thread.run_sync(writing.append, data)
                self.taken += len(data)
                clock.deadline = trio.current_time() + self.stall_s
                report(writing.size)
                await self._save()
        if clock.cancelled_caught:
            raise Stalled(
                f"{self.what}: no chunk arrived from a peer, and no peer made progress, for"
                f" {self.stall_s:g} s, at {parts.human(writing.size)} of {parts.human(self.size)}"
                f" ({self._peers_said()}); the partial file is kept and the next fetch resumes it"
            )
        await self._land(report)

    def _keep(self, kept: int) -> None:
        """Keep the whole chunks of the ``.part`` that match the reference."""
        writing, ref = self.writing, self.reference
        whole = chunk_files.whole(kept, ref.size, ref.chunk_size)
        writing.keep(min(whole * ref.chunk_size, ref.size))
        index = 0
        while writing.size < writing.kept and index < len(ref.hashes):
            start, length = ref.span(index)
            data = os.pread(writing.fd, length, start)
            if len(data) != length or digest(data) != ref.hashes[index]:
                break
            writing.hasher.update(data)
            writing.size += length
            index += 1
        if writing.size < writing.kept:
            writing.keep(writing.size)

    def _cut_back(self, index: int) -> None:
        """Drop chunk ``index`` and all after it from the ``.part``."""
        writing = self.writing
        writing.size, writing.hasher = 0, hashlib.sha256()
        writing.keep(index * self.reference.chunk_size)
        while writing.hash_kept():
            pass

    async def _next(self, index: int, clock: trio.CancelScope) -> bytes | None:
        """Chunk ``index``, checked; None when none came (the caller asks again)."""
        ref = self.reference
        now = trio.current_time()
        ready = [s for s in self.states if s.has(index) and s.down_until <= now]
        if index >= len(ref.hashes) or not ready:
            await self._wait_for(index, clock)
            return None
        s = self.current if self.current in ready else ready[0]
        assert s is not None
        _, length = ref.span(index)
        try:
            status, body = await s.link.get(
                request_target(self.name, ref.sha256, ref.size, index),
                length,
                min(self.stall_s, ASK_S),
            )
        except _Down as exc:
            self._down(s, str(exc))
            return None
        except PeerRefused as exc:
            self._gone(s, str(exc))
            return None
        if status == DAMAGED:
            s.failed.add(index)
            log.warning(
                "%s: chunk %d is damaged on %s; taking it elsewhere", self.what, index, s.peer
            )
            return None
        if status != OK:
            s.holding = None  # holds less than it said: ask it again
            self._down(s, f"answered {status}: {_line(body)}")
            return None
        if len(body) != length or digest(body) != ref.hashes[index]:
            s.failed.add(index)
            log.warning(
                "%s: chunk %d from %s is not the one listed (sha256 %s, not %s); taking it"
                " elsewhere",
                self.what,
                index,
                s.peer,
                digest(body),
                ref.hashes[index],
            )
            return None
        self.current = s
        return body

    async def _wait_for(self, index: int, clock: trio.CancelScope) -> None:
        """No peer can give chunk ``index`` now: ask them again, after a while."""
        if self._hopeless(index):
            held = [str(s.peer) for s in self.states if index in s.failed]
            raise FetchError(
                f"{self.what}: chunk {index} is damaged on every peer that holds it"
                f" ({', '.join(held)}); the {parts.human(self.writing.size)} before it are kept:"
                " fetch it from its source, which resumes them"
            )
        if all(s.gone for s in self.states):
            raise FetchError(f"{self.what}: no peer to take it from ({self._peers_said()})")
        await trio.sleep(POLL_S)
        before = sum(s.held for s in self.states)
        await _ask_all(self.states, self.name, self.reference.sha256, self.size, index)
        if sum(s.held for s in self.states) > before:
            clock.deadline = trio.current_time() + self.stall_s  # a peer got further
        await self._learn()

    def _hopeless(self, index: int) -> bool:
        """Every peer that held chunk ``index`` gave it wrong, and none may get another."""
        failed = [s for s in self.states if index in s.failed]
        waiting = [
            s
            for s in self.states
            if not s.gone
            and index not in s.failed
            and (s.holding is None or not s.holding.landed or s.holding.have > index)
        ]
        return bool(failed) and not waiting

    async def _learn(self) -> None:
        """Grow the reference with what the peers know now."""
        for s in self.states:
            h = s.holding
            if s.gone or h is None:
                continue
            if not h.chunks.same_file(self.reference):
                self._gone(s, "holds another version of the file now")
                continue
            differ = chunk_files.first_difference(self.reference.hashes, h.chunks.hashes)
            if differ is None:
                self.reference = chunk_files.merged(self.reference, h.chunks)
                continue
            if not h.landed:
                self._gone(s, f"its hash of chunk {differ} is not the one the others list")
                continue
            # a landed peer checked its whole file: its manifest is the one
            log.warning(
                "%s: %s, which holds the whole file, lists another chunk %d than the peer"
                " this fetch began with; taking it and what follows again",
                self.what,
                s.peer,
                differ,
            )
            self.reference = h.chunks
            if self.writing.size > differ * self.reference.chunk_size:
                await trio.to_thread.run_sync(self._cut_back, differ)
            await self._save(force=True)
        await self._save()

    async def _save(self, *, force: bool = False) -> None:
        """The reference, beside the ``.part``, for this node's listener to serve by."""
        ref = self.reference
        now = trio.current_time()
        if len(ref.hashes) == self.saved and not force:
            return
        if not force and not ref.complete and now - self.saved_at < SAVE_S:
            return
        await trio.to_thread.run_sync(chunk_files.save, self.part, ref)
        self.saved, self.saved_at = len(ref.hashes), now

    async def _land(self, report: Reporter) -> None:
        writing, part, ref = self.writing, self.part, self.reference
        on_disk = await trio.to_thread.run_sync(writing.sync)
        got = writing.hasher.hexdigest()
        if on_disk != ref.size or got != ref.sha256:
            await trio.to_thread.run_sync(_discard, part)
            raise Corrupt(
                f"{self.what}: the bytes taken from peers have sha256 {got} ({on_disk} bytes),"
                f" not {ref.sha256} ({ref.size} bytes) as the peers list; the partial file is"
                " deleted and the next fetch starts over"
            )
        await trio.to_thread.run_sync(_land, part, self.target, ref)
        log.info(
            "took %s from peers: %s, sha256 %s (%s taken, %s resumed)",
            self.what,
            self.target,
            got,
            parts.human(self.taken),
            parts.human(ref.size - self.taken),
        )
        report(ref.size, final=True)

    def _down(self, s: _State, why: str) -> None:
        s.why = why
        s.down_until = trio.current_time() + RETRY_S
        if self.current is s:
            self.current = None
        log.info("%s: %s: %s", self.what, s.peer, why)

    def _gone(self, s: _State, why: str) -> None:
        s.gone = s.why = why
        log.warning("%s: not taking it from %s: %s", self.what, s.peer, why)

    def _peers_said(self) -> str:
        return "; ".join(f"{s.peer}: {s.gone or s.why or 'no answer'}" for s in self.states)


async def _ask_all(
    states: list[_State], name: PurePosixPath, sha256: str | None, size: int | None, index: int
) -> None:
    """Ask each peer that may hold more than chunk ``index`` now what it holds."""
    now = trio.current_time()

    async def ask(s: _State) -> None:
        try:
            status, body = await s.link.get(
                request_target(name, sha256, size, None),
                MAX_MANIFEST,
                ASK_S,
            )
        except _Down as exc:
            s.why, s.down_until = str(exc), trio.current_time() + RETRY_S
            return
        except PeerRefused as exc:
            s.gone = s.why = str(exc)
            log.warning("not taking weights from %s: %s", s.peer, exc)
            return
        if status == DAMAGED:  # its copy is damaged: of no use until it is fetched again
            s.gone = s.why = _line(body)
            return
        if status in (NOT_HERE, TOO_EARLY):
            s.holding, s.why = None, _line(body)
            return
        if status != OK:
            s.why, s.down_until = f"answered {status}: {_line(body)}", trio.current_time() + RETRY_S
            return
        try:
            s.holding = read_holding(body)
        except ValueError as exc:
            s.gone = s.why = f"answered nonsense: {exc}"
            return
        s.held = max(s.held, s.holding.held)

    async with trio.open_nursery() as nursery:
        for s in states:
            if s.gone or s.down_until > now or (s.holding is not None and s.holding.landed):
                continue
            if s.holding is not None and s.holding.have > index and index not in s.failed:
                continue
            nursery.start_soon(ask, s)


async def _first(
    what: str,
    states: list[_State],
    name: PurePosixPath,
    sha256: str | None,
    size: int | None,
    stall_s: float,
) -> Chunks:
    """The reference manifest, once a peer holds the file: one named may be about
    to begin its own fetch (still asking its source), so they are asked again
    until ``stall_s`` has passed, or none is of use."""
    with trio.move_on_after(stall_s):
        while True:
            await _ask_all(states, name, sha256, size, 0)
            if any(s.holding is not None for s in states) or all(s.gone for s in states):
                break
            await trio.sleep(POLL_S)
    return _reference(what, states, sha256, size)


def _reference(what: str, states: list[_State], sha256: str | None, size: int | None) -> Chunks:
    """The manifest the fetch checks chunks against; raises when no peer holds the file."""
    holdings = [s for s in states if s.holding is not None]
    for s in holdings:
        assert s.holding is not None
        c = s.holding.chunks
        if (sha256 is not None and c.sha256 != sha256) or (size is not None and c.size != size):
            s.gone = s.why = f"holds another version (sha256 {c.sha256}, {c.size} bytes)"
            s.holding = None
    usable = [s.holding for s in states if s.holding is not None]
    if not usable:
        said = "; ".join(f"{s.peer}: {s.why or 'no answer'}" for s in states) or "none named"
        raise FetchError(f"{what}: no peer holds it ({said}): fetch it from its source")
    best = max(usable, key=lambda h: (h.landed, len(h.chunks.hashes)))
    for s in states:
        if s.holding is not None and not s.holding.chunks.same_file(best.chunks):
            s.gone = s.why = "holds another version than the other peers"
            s.holding = None
    return best.chunks


def _prepare(weights_dir: Path, target: Path, part: Path, size: int) -> int:
    """Check room for what is still to come and make way for the ``.part``: the
    bytes of it there are (as a fetch from the source does)."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    try:
        kept = part.stat().st_size
    except FileNotFoundError:
        kept = 0
    kept = kept if kept <= size else 0
    parts.check_room(weights_dir, target, size - kept)
    target.parent.mkdir(parents=True, exist_ok=True)
    parts.drop_stale(target, part)
    for manifest in target.parent.glob(f".{glob.escape(target.name)}.*.part.chunks"):
        if not manifest.with_name(manifest.name[1 : -len(".chunks")]).exists():
            manifest.unlink(missing_ok=True)  # of a .part that is gone (landed, or dropped)
    return kept


def _land(part: Path, target: Path, reference: Chunks) -> None:
    parts.land(part, target, reference.sha256)
    chunk_files.save(target, reference)
    chunk_files.drop(part)


def _discard(part: Path) -> None:
    part.unlink(missing_ok=True)
    chunk_files.drop(part)


def _line(body: bytes) -> str:
    return " ".join(body[:300].decode("utf-8", "replace").split())


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__

"""The agent-to-agent transfer listener: it serves the weights this node holds,
whole or still being fetched, to the other agents of the fleet.

Theory of operation
-------------------
A trio TCP listener; each connection does its TLS handshake within
``handshake_s`` (the context requires a client certificate signed by the
fleet CA: ``llmgw.tls.server_context``), then serves requests one after
another (``peerwire``), each head within ``idle_s``, until the client closes
or a request is refused. Past ``max_connections`` a connection is closed
unanswered.

What a node holds of a file (``_holding``) is looked up afresh at each
request, in this order:

1. The file landed under its name: its manifest (``chunks``), from
   ``.NAME.chunks``; a file landed without one (by a fetch from the source)
   has its chunks hashed now, at most ``hash_s`` a request, the hashes made so
   far kept in memory and the chunks they cover served meanwhile; once all
   are, the whole sha256 is compared with the file's record and the manifest
   saved beside it.
2. A ``.part`` with a manifest beside it (a peer fetch filling it): the
   chunks the ``.part`` holds whole.
3. The ``.part`` of the version the taker names by sha256 and size (a fetch
   from the source filling it, whose name that version sets): its whole
   chunks, hashed as in 1.

A chunk is read whole and checked against the manifest before its first byte
is sent: a node never serves bytes that are not the ones listed, and a
damaged copy is answered 409 (and said in the log) so the taker goes to
another peer. At most ``max_transfers`` chunks are read and sent at once,
each held to ``send_s``; a request that waits ``slot_s`` for its turn is
answered 503. Paths are checked twice: by their form (``check_relative``: no
``..``, nothing hidden, no ``.part``) and, with links followed, by where they
lead (``inside`` the weights directory).
"""

from __future__ import annotations

import glob
import logging
import os
import ssl
from pathlib import Path

import attrs
import h11
import trio

from llmgw.weights import chunks as chunk_files
from llmgw.weights import part as parts
from llmgw.weights.chunks import CHUNK_SIZE, Chunks, Hashing
from llmgw.weights.fetch import tag  # the one rule that names a version's .part
from llmgw.weights.peerwire import (
    BAD,
    BUSY,
    DAMAGED,
    MAX_HEAD,
    NOT_HERE,
    OK,
    REFUSED,
    TOO_EARLY,
    Asked,
    Holding,
    check_relative,
    holding_json,
    inside,
    next_event,
    parse_target,
    peer_name,
    send,
)
from llmgw.weights.transfer import Remote

log = logging.getLogger("llmgw.weights.peer")

SEND_BLOCK = 1 << 20
CLOSE_S = 2.0
LAZY_KEPT = 64  # files whose hashing is under way, remembered


@attrs.frozen
class ServeLimits:
    chunk_size: int = CHUNK_SIZE  # for the files it makes a manifest of
    max_transfers: int = 8  # chunks read and sent at once (each held in memory)
    max_connections: int = 64
    handshake_s: float = 10.0
    idle_s: float = 30.0  # for a request's head, a kept-alive connection's next one
    slot_s: float = 10.0  # a chunk's wait for its turn, before a 503
    send_s: float = 120.0  # a chunk's whole answer
    hash_s: float = 2.0  # hashing a file without a manifest, per request


class _Answer(Exception):
    """A request answered with an error: its status and one line."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


@attrs.define
class _Found:
    path: Path  # the landed file or the .part to read
    holding: Holding


class PeerServer:
    """Serves ``weights_dir`` to the fleet's agents; see the module docstring."""

    def __init__(
        self, weights_dir: Path, ssl_context: ssl.SSLContext, limits: ServeLimits = ServeLimits()
    ) -> None:
        self.weights_dir = weights_dir
        self.ssl_context = ssl_context
        self.limits = limits
        self.sent = 0  # chunk bytes sent, all files
        self.chunks_sent: dict[str, int] = {}  # by path asked
        self.refused: dict[int, int] = {}  # answers other than 200, by status
        self.connections = 0
        self._slots = trio.CapacityLimiter(limits.max_transfers)
        self._lazy: dict[Path, Hashing] = {}
        self._locks: dict[Path, trio.Lock] = {}
        self._damage_said: set[tuple[Path, int]] = set()

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host``:``port`` (0: any free port) until cancelled;
        ``task_status.started(listeners)`` says where."""
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self.handle, listeners)
            task_status.started(listeners)

    async def handle(self, tcp: trio.SocketStream) -> None:
        """Serve one connection; nothing it does can take the listener down."""
        peer = _address(tcp)
        if self.connections >= self.limits.max_connections:
            log.warning(
                "weights listener: %d connections open, the limit; closing one from %s",
                self.connections,
                peer,
            )
            await trio.aclose_forcefully(tcp)
            return
        self.connections += 1
        tls = trio.SSLStream(tcp, self.ssl_context, server_side=True)
        try:
            with trio.move_on_after(self.limits.handshake_s) as handshake:
                await tls.do_handshake()
            if handshake.cancelled_caught:
                log.info("weights listener: no TLS handshake from %s in time", peer)
                return
            who = f"{peer_name(tls.getpeercert())} ({peer})"
            await self._serve_requests(tls, who)
        except trio.BrokenResourceError:  # the taker went: done, or gave up
            log.debug("weights listener: connection from %s closed by the taker", peer)
        except (ssl.SSLError, h11.ProtocolError) as exc:
            log.info("weights listener: connection from %s ended: %s", peer, exc or type(exc))
        except Exception:
            log.exception("weights listener: connection from %s failed", peer)
        finally:
            self.connections -= 1
            with trio.move_on_after(CLOSE_S) as closing:
                closing.shield = True
                try:
                    await tls.aclose()
                except (trio.BrokenResourceError, ssl.SSLError):
                    pass
            if closing.cancelled_caught:
                await trio.aclose_forcefully(tcp)

    async def _serve_requests(self, tls: trio.SSLStream[trio.SocketStream], who: str) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        while True:
            event: h11.Event | type[h11.PAUSED] | None = None
            with trio.move_on_after(self.limits.idle_s):
                event = await next_event(conn, tls)
            if not isinstance(event, h11.Request):
                return  # closed, or no request in time (an idle client), or not one
            await self._answer(conn, tls, event, who)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _answer(
        self,
        conn: h11.Connection,
        tls: trio.SSLStream[trio.SocketStream],
        req: h11.Request,
        who: str,
    ) -> None:
        # a request carries no body here; one that says it does is refused below
        with trio.move_on_after(self.limits.idle_s) as ending:
            while not isinstance(
                await next_event(conn, tls), h11.EndOfMessage | h11.ConnectionClosed
            ):
                pass
        try:
            if ending.cancelled_caught or req.method != b"GET":
                raise _Answer(BAD, "only GET is served here, without a body")
            try:
                asked = parse_target(req.target)
            except ValueError as exc:
                raise _Answer(BAD, str(exc)) from None
            why = check_relative(asked.path)
            if why is not None:
                raise _Answer(REFUSED, f"{asked.path!s}: refused: {why}")
            target = await trio.to_thread.run_sync(inside, self.weights_dir, asked.path)
            if target is None:
                raise _Answer(REFUSED, f"{asked.path!s}: refused: outside the weights directory")
            found = await self._holding(target, asked)
            if asked.chunk is None:
                await self._send(conn, tls, OK, holding_json(found.holding), "application/json")
                return
            await self._send_chunk(conn, tls, asked, found, who)
        except _Answer as answer:
            self.refused[answer.status] = self.refused.get(answer.status, 0) + 1
            log.debug(
                "weights listener: %s asked %r: %d %s", who, req.target, answer.status, answer.why
            )
            await self._send(conn, tls, answer.status, answer.why.encode() + b"\n", "text/plain")

    async def _send_chunk(
        self,
        conn: h11.Connection,
        tls: trio.SSLStream[trio.SocketStream],
        asked: Asked,
        found: _Found,
        who: str,
    ) -> None:
        index = asked.chunk
        assert index is not None
        held = found.holding
        if index >= held.chunks.count:
            raise _Answer(BAD, f"{asked.path!s} has {held.chunks.count} chunks, no chunk {index}")
        if index >= held.have:
            raise _Answer(TOO_EARLY, f"{asked.path!s}: chunk {index} is not here whole yet")
        with trio.move_on_after(self.limits.slot_s) as waiting:
            await self._slots.acquire()
        if waiting.cancelled_caught:
            raise _Answer(
                BUSY, f"{self.limits.max_transfers} transfers under way: ask another peer"
            )
        try:
            try:
                data = await trio.to_thread.run_sync(
                    self.read_chunk, found.path, held.chunks, index
                )
            except (OSError, EOFError):  # gone (landed) or shorter (started over)
                self._lazy.pop(found.path, None)
                raise _Answer(
                    TOO_EARLY, f"{asked.path!s}: changing on this node, ask again"
                ) from None
            if data is None:
                self._damaged(found, index)
                raise _Answer(DAMAGED, f"{asked.path!s}: chunk {index} is damaged on this node")
            with trio.fail_after(self.limits.send_s):
                await self._send(conn, tls, OK, data, "application/octet-stream")
        finally:
            self._slots.release()
        self.sent += len(data)
        key = str(asked.path)
        self.chunks_sent[key] = self.chunks_sent.get(key, 0) + 1
        log.debug("weights listener: chunk %d of %s to %s", index, asked.path, who)

    async def _send(
        self,
        conn: h11.Connection,
        tls: trio.SSLStream[trio.SocketStream],
        status: int,
        body: bytes,
        kind: str,
    ) -> None:
        headers = [("content-type", kind), ("content-length", str(len(body)))]
        if status != OK:
            headers.append(("connection", "close"))
        with trio.fail_after(self.limits.send_s):
            await send(conn, tls, h11.Response(status_code=status, headers=headers))
            view = memoryview(body)
            for at in range(0, len(body), SEND_BLOCK):
                piece = view[at : at + SEND_BLOCK]  # h11 sends any buffer
                await send(conn, tls, h11.Data(data=piece))  # type: ignore[arg-type]
            await send(conn, tls, h11.EndOfMessage())

    def read_chunk(self, path: Path, manifest: Chunks, index: int) -> bytes | None:
        """Chunk ``index`` of ``path``, checked; None when its bytes are not the
        listed ones (blocking: run in a worker thread).

        Raises:
            OSError: ``path`` is gone.
            EOFError: ``path`` does not hold the chunk whole.
        """
        fd = os.open(path, os.O_RDONLY)
        try:
            return chunk_files.read_chunk(fd, manifest, index)
        finally:
            os.close(fd)

    # ------------------------------------------------------------ what is held

    async def _holding(self, target: Path, asked: Asked) -> _Found:
        lock = self._locks.setdefault(target, trio.Lock())
        try:
            async with lock:
                return await self._look(target, asked)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop(target, None)

    async def _look(self, target: Path, asked: Asked) -> _Found:
        st = await trio.to_thread.run_sync(_stat, target)
        if st is not None:
            return await self._landed(target, st, asked)
        for part, manifest in await trio.to_thread.run_sync(_parts, target, asked):
            found = await self._partial(part, manifest, asked)
            if found is not None:
                return found
        raise _Answer(NOT_HERE, f"{asked.path!s}: not on this node, in that version")

    async def _landed(self, target: Path, st: os.stat_result, asked: Asked) -> _Found:
        record, manifest = await trio.to_thread.run_sync(_landed_files, target)
        if asked.size is not None and st.st_size != asked.size:
            raise _Answer(NOT_HERE, f"{asked.path!s}: this node has another version (its size)")
        if asked.sha256 and record and asked.sha256 != record:
            raise _Answer(NOT_HERE, f"{asked.path!s}: this node has another version (its sha256)")
        if (
            manifest is not None
            and manifest.complete
            and manifest.size == st.st_size
            and (record is None or manifest.sha256 == record)
        ):
            return _Found(
                target, Holding(chunks=manifest, have=manifest.count, held=st.st_size, landed=True)
            )
        sha256 = record or asked.sha256
        if sha256 is None:
            raise _Answer(
                NOT_HERE, f"{asked.path!s}: here, but without its sha256 recorded yet: name one"
            )
        hashing = await self._hash(target, st.st_size, asked)
        if hashing.done:
            self._lazy.pop(target, None)
            whole = hashing.whole.hexdigest()
            if whole != sha256:
                log.error(
                    "weights %s: its bytes have sha256 %s, not %s as recorded: the file is"
                    " damaged; delete it so it is fetched again",
                    target,
                    whole,
                    sha256,
                )
                raise _Answer(DAMAGED, f"{asked.path!s}: damaged on this node")
            done = hashing.manifest(sha256)
            await trio.to_thread.run_sync(chunk_files.save, target, done)
            return _Found(
                target, Holding(chunks=done, have=done.count, held=st.st_size, landed=True)
            )
        m = hashing.manifest(sha256)
        return _Found(target, Holding(chunks=m, have=len(m.hashes), held=st.st_size, landed=True))

    async def _partial(self, part: Path, manifest: Chunks | None, asked: Asked) -> _Found | None:
        held = await trio.to_thread.run_sync(_size, part)
        if held is None:
            return None
        if manifest is not None:  # a peer fetch's: the chunks it checked as it wrote them
            have = min(
                len(manifest.hashes), chunk_files.whole(held, manifest.size, manifest.chunk_size)
            )
            return _Found(part, Holding(chunks=manifest, have=have, held=held, landed=False))
        assert asked.sha256 is not None and asked.size is not None  # _parts named it by them
        hashing = await self._hash(part, asked.size, asked)
        m = hashing.manifest(asked.sha256)
        return _Found(part, Holding(chunks=m, have=len(m.hashes), held=held, landed=False))

    async def _hash(self, path: Path, size: int, asked: Asked) -> Hashing:
        """The hashing of ``path``'s chunks, advanced for at most ``hash_s``."""
        hashing = self._lazy.get(path)
        if hashing is None or hashing.size != size or hashing.chunk_size != self.limits.chunk_size:
            hashing = Hashing(path, size, self.limits.chunk_size)
            self._lazy[path] = hashing
            while len(self._lazy) > LAZY_KEPT:
                del self._lazy[next(iter(self._lazy))]
        deadline = trio.current_time() + self.limits.hash_s
        try:
            while trio.current_time() < deadline and await trio.to_thread.run_sync(hashing.step):
                pass
        except OSError:
            self._lazy.pop(path, None)  # gone or replaced: landed, or started over
            raise _Answer(TOO_EARLY, f"{asked.path!s}: changing on this node, ask again") from None
        return hashing

    def _damaged(self, found: _Found, index: int) -> None:
        self._lazy.pop(found.path, None)  # hashed from other bytes: hash again
        if (found.path, index) in self._damage_said:
            return
        self._damage_said.add((found.path, index))
        if found.holding.landed:
            log.error(
                "weights %s: chunk %d does not match its manifest: this node's copy is"
                " damaged; delete it so it is fetched again",
                found.path,
                index,
            )
        else:
            log.warning(
                "weights %s: chunk %d no longer matches the hash it was served by: the fetch"
                " filling it changed it",
                found.path,
                index,
            )


# ---------------------------------------------------------------- blocking, in threads


def _stat(path: Path) -> os.stat_result | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st if os.path.isfile(path) else None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _landed_files(target: Path) -> tuple[str | None, Chunks | None]:
    return parts.read_record(target), chunk_files.load(target)


def _parts(target: Path, asked: Asked) -> list[tuple[Path, Chunks | None]]:
    """The ``.part`` files that may hold the version asked, with their manifests:
    those a peer fetch fills first (they say which version they are), then the one
    a fetch from the source fills, named by the version."""
    found: list[tuple[Path, Chunks | None]] = []
    named: Path | None = None
    if asked.sha256 is not None and asked.size is not None:
        named = parts.part_path(
            target,
            tag(Remote(url="", headers={}, size=asked.size, sha256=asked.sha256, etag=None)),
        )
    for p in sorted(target.parent.glob(f"{glob.escape(target.name)}.*.part")):
        manifest = chunk_files.load(p)
        if manifest is None:
            continue
        if asked.sha256 is not None and manifest.sha256 != asked.sha256:
            continue
        if asked.size is not None and manifest.size != asked.size:
            continue
        found.append((p, manifest))
    if named is not None and all(p != named for p, _ in found):
        found.append((named, None))
    return found


def _address(tcp: trio.SocketStream) -> str:
    try:
        host, port, *_ = tcp.socket.getpeername()
    except OSError:
        return "?"
    return f"{host}:{port}"

"""Moving a file's bytes over HTTP into its ``.part``, resuming, until whole.

Theory of operation
-------------------
``transfer`` asks for the bytes the ``.part`` lacks (``Range: bytes=N-``)
and hands them to a writer task, which writes and hashes them in a worker
thread a block at a time; a few blocks wait between the two, so the link and
the disk work at once.

A connection that is cut, or an answer cut short, is asked again from the
byte after the last one received; a server that answers the whole file to a
range (``200``) sends from zero, and the ``.part`` starts over with it. The
writer writes every block in the order received, so the next request always
starts where the ``.part`` will end.

One clock bounds it all: a trio cancel scope whose deadline moves ``stall_s``
ahead each time bytes arrive. Connecting, waiting for an answer, waiting for
the next byte and waiting before asking again all count against it; when it
fires, nothing arrived for ``stall_s`` (``Stalled``). httpx's own timeouts sit
a little behind it, so the clock is what says why.

The server is held to what the source said: a range that starts elsewhere,
a file of another size, or more bytes than the size end the transfer.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import httpx
import trio

from llmgw.weights.errors import Corrupt, FetchError, Stalled
from llmgw.weights.part import Part, human

PROGRESS_S = 0.25  # at most this often to the callback
RETRY_S = 0.5  # between a cut and asking again (counted on the clock)
BLOCK = 1 << 20  # written and hashed at once, in a worker thread
BLOCKS_AHEAD = 4  # received and waiting to be written


@attrs.frozen
class Remote:
    """What a source says its file is, and where to get its bytes."""

    url: str
    headers: dict[str, str]
    size: int
    sha256: str | None  # the source's own, where it gives one
    etag: str | None  # a strong ETag, sent as If-Range with a range


@attrs.frozen
class Progress:
    done: int  # bytes the file has so far (a resumed one starts with what it had)
    total: int
    rate: float  # bytes/s since the last report; 0 at the first


ProgressCallback = Callable[[Progress], None]


class Reporter:
    """Calls back at most every ``PROGRESS_S``, with the rate since the last call."""

    def __init__(self, callback: ProgressCallback | None, total: int) -> None:
        self.callback = callback
        self.total = total
        self.at: float | None = None
        self.done_at = 0

    def __call__(self, done: int, *, final: bool = False) -> None:
        if self.callback is None:
            return
        now = trio.current_time()
        if self.at is None:
            rate = 0.0
        elif final or now - self.at >= PROGRESS_S:
            rate = max(0, done - self.done_at) / max(now - self.at, 1e-9)
        else:
            return
        self.at, self.done_at = now, done
        self.callback(Progress(done=done, total=self.total, rate=rate))


@asynccontextmanager
async def client(verify: ssl.SSLContext | bool, bound_s: float) -> AsyncIterator[httpx.AsyncClient]:
    """A client for a source's server; ``bound_s`` bounds each of its waits."""
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(bound_s), verify=verify, follow_redirects=True
    ) as c:
        yield c


async def transfer(
    http: httpx.AsyncClient,
    remote: Remote,
    part: Part,
    *,
    stall_s: float,
    report: Reporter,
    what: str,
) -> None:
    """Fill ``part`` up to ``remote.size``.

    Raises:
        Stalled: no byte arrived for ``stall_s``; ``part`` holds what did.
        Corrupt: the server sent more than the size.
        NoRoom: the disk filled.
        FetchError: the server refused, or answered other bytes than asked for.
    """
    send, receive = trio.open_memory_channel[bytes | None](BLOCKS_AHEAD)  # None: from zero
    received = [part.size]  # handed to the writer, in order
    last = "no answer yet"
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, receive, part, report)
            async with send:  # closed at the end: the writer writes what it has, and ends
                with trio.CancelScope(deadline=trio.current_time() + stall_s) as clock:
                    while received[0] < remote.size:
                        try:
                            await _ask(http, remote, send, received, clock, stall_s, what)
                        except (httpx.TransportError, _Cut) as exc:
                            last = describe(exc)
                            await trio.sleep(RETRY_S)
    except BaseExceptionGroup as group:
        raise _single(group) from None
    if clock.cancelled_caught:
        raise Stalled(
            f"{what}: no byte arrived for {stall_s:g} s, at {human(part.size)} of"
            f" {human(remote.size)} (last: {last}); the partial file is kept and the next"
            " fetch resumes it"
        )


class _Cut(Exception):
    """The server ended an answer early, or is busy: worth asking again."""


async def _ask(
    http: httpx.AsyncClient,
    remote: Remote,
    send: trio.MemorySendChannel[bytes | None],
    received: list[int],
    clock: trio.CancelScope,
    stall_s: float,
    what: str,
) -> None:
    """One request, for the bytes from ``received[0]`` on."""
    start = received[0]
    headers = dict(remote.headers)
    headers["accept-encoding"] = "identity"  # the bytes as stored: their size is the file's
    if start:
        headers["range"] = f"bytes={start}-"
        if remote.etag:
            headers["if-range"] = remote.etag  # changed since: the whole, new file
    async with http.stream("GET", remote.url, headers=headers) as r:
        if r.status_code >= 500 or r.status_code == 429:
            raise _Cut(f"the server answered {r.status_code}")
        if r.status_code == 200 and start:  # no range from this server: from zero again
            await send.send(None)
            received[0] = 0
        elif r.status_code == 206:
            _check_range(r, start, remote.size, what)
        elif r.status_code != 200:
            raise FetchError(f"{what}: the server answered {r.status_code} to GET {_shown(r)}")
        buf = bytearray()
        handed = trio.current_time()
        try:
            async for chunk in r.aiter_raw():
                now = trio.current_time()
                clock.deadline = now + stall_s  # a byte: progress
                if received[0] + len(buf) + len(chunk) > remote.size:
                    raise Corrupt(
                        f"{what}: the server sent more than the {remote.size} bytes it said;"
                        " the partial file is deleted"
                    )
                buf += chunk
                # a block at a time, or what came in a while on a slow link: its
                # progress shows, and a crash loses little
                if len(buf) >= BLOCK or now - handed >= PROGRESS_S:
                    received[0] += len(buf)
                    await send.send(bytes(buf))
                    buf.clear()
                    handed = now
        finally:
            # What arrived before a cut or a stall is written too: the next request, or
            # the next fetch, starts after it. The writer takes it, or has ended (its
            # error or a cancel ends the fetch anyway).
            if buf:
                received[0] += len(buf)
                with trio.CancelScope(shield=True):
                    try:
                        await send.send(bytes(buf))
                    except trio.BrokenResourceError:
                        pass
        if received[0] < remote.size:
            raise _Cut(f"the answer ended at {human(received[0])} of {human(remote.size)}")


def _check_range(r: httpx.Response, start: int, size: int, what: str) -> None:
    said = str(r.headers.get("content-range", ""))
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", said)
    if m is None or int(m[1]) != start:
        raise FetchError(f"{what}: the server answered bytes {said!r} to a range from {start}")
    if m[3] != "*" and int(m[3]) != size:
        raise FetchError(
            f"{what}: the file changed during the fetch (it had {size} bytes, now {m[3]}):"
            " fetch again"
        )


async def _write(
    receive: trio.MemoryReceiveChannel[bytes | None], part: Part, report: Reporter
) -> None:
    async with receive:
        async for block in receive:
            if block is None:
                await trio.to_thread.run_sync(part.restart)
            else:
                await trio.to_thread.run_sync(part.append, block)
            report(part.size)


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that ended a nursery (the other task was only cancelled)."""
    errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
    first = errors[0] if errors else group
    return _single(first) if isinstance(first, BaseExceptionGroup) and first is not group else first


def _shown(r: httpx.Response) -> str:
    return str(r.url.copy_with(query=None))  # a signed URL's query is a secret


def describe(exc: BaseException) -> str:
    """One line of why: httpx's own errors are often empty, what they wrap (an
    ``ssl`` error, an ``OSError``) says it."""
    cause: BaseException | None = exc
    while cause is not None:
        text = " ".join(str(cause).split())
        if text:
            return text
        cause = cause.__cause__ or cause.__context__
    return type(exc).__name__

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

A busy server (``5xx``, ``429``) is asked again when it says
(``Retry-After``, in seconds or as an HTTP date); one that does not say, or
a cut, after a wait that doubles with each try that brought no byte, from
``RETRY_S`` up to ``RETRY_MAX_S`` (``retry_wait``). A try that brought bytes
starts the doubling over.

One clock bounds it all: a trio cancel scope whose deadline moves ``stall_s``
ahead each time bytes arrive. Connecting, waiting for an answer, waiting for
the next byte and waiting before asking again all count against it; when it
fires, nothing arrived for ``stall_s`` (``Stalled``). A server that asks to
be left alone longer than the clock has left is given up on at once, with
its words: waiting for the clock to fire would only say it later. httpx's
own timeouts sit a little behind the clock, so the clock is what says why.

The server is held to what the source said: a range that starts elsewhere,
a file of another size, or more bytes than the size end the transfer.

What a URL's file is (``probe``) is asked with a ``HEAD``; a URL signed for
``GET`` only (S3's, GCS's presigned URLs) refuses one (``403``, ``405``), and
is asked with a ``GET`` of its first byte instead: the size is the total of
its ``Content-Range``, and the ``ETag`` is the object's, as a ``HEAD`` says.

The counts a caller keeps for metrics come with each report (``Progress``):
the bytes this call read from the source (``fetched``), and those a ``.part``
already held when it began (``resumed``, 0 once a server sends from zero).
"""

from __future__ import annotations

import math
import re
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime

import attrs
import httpx
import trio

from llmgw.weights.errors import Corrupt, FetchError, Stalled
from llmgw.weights.part import Part, human

PROGRESS_S = 0.25  # at most this often to the callback
RETRY_S = 0.5  # between a cut and asking again (counted on the clock), at first
RETRY_MAX_S = 8.0  # ... doubling with each try that brought no byte, up to this
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
    commit: str | None = None  # the hub's commit the revision resolved to, for a hub file


@attrs.frozen
class Progress:
    done: int  # bytes the file has so far (a resumed one starts with what it had)
    total: int
    rate: float  # bytes/s since the last report; 0 at the first
    fetched: int = 0  # bytes read from the source by this call (for metrics by source)
    resumed: int = 0  # bytes a .part held when this call began, not read again


ProgressCallback = Callable[[Progress], None]


class Reporter:
    """Calls back at most every ``PROGRESS_S``, with the rate since the last call."""

    def __init__(self, callback: ProgressCallback | None, total: int) -> None:
        self.callback = callback
        self.total = total
        self.at: float | None = None
        self.done_at = 0
        self.fetched = 0  # kept by the writer, whether or not anyone is called back
        self.resumed = 0

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
        self.callback(
            Progress(
                done=done,
                total=self.total,
                rate=rate,
                fetched=self.fetched,
                resumed=self.resumed,
            )
        )


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
    gave_up = ""  # the server asked for a longer wait than the clock has left
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, receive, part, report)
            async with send:  # closed at the end: the writer writes what it has, and ends
                with trio.CancelScope(deadline=trio.current_time() + stall_s) as clock:
                    tries = 0  # in a row, without a byte
                    while received[0] < remote.size:
                        before = received[0]
                        try:
                            await _ask(http, remote, send, received, clock, stall_s, what)
                        except (httpx.TransportError, _Cut) as exc:
                            last = describe(exc)
                            tries = 1 if received[0] != before else tries + 1
                            asked = exc.retry_after if isinstance(exc, _Cut) else None
                            wait = retry_wait(tries, asked)
                            left = clock.deadline - trio.current_time()
                            if asked is not None and asked > left:
                                gave_up = (
                                    f"{what}: {last} and asks to be asked again in"
                                    f" {asked:.0f} s, later than this fetch waits for a byte"
                                    f" ({stall_s:g} s), at {human(received[0])} of"
                                    f" {human(remote.size)}; the partial file is kept and"
                                    " the next fetch resumes it"
                                )
                                break
                            await trio.sleep(wait)
    except BaseExceptionGroup as group:
        raise _single(group) from None
    if gave_up:
        raise Stalled(gave_up)
    if clock.cancelled_caught:
        raise Stalled(
            f"{what}: no byte arrived for {stall_s:g} s, at {human(part.size)} of"
            f" {human(remote.size)} (last: {last}); the partial file is kept and the next"
            " fetch resumes it"
        )


def retry_wait(tries: int, retry_after: float | None) -> float:
    """Seconds to wait before asking again, after ``tries`` in a row that brought
    no byte: what the server asked for (``Retry-After``), else ``RETRY_S``
    doubled with each such try, up to ``RETRY_MAX_S``. Never less than
    ``RETRY_S``: a server that says 0 is not asked in a tight loop."""
    if retry_after is not None:
        return max(RETRY_S, retry_after)
    return min(RETRY_S * (1 << min(max(tries - 1, 0), 30)), RETRY_MAX_S)


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds a ``Retry-After`` asks for, as a number or an HTTP date (``now``:
    the wall clock's time, what the date is against); None when it says
    neither."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a sloppy one says nothing
        return None
    seconds = when.timestamp() - now
    return max(0.0, seconds) if math.isfinite(seconds) else None


HEAD_REFUSED = (400, 403, 405, 501)  # a URL signed for GET only; a server without HEAD


async def probe(http: httpx.AsyncClient, url: str, what: str) -> Remote:
    """What the file at ``url`` is: its size and strong ETag, asked with a
    ``HEAD``, else with a ``GET`` of its first byte. The caller bounds the wait.

    Raises:
        httpx.HTTPError: the server could not be asked.
        FetchError: the server refused, or says no size.
    """
    headers = {"accept-encoding": "identity"}  # the size of the bytes as stored
    r = await http.head(url, headers=headers)
    length = str(r.headers.get("content-length", ""))
    if r.status_code == 200 and length.isdigit():
        return _remote(url, int(length), r)
    if r.status_code not in HEAD_REFUSED and r.status_code != 200:
        raise FetchError(f"{what}: the server answered {r.status_code} to a HEAD")
    head = f"{r.status_code} to a HEAD" if r.status_code != 200 else "no size to a HEAD"
    async with http.stream("GET", url, headers={**headers, "range": "bytes=0-0"}) as g:
        # the body is not read: one byte, or the whole file from a server without ranges
        said = str(g.headers.get("content-range", ""))
        total = re.fullmatch(r"bytes (?:\d+-\d+|\*)/(\d+)", said)
        length = str(g.headers.get("content-length", ""))
        if g.status_code in (206, 416) and total is not None:
            return _remote(url, int(total[1]), g)
        if g.status_code == 200 and length.isdigit():
            return _remote(url, int(length), g)
        if g.status_code in (200, 206):
            raise FetchError(
                f"{what}: the server says no size for the file (it answered {head}, and"
                " no Content-Range or Content-Length to a GET), so no room can be checked"
                " for it"
            )
        hint = ": has the URL's signature expired?" if g.status_code == 403 else ""
        raise FetchError(
            f"{what}: the server answered {head} and {g.status_code} to a GET of its"
            f" first byte{hint}"
        )


def _remote(url: str, size: int, r: httpx.Response) -> Remote:
    etag = r.headers.get("etag")
    return Remote(
        url=url,
        headers={},
        size=size,
        sha256=None,
        etag=etag if etag and not etag.startswith("W/") else None,
    )


class _Cut(Exception):
    """The server ended an answer early, or is busy: worth asking again,
    after ``retry_after`` seconds where it said so."""

    def __init__(self, why: str, retry_after: float | None = None) -> None:
        super().__init__(why)
        self.retry_after = retry_after


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
            wait = retry_after(r.headers.get("retry-after"), time.time())
            said = "" if wait is None else f" (Retry-After: {r.headers['retry-after']})"
            raise _Cut(f"the server answered {r.status_code}{said}", wait)
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
                report.resumed = 0
            else:
                await trio.to_thread.run_sync(part.append, block)
                report.fetched += len(block)
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

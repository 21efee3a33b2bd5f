"""Fetching a source's file into a node's weights directory, whole and verified.

Theory of operation
-------------------
``fetch`` brings one file to where its source lands (``source.where``);
``fetch_file`` does the same and says more of it (``Fetched``: the hub's
commit, the bytes read and resumed, whether a moving revision moved on):

1. A file already there is whole: nothing but a finished, verified fetch puts
   one there. It is used without asking the network, so a node starts its
   engine while the hub is down. Only a caller who expects another sha256
   than the file's (its record says, or its hash where it has none) has it
   fetched again and replaced; an engine that has the old one open keeps it.
   A caller who asks (``check_revision``) learns whether the hub's revision
   it came from, a branch such as ``main``, has moved on to another file:
   the hub is asked, a move is logged and returned (``Fetched.moved``), and
   the node keeps its file (a profile pins the commit or sha256 it wants); a
   hub that does not answer changes nothing.
2. Ask what the file is (``Remote``): its size, its sha256 where the source
   gives one, and where its bytes are. The hub is asked through
   huggingface_hub (``hub``): the size, the sha256 it keeps for a file in
   LFS, and the commit the revision resolves to. A URL is asked with a
   ``HEAD``, or, where it refuses one (a presigned URL), a ``GET`` of its
   first byte (``transfer.probe``): its size, and its ``ETag`` to resume
   only onto the same bytes. The caller's sha256 and size, where given, must
   agree with the source's, or nothing is fetched.
3. Check room, before anything is written: the bytes still to come against
   what ``statvfs`` says is free in the weights directory. It is a check, not
   a reservation: a disk that fills meanwhile fails the write with the same
   words (``NoRoom``), and what was written is kept for when there is room.
   With a ``budget`` (``budget.Budget``), the budget decides instead: it
   counts the file's whole size against its limit, beside the files landed
   and the other fetches in flight, checks the disk too, and evicts the
   weights unused for longest to make room, or fails saying what holds it.
   The fetch holds its room until it ends, landed or not.
4. The bytes go to a ``.part`` beside the target (``part``), resumed from what
   it holds after a crash or a cut, within one call and across calls
   (``transfer``), until it is whole or no byte arrived for ``stall_s``.
5. Verify the size, then the sha256: the caller's, else the hub's. A URL
   whose sha256 the caller does not give is verified by size only; nothing
   else vouches for its bytes. A mismatch deletes the ``.part`` (``Corrupt``).
6. Land: the ``.part`` is fsync-ed and renamed onto the target, so no one
   sees a partial file under the real name, and its sha256 is recorded
   beside it (``part.record_path``), and the hub's commit where it came from
   the hub (``part.commit_path``).

A file on a shared mount (``MountFile``) is not fetched: it must be there, of
the size the caller gives, and is used where it is (hashing it on every node
would read it over the mount as often as copying it would).

Everything that blocks (disk, hashing, huggingface_hub's calls) runs in worker
threads, a chunk at a time, so a fetch of tens of gigabytes never holds the
event loop and can be cancelled between chunks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import ssl
import stat
from pathlib import Path

import attrs
import httpx
import trio

from llmgw.weights import part as parts
from llmgw.weights.budget import Budget, Reservation
from llmgw.weights.errors import Corrupt, FetchError
from llmgw.weights.source import HubFile, HubRepo, MountFile, Source, UrlFile, where
from llmgw.weights.transfer import (
    ProgressCallback,
    Remote,
    Reporter,
    client,
    describe,
    probe,
    transfer,
)

log = logging.getLogger("llmgw.weights")

ASK_S = 30.0  # a HEAD, the hub's answer, a stat on a shared mount
HTTP_BEHIND_S = 5.0  # httpx's timeouts, behind the fetch's own clock

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@attrs.frozen
class Fetched:
    """What ``fetch_file`` did."""

    path: Path
    commit: str | None  # the hub's commit the file came from; None: not the hub, or unknown
    fetched: int = 0  # bytes read from the source by this call
    resumed: int = 0  # bytes a .part held from an earlier call, not read again
    moved: str | None = None  # check_revision: the commit the revision moved to, with
    # another file than this one (which the node keeps)


async def fetch(
    source: Source,
    weights_dir: Path,
    *,
    target: Path | None = None,
    sha256: str | None = None,
    size: int | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    verify: ssl.SSLContext | bool = True,
    stall_s: float = 60.0,
    progress: ProgressCallback | None = None,
    budget: Budget | None = None,
) -> Path:
    """The path of ``source``'s file on this node, fetched into ``weights_dir``
    when it is not there yet: ``fetch_file``'s, which see; a whole repository's
    folder, ``repo.fetch_repo``'s (``sha256`` and ``size`` are for one file, and
    not used for it)."""
    if isinstance(source, HubRepo):
        from llmgw.weights.repo import fetch_repo

        return await fetch_repo(
            source,
            weights_dir,
            target=target,
            token=token,
            endpoint=endpoint,
            stall_s=stall_s,
            progress=progress,
            budget=budget,
        )
    fetched = await fetch_file(
        source,
        weights_dir,
        target=target,
        sha256=sha256,
        size=size,
        token=token,
        endpoint=endpoint,
        verify=verify,
        stall_s=stall_s,
        progress=progress,
        budget=budget,
    )
    return fetched.path


async def fetch_file(
    source: Source,
    weights_dir: Path,
    *,
    target: Path | None = None,
    sha256: str | None = None,
    size: int | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    verify: ssl.SSLContext | bool = True,
    stall_s: float = 60.0,
    progress: ProgressCallback | None = None,
    budget: Budget | None = None,
    check_revision: bool = False,
) -> Fetched:
    """``source``'s file on this node, fetched into ``weights_dir`` when it is
    not there yet, and what it took.

    ``target``: where the file lands instead of where the source says
    (``source.where``), a profile's ``model_path`` beside its source; its
    folder is then the one checked for room. ``sha256`` and ``size``: what
    the caller expects (a profile's pin); the fetch fails when the source says
    otherwise. ``token``, ``endpoint``: the
    hub's (None: huggingface_hub's rules, ``HF_TOKEN`` and ``HF_ENDPOINT``
    among them). ``verify``: whom to trust for the bytes' TLS (the hub's
    answer is asked with huggingface_hub's own trust). ``stall_s``: how long
    without a byte before giving up. ``progress``: called a few times a second.
    ``budget``: the weights directory's, when the target is in it: room is
    made within it (evicting), instead of only checked on the disk.
    ``check_revision``: for a hub file already there from a revision that
    moves, ask the hub whether it moved on to another file (``Fetched.moved``).

    Raises:
        ValueError: ``sha256`` is not 64 hex digits.
        NoRoom: the weights directory (or its budget) has no room for the
            bytes still to come.
        Corrupt: the bytes are not the ones expected; nothing of them is kept.
        Stalled: no byte arrived for ``stall_s``; the ``.part`` is kept.
        FetchError: the source could not be asked, or refused; a ``.part`` is
            kept.
    """
    if sha256 is not None:
        sha256 = sha256.lower()
        if not _SHA256.fullmatch(sha256):
            raise ValueError(f"sha256 {sha256!r} is not 64 hex digits (as sha256sum prints one)")
    if isinstance(source, MountFile):
        return Fetched(await _on_mount(where(source, weights_dir), size), commit=None)
    if isinstance(source, HubRepo):
        raise ValueError(f"{source} is a whole repository: fetch it with fetch")
    if target is None:
        target = where(source, weights_dir)
    else:
        weights_dir = target.parent
    if await have(target, sha256):
        commit = await trio.to_thread.run_sync(parts.read_commit, target)
        moved = None
        if check_revision and isinstance(source, HubFile):
            moved = await _moved(source, target, commit, token=token, endpoint=endpoint)
        return Fetched(target, commit=commit, moved=moved)
    remote = await ask(source, token=token, endpoint=endpoint, verify=verify)
    expected = _expect(str(source), remote, sha256, size)
    part = parts.part_path(target, tag(remote))
    if budget is not None and not budget.covers(target):
        budget = None  # a target outside its folder: the disk's room is what counts
    kept, room = await trio.to_thread.run_sync(
        _prepare, weights_dir, target, part, remote.size, budget
    )
    try:
        return await _fetch_into(
            source, target, part, kept, remote, expected, sha256, verify, stall_s, progress
        )
    finally:
        if room is not None:
            room.release()


async def _fetch_into(
    source: HubFile | UrlFile,
    target: Path,
    part: Path,
    kept: int,
    remote: Remote,
    expected: str | None,
    sha256: str | None,
    verify: ssl.SSLContext | bool,
    stall_s: float,
    progress: ProgressCallback | None,
) -> Fetched:
    report = Reporter(progress, remote.size)
    with parts.Part.open(part, target) as writing:
        kept = await trio.to_thread.run_sync(writing.keep, kept)
        report.resumed = kept
        while await trio.to_thread.run_sync(writing.hash_kept):
            pass
        log.info(
            "fetching %s%s (%s) into %s%s",
            source,
            f" at commit {remote.commit}" if remote.commit else "",
            parts.human(remote.size),
            target.parent,
            f", resuming at {parts.human(kept)}" if kept else "",
        )
        report(writing.size)
        try:
            async with client(verify, stall_s + HTTP_BEHIND_S) as http:
                await transfer(
                    http, remote, writing, stall_s=stall_s, report=report, what=str(source)
                )
            on_disk = await trio.to_thread.run_sync(writing.sync)
            if on_disk != remote.size:
                raise Corrupt(
                    f"{source}: {on_disk} bytes were written, not the {remote.size} the source"
                    " says; the partial file is deleted and the next fetch starts over"
                )
            got = writing.hasher.hexdigest()
            if expected is not None and got != expected:
                raise Corrupt(
                    f"{source}: the bytes fetched have sha256 {got}, not {expected} as"
                    f" {'the profile' if sha256 else 'the source'} says; the partial file is"
                    " deleted and the next fetch starts over"
                )
        except Corrupt:
            await trio.to_thread.run_sync(lambda: part.unlink(missing_ok=True))
            raise
        await trio.to_thread.run_sync(parts.land, part, target, got, remote.commit)
    log.info(
        "fetched %s: %s, sha256 %s%s%s (%s read, %s resumed)",
        source,
        target,
        got,
        "" if expected else " (not checked: the source gives none)",
        f", commit {remote.commit}" if remote.commit else "",
        parts.human(report.fetched),
        parts.human(report.resumed),
    )
    report(remote.size, final=True)
    return Fetched(target, commit=remote.commit, fetched=report.fetched, resumed=report.resumed)


def _prepare(
    weights_dir: Path, target: Path, part: Path, size: int, budget: Budget | None
) -> tuple[int, Reservation | None]:
    """Check room for what is still to come (or have ``budget`` make it and hold
    it: the caller releases it), and make way for the ``.part``: the bytes of it
    to keep."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    try:
        kept = part.stat().st_size
    except FileNotFoundError:
        kept = 0
    kept = kept if kept <= size else 0  # longer than the file: not this file's bytes
    parts.drop_stale(target, part)  # first: a budget must not evict for their bytes
    room = None
    if budget is None:
        parts.check_room(weights_dir, target, size - kept)
    else:
        room = budget.reserve(target, part, size, kept)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except BaseException:
        if room is not None:
            room.release()
        raise
    return kept, room


def tag(remote: Remote) -> str:
    """Names the ``.part`` of these bytes: another version of the file, another tag."""
    ident = f"{remote.sha256 or remote.etag or ''}/{remote.size}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


async def _on_mount(path: Path, size: int | None) -> Path:
    try:
        with trio.fail_after(ASK_S):  # a hung network mount must not hang the caller
            st = await trio.to_thread.run_sync(os.stat, path, abandon_on_cancel=True)
    except FileNotFoundError:
        raise FetchError(f"{path} is not on this node: is the shared mount mounted here?") from None
    except trio.TooSlowError:
        raise FetchError(f"{path}: no answer from its mount in {ASK_S:g} s") from None
    except OSError as exc:
        raise FetchError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FetchError(f"{path} is not a file: name the weights file itself")
    if size is not None and st.st_size != size:
        raise Corrupt(f"{path} has {st.st_size} bytes, not the {size} the profile says")
    return path


async def have(target: Path, sha256: str | None) -> bool:
    """Whether ``target`` is there and the one wanted (its record says, else its hash)."""
    if not await trio.to_thread.run_sync(target.is_file):
        return False
    if sha256 is None:
        return True
    recorded = await trio.to_thread.run_sync(parts.read_record, target)
    if recorded is None:  # landed, but its record was not written: a crash between
        hashing = parts.FileHash(target)
        while await trio.to_thread.run_sync(hashing.step):
            pass
        recorded = hashing.hasher.hexdigest()
        await trio.to_thread.run_sync(parts.write_record, target, recorded)
    return recorded == sha256


async def ask(
    source: HubFile | UrlFile,
    *,
    token: str | None,
    endpoint: str | None,
    verify: ssl.SSLContext | bool,
) -> Remote:
    if isinstance(source, HubFile):
        from llmgw.weights import hub  # huggingface_hub only for a node that asks the hub

        try:
            with trio.fail_after(2 * ASK_S):  # the library's own timeout is per wait
                answer = await trio.to_thread.run_sync(
                    lambda: hub.ask(source, token=token, endpoint=endpoint, timeout=ASK_S),
                    abandon_on_cancel=True,
                )
        except trio.TooSlowError:
            raise FetchError(f"{source}: the hub did not answer in {2 * ASK_S:g} s") from None
        return Remote(
            url=answer.location,
            headers=answer.headers,
            size=answer.size,
            sha256=answer.sha256,
            etag=None,  # a CDN's ETag is not the hub's; the sha256 ties the bytes
            commit=answer.commit,
        )
    try:
        async with client(verify, ASK_S) as http:
            with trio.fail_after(ASK_S):
                return await probe(http, source.url, str(source))
    except (httpx.HTTPError, trio.TooSlowError) as exc:
        why = f"no answer in {ASK_S:g} s" if isinstance(exc, trio.TooSlowError) else describe(exc)
        raise FetchError(f"{source}: cannot ask the server for the file: {why}") from None


async def _moved(
    source: HubFile, target: Path, commit: str | None, *, token: str | None, endpoint: str | None
) -> str | None:
    """The commit ``source``'s revision is at now, where its file there is not
    the one at ``target`` (from ``commit``); None when it is, when the revision
    is a commit, or when the hub does not answer (said, and nothing else)."""
    if _COMMIT.fullmatch(source.revision):
        return None  # a commit never moves
    try:
        remote = await ask(source, token=token, endpoint=endpoint, verify=True)
    except FetchError as exc:
        log.info(
            "%s: cannot ask whether %s moved (%s); using %s", source, source.revision, exc, target
        )
        return None
    if remote.commit is None or remote.commit == commit:
        return None
    held = await trio.to_thread.run_sync(parts.read_record, target)
    if remote.sha256 is not None and remote.sha256 == held:
        return None  # another commit, the same file
    log.warning(
        "%s: %s is now at commit %s on the hub, with another file than the one this node"
        " holds (%s, from %s); the node keeps using its own: pin the commit or the sha256"
        " the profile means to fetch the new one",
        source,
        source.revision,
        remote.commit,
        target,
        f"commit {commit}" if commit else "an unrecorded commit",
    )
    return remote.commit


def _expect(what: str, remote: Remote, sha256: str | None, size: int | None) -> str | None:
    """The sha256 the bytes must have; the caller's and the source's must agree."""
    if size is not None and size != remote.size:
        raise Corrupt(
            f"{what}: the source's file has {remote.size} bytes, the profile says {size}:"
            " pin the revision the profile means, or correct its size"
        )
    if sha256 is not None and remote.sha256 is not None and sha256 != remote.sha256:
        raise Corrupt(
            f"{what}: the source's file has sha256 {remote.sha256}, the profile says"
            f" {sha256}: pin the revision the profile means, or correct its sha256"
        )
    return sha256 or remote.sha256

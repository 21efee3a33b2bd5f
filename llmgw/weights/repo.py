"""Fetching a whole hub repository (``HubRepo``): a folder, file by file.

Theory of operation
-------------------
vLLM loads a model from a folder (``config.json``, the tokenizer, the
safetensors shards); a profile names it as ``hf://ORG/REPO[@REVISION]``.
``fetch_repo`` asks the hub for the repository's files at the revision
(``hub.list_repo``: each file's size, and its sha256 where it is kept in
LFS, as weights are), then fetches each one as the file source it is
(``HubRepo.file``) with ``fetch``: resumable, verified, landed whole under
its own name, so each file of the folder is fetched, resumed and found as
any file source is.

The folder is whole when every file is: the files land in an order that
puts ``config.json`` last, since that is what makes a folder a model to
anyone who looks (discovery, vLLM), and a list of what it holds is written
beside it last of all (``.NAME.files``). A folder with that list, and every
file of it there at its size, is whole: used without asking the network, as
a landed file is. Progress is the whole folder's: bytes of all its files.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import trio

from llmgw.files import write_atomic
from llmgw.weights import part as parts
from llmgw.weights.budget import Budget
from llmgw.weights.errors import FetchError
from llmgw.weights.source import HubFile, HubRepo, where
from llmgw.weights.transfer import Progress, ProgressCallback

if TYPE_CHECKING:
    from llmgw.weights.hub import RepoEntry

# a file of a repository taken elsewhere first (from peers): the file, where it lands,
# its sha256 and size as the hub lists them, and the progress callback; None when it
# could not be had there (the hub is asked, resuming what came)
TakeFirst = Callable[[HubFile, Path, str | None, int, ProgressCallback], Awaitable[Path | None]]

ASK_S = 30.0
LAST = "config.json"  # what makes a folder a model: it lands after everything else


class _Entry(msgspec.Struct, frozen=True):
    path: str
    size: int


def files_path(folder: Path) -> Path:
    """Beside a whole folder: what it holds, written once every file landed."""
    return folder.with_name(f".{folder.name}.files")


def _whole(folder: Path) -> bool:
    try:
        listed = msgspec.json.decode(files_path(folder).read_bytes(), type=list[_Entry])
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return False
    for e in listed:
        try:
            if (folder / e.path).stat().st_size != e.size:
                return False
        except OSError:
            return False
    return True


async def fetch_repo(
    source: HubRepo,
    weights_dir: Path,
    *,
    target: Path | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    stall_s: float = 60.0,
    progress: ProgressCallback | None = None,
    budget: Budget | None = None,
    first: TakeFirst | None = None,
) -> Path:
    """The folder of ``source`` on this node, fetched into ``weights_dir`` (or to
    ``target``) when it is not whole there yet.

    ``budget``: as ``fetch``'s, file by file (files under a folder in use are never
    evicted). ``first``: where to try each file before the hub (peers); None, or
    its None, for a file: from the hub.

    Raises:
        NoRoom: the disk has no room for the bytes still to come.
        Corrupt: a file's bytes are not the hub's; that file's ``.part`` is gone.
        Stalled: no byte arrived for ``stall_s``.
        FetchError: the hub could not be asked, or refused.
    """
    from llmgw.weights import hub  # huggingface_hub only for a node that asks the hub
    from llmgw.weights.fetch import fetch

    folder = target or where(source, weights_dir)
    if await trio.to_thread.run_sync(_whole, folder):
        return folder
    try:
        with trio.fail_after(2 * ASK_S):
            listed = await trio.to_thread.run_sync(
                lambda: hub.list_repo(source, token=token, endpoint=endpoint, timeout=ASK_S),
                abandon_on_cancel=True,
            )
    except trio.TooSlowError:
        raise FetchError(f"{source}: the hub did not list its files in {2 * ASK_S:g} s") from None
    for e in listed:
        if e.path.startswith("/") or ".." in e.path.split("/"):
            raise FetchError(f"{source}: the hub lists a file named {e.path!r}: refused")
    order = sorted(listed, key=lambda e: (e.path == LAST, e.path))
    total = sum(e.size for e in order)
    have = await trio.to_thread.run_sync(lambda: _landed_bytes(folder, order))
    folder.parent.mkdir(parents=True, exist_ok=True)
    await trio.to_thread.run_sync(parts.check_room, folder.parent, folder, total - have)
    before = 0  # bytes of the files done, as the folder's progress counts them
    for e in order:

        def one(p: Progress, base: int = before) -> None:
            if progress is not None:
                progress(Progress(done=base + p.done, total=total, rate=p.rate))

        file = source.file(e.path)
        got = None
        if first is not None and not _landed(folder / e.path, e.size):
            got = await first(file, folder / e.path, e.sha256, e.size, one)
        if got is None:
            await fetch(
                file,
                weights_dir,
                target=folder / e.path,
                sha256=e.sha256,
                size=e.size,
                token=token,
                endpoint=endpoint,
                stall_s=stall_s,
                progress=one,
                budget=budget,
            )
        before += e.size
    entries = [_Entry(e.path, e.size) for e in order]
    await trio.to_thread.run_sync(
        lambda: write_atomic(files_path(folder), msgspec.json.encode(entries), 0o644)
    )
    return folder


def _landed(path: Path, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def _landed_bytes(folder: Path, entries: list[RepoEntry]) -> int:
    return sum(e.size for e in entries if _landed(folder / e.path, e.size))

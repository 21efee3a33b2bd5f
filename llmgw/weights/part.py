"""The files a fetch keeps beside its target: the ``.part`` its bytes go to until
they are whole, and the record of a landed file's sha256.

Theory of operation
-------------------
``NAME.TAG.part`` (``part_path``) holds the bytes of one version of the file:
the tag names what the source said the file is (its sha256 or ETag, and its
size), so bytes of another version are never resumed onto; ``drop_stale``
removes those. A fetch holds an exclusive ``flock`` on its ``.part`` while it
writes (``Part.open``): a second fetch of the same file on the node fails
saying so instead of writing the same bytes twice over each other.

``Part`` knows its size and the sha256 of what it holds, so the hash is ready
when the last byte is written; a kept ``.part`` is hashed once when a fetch
resumes it. Its methods block (disk writes, hashing): the fetch calls them in
worker threads, a block or a chunk at a time.

A landed file (``land``) got there by ``os.replace`` of its whole, verified
``.part``; its sha256 is then recorded in ``.NAME.sha256`` (``record_path``),
as ``sha256sum`` writes it, so ``sha256sum -c`` checks it by hand, and the
hub's commit it came from, where it came from the hub, in ``.NAME.commit``
(``commit_path``). The old records go before the rename: a crash between
leaves no record, never a wrong one, and a file without a record is hashed
when a caller asks for a sha256.

Every file kept about a landed file is a hidden sibling, ``.NAME.KIND``
(``SIDECARS``: its sha256, its commit, its last use, the chunks a peer
transfer verified), so whoever removes the file removes them all
(``sidecars``), and a listing of the folder's visible files is a listing of
the weights it holds.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw.files import write_atomic
from llmgw.weights.errors import FetchError, NoRoom

HASH_CHUNK = 16 << 20  # of a kept .part or a landed file, read and hashed per call

_TAGGED = re.compile(r"\.[0-9a-f]{16}\.part")
_PART = re.compile(r".+\.[0-9a-f]{16}\.part")
_COMMIT = re.compile(r"[0-9a-f]{40}")

# what is kept beside a landed NAME, as .NAME.KIND: its sha256 (here), the hub's
# commit it came from (here), its last use (budget), what a peer verified (chunks)
SIDECARS = ("sha256", "commit", "used", "chunks")


def part_path(target: Path, tag: str) -> Path:
    """Where the bytes of ``target`` (of the version ``tag`` names) are written
    until they are whole."""
    return target.with_name(f"{target.name}.{tag}.part")


def record_path(target: Path) -> Path:
    """The sha256 of a landed ``target``, as ``sha256sum`` writes it."""
    return target.with_name(f".{target.name}.sha256")


def commit_path(target: Path) -> Path:
    """The hub's commit a landed ``target`` came from."""
    return target.with_name(f".{target.name}.commit")


def sidecars(target: Path) -> list[Path]:
    """Every file kept beside a landed ``target`` about it (``SIDECARS``)."""
    return [target.with_name(f".{target.name}.{kind}") for kind in SIDECARS]


def is_part(path: Path) -> bool:
    """Whether ``path`` is a fetch's ``.part`` (``part_path``)."""
    return _PART.fullmatch(path.name) is not None


def landed_name(part: Path) -> str:
    """The name of the file a ``.part`` is the bytes of."""
    return part.name[: -len(".0123456789abcdef.part")]


def read_commit(target: Path) -> str | None:
    """The hub's commit recorded for ``target``; None without a record."""
    try:
        text = commit_path(target).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _COMMIT.fullmatch(text) else None


def read_record(target: Path) -> str | None:
    """The sha256 recorded for ``target``; None without a record."""
    try:
        text = record_path(target).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    digest = text.split(" ", 1)[0]
    return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


def write_record(target: Path, sha256: str) -> None:
    write_atomic(record_path(target), f"{sha256}  {target.name}\n".encode(), mode=0o644)


def free_bytes(path: Path) -> int:
    """What an unprivileged writer may still write on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_room(weights_dir: Path, target: Path, needed: int) -> None:
    """Raises:
    NoRoom: ``weights_dir`` has less than ``needed`` bytes free."""
    free = free_bytes(weights_dir)
    if needed > free:
        raise NoRoom(
            f"no room for {target.name} in {weights_dir}: {human(needed)} needed,"
            f" {human(free)} free"
        )


def drop_stale(target: Path, keep: Path | None) -> None:
    """Remove the ``.part`` files of ``target`` but ``keep``: bytes of a version
    the source no longer has (all of them, ``keep`` None: the file is evicted).
    One another fetch is writing stays."""
    for p in target.parent.glob(f"{glob.escape(target.name)}.*.part"):
        if p == keep or not _TAGGED.fullmatch(p.name[len(target.name) :]):
            continue
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            p.unlink(missing_ok=True)
        except OSError:
            pass  # locked: another fetch's, for it to finish or drop
        finally:
            os.close(fd)


class Part:
    """The ``.part`` being written: its size, and the sha256 of what it holds."""

    def __init__(self, path: Path, fd: int, what: str) -> None:
        self.path = path
        self.fd = fd
        self.what = what  # the target's name, in messages
        self.size = 0
        self.kept = 0  # bytes that were there when the fetch began (``keep``)
        self.hasher = hashlib.sha256()

    @classmethod
    @contextmanager
    def open(cls, path: Path, target: Path) -> Iterator[Part]:
        """The ``.part`` at ``path``, created if need be, locked while in use.

        Raises:
            FetchError: another fetch on this node is writing it.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FetchError(
                    f"{target} is being fetched already, by another fetch on this node"
                ) from None
            yield cls(path, fd, target.name)
        finally:
            os.close(fd)  # and the lock with it

    def keep(self, kept: int) -> int:
        """Keep the first ``kept`` bytes, dropping any past them; ``hash_kept``
        then hashes them. What it keeps: fewer when the ``.part`` has fewer now
        (another process removed it between the look and the lock)."""
        kept = min(kept, os.fstat(self.fd).st_size)  # never extend it with zeros
        os.ftruncate(self.fd, kept)
        self.kept = kept
        return kept

    def hash_kept(self) -> bool:
        """Hash the next chunk of the kept bytes; False once all are."""
        n = min(HASH_CHUNK, self.kept - self.size)
        if n <= 0:
            return False
        data = os.pread(self.fd, n, self.size)
        if len(data) != n:
            raise FetchError(f"{self.path} shrank while it was read: another writer?")
        self.hasher.update(data)
        self.size += n
        return True

    def append(self, block: bytes) -> None:
        """Raises:
        NoRoom: the disk filled; what was written is kept.
        FetchError: any other write error."""
        view = memoryview(block)
        offset = self.size
        try:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                os.ftruncate(self.fd, self.size)  # what a resume may take as fetched
                raise NoRoom(
                    f"no room left for {self.what} in {self.path.parent} after"
                    f" {human(self.size)} of it ({human(free_bytes(self.path.parent))} free):"
                    " the partial file is kept for when there is"
                ) from None
            raise FetchError(f"{self.path}: cannot write: {exc.strerror}") from None
        self.hasher.update(block)
        self.size += len(block)

    def restart(self) -> None:
        """From zero: the server sends the whole file again."""
        os.ftruncate(self.fd, 0)
        self.size = 0
        self.hasher = hashlib.sha256()

    def sync(self) -> int:
        """Make what was written durable; its size on disk."""
        os.fsync(self.fd)
        return os.fstat(self.fd).st_size


def land(part: Path, target: Path, sha256: str, commit: str | None = None) -> None:
    """Rename the whole, verified ``part`` onto ``target`` and record its sha256,
    and the hub's ``commit`` it came from."""
    record_path(target).unlink(missing_ok=True)
    commit_path(target).unlink(missing_ok=True)
    os.replace(part, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself, through a crash
    finally:
        os.close(fd)
    write_record(target, sha256)
    if commit is not None:
        write_atomic(commit_path(target), f"{commit}\n".encode(), mode=0o644)


class FileHash:
    """The sha256 of a landed file, a chunk per ``step`` (each a blocking read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.hasher = hashlib.sha256()

    def step(self) -> bool:
        """Hash the next chunk; False once the whole file is."""
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read(HASH_CHUNK)
        self.hasher.update(data)
        self.offset += len(data)
        return bool(data)


def human(n: int) -> str:
    """Bytes as an operator reads them at a glance: 1.5 GiB, 300.0 MiB, 512 B."""
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exp:.1f} {'KMGT'[exp - 1]}iB"

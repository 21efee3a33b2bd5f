"""The chunk manifest of a weights file: what lets a node take it from a peer a
chunk at a time, each chunk checked as it arrives.

Theory of operation
-------------------
A file is cut into chunks of ``chunk_size`` bytes (the last one shorter), and
its manifest (``Chunks``) lists the sha256 of each, with the file's size and
its whole sha256. A peer's chunk is written only if its sha256 is the one
listed; the whole sha256 is still checked when the file is whole, against the
profile's or the source's as a fetch from the source is, so what the
manifest vouches for is each chunk on its way, and what vouches for the file
is the same check as ever.

Where a manifest comes from, by what the node holds:

- A landed file: ``.NAME.chunks`` beside it (``chunks_path``), written once,
  when a peer fetch lands it (it knows every hash), or the first time a peer
  asks for a file landed without one (``Hashing``: each chunk hashed once, the
  whole sha256 compared with the file's record, then saved), so serving it
  later is a read of a small file.
- A ``.part`` a peer fetch is filling: ``.NAME.TAG.part.chunks`` beside it,
  the hashes the taker learnt from its own peer (all of them, or those its
  peer knew so far, rewritten as it learns more). The chunks of the ``.part``
  that are whole are servable at once: the taker wrote each only once its
  hash matched, and the ``.part`` grows from its first byte on, never with a
  hole.
- A ``.part`` a fetch from the source is filling (``fetch``) has no manifest:
  the source gives only the whole sha256. Its whole chunks are hashed as a
  peer asks (``Hashing`` again), the hash of a chunk being that of its bytes
  as first read; the whole sha256 checked at the end, on every node, is what
  finds a source that sent wrong bytes.

This module is pure but for the blocking file functions at its end, which the
callers run in worker threads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated

import msgspec

from llmgw.files import write_atomic

# a chain of takers is about a chunk behind at each hop: small enough that eight hops
# add seconds, large enough that a 100 GB file's manifest stays a few megabytes
CHUNK_SIZE = 4 << 20

Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class Chunks(msgspec.Struct, frozen=True, kw_only=True):
    """A file's manifest: its size, its chunk size, its whole sha256 and the
    sha256 of its chunks from the first, those known (all, once it is whole)."""

    size: Annotated[int, msgspec.Meta(ge=0)]
    chunk_size: Annotated[int, msgspec.Meta(gt=0)]
    sha256: Sha256
    hashes: list[Sha256]

    def __post_init__(self) -> None:
        if len(self.hashes) > count(self.size, self.chunk_size):
            raise ValueError(
                f"{len(self.hashes)} chunk hashes for a file of {count(self.size, self.chunk_size)}"
                " chunks"
            )

    @property
    def count(self) -> int:
        return count(self.size, self.chunk_size)

    @property
    def complete(self) -> bool:
        return len(self.hashes) == self.count

    def span(self, index: int) -> tuple[int, int]:
        return span(self.size, self.chunk_size, index)

    def same_file(self, other: Chunks) -> bool:
        """Whether ``other`` is a manifest of the same bytes, cut the same way."""
        return (self.size, self.chunk_size, self.sha256) == (
            other.size,
            other.chunk_size,
            other.sha256,
        )


def count(size: int, chunk_size: int) -> int:
    """How many chunks a file of ``size`` bytes has (none when empty)."""
    return -(-size // chunk_size)


def span(size: int, chunk_size: int, index: int) -> tuple[int, int]:
    """Where chunk ``index`` starts, and its length.

    Raises:
        IndexError: the file has no such chunk.
    """
    if not 0 <= index < count(size, chunk_size):
        raise IndexError(f"chunk {index} of a file of {count(size, chunk_size)} chunks")
    start = index * chunk_size
    return start, min(chunk_size, size - start)


def whole(held: int, size: int, chunk_size: int) -> int:
    """How many chunks are whole in the first ``held`` bytes of the file."""
    if held >= size:
        return count(size, chunk_size)
    return max(held, 0) // chunk_size


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def first_difference(a: list[str], b: list[str]) -> int | None:
    """The first chunk whose hash the two lists both know and disagree on."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def merged(known: Chunks, heard: Chunks) -> Chunks:
    """``known`` with the hashes ``heard`` knows beyond it (the same file, and
    agreeing where both know: the caller checks, ``first_difference``)."""
    if len(heard.hashes) <= len(known.hashes):
        return known
    return msgspec.structs.replace(known, hashes=known.hashes + heard.hashes[len(known.hashes) :])


def chunks_path(path: Path) -> Path:
    """The manifest beside ``path``: a landed file or a ``.part``."""
    return path.with_name(f".{path.name}.chunks")


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Chunks).decode


def encode(chunks: Chunks) -> bytes:
    return _encode(chunks)


def decode(data: bytes) -> Chunks:
    """Raises:
    ValueError: ``data`` is not a manifest."""
    try:
        return _decode(data)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a chunk manifest: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a chunk manifest: {exc}") from None


# ---------------------------------------------------------------- blocking, in threads


def load(path: Path) -> Chunks | None:
    """The manifest kept beside ``path``; None when there is none, or it is unreadable
    (it is made again: nothing depends on a manifest but what it lets serve)."""
    try:
        return decode(chunks_path(path).read_bytes())
    except (OSError, ValueError):
        return None


def save(path: Path, chunks: Chunks) -> None:
    write_atomic(chunks_path(path), encode(chunks), mode=0o644)


def drop(path: Path) -> None:
    chunks_path(path).unlink(missing_ok=True)


def read_chunk(fd: int, chunks: Chunks, index: int) -> bytes | None:
    """Chunk ``index`` read from ``fd``, if its bytes are its listed hash's; None
    when they are not (the file is damaged, or changed under the reader).

    Raises:
        IndexError: the manifest lists no hash for it.
        EOFError: the file does not hold the chunk whole.
        OSError: the read failed.
    """
    start, length = chunks.span(index)
    data = os.pread(fd, length, start)
    if len(data) != length:
        raise EOFError(f"chunk {index} is not whole: {len(data)} of its {length} bytes")
    if digest(data) != chunks.hashes[index]:
        return None
    return data


class Hashing:
    """The hashes of a file's chunks, made a chunk per ``step`` (a blocking read),
    as far as the file holds whole chunks; and its whole sha256 when all are."""

    def __init__(self, path: Path, size: int, chunk_size: int) -> None:
        self.path = path
        self.size = size
        self.chunk_size = chunk_size
        self.hashes: list[str] = []
        self.whole = hashlib.sha256()
        self.ident: tuple[int, int] | None = None  # (device, inode) of what was hashed

    @property
    def done(self) -> bool:
        return len(self.hashes) == count(self.size, self.chunk_size)

    def step(self) -> bool:
        """Hash the next chunk, if the file holds it whole; False when it does not
        (yet), or all are hashed.

        Raises:
            OSError: the file cannot be read (gone: landed or dropped).
        """
        if self.done:
            return False
        with self.path.open("rb") as fh:
            st = os.fstat(fh.fileno())
            ident = (st.st_dev, st.st_ino)
            if self.ident is None:
                self.ident = ident
            elif ident != self.ident:
                raise FileNotFoundError(f"{self.path} was replaced while it was hashed")
            index = len(self.hashes)
            if whole(st.st_size, self.size, self.chunk_size) <= index:
                return False
            start, length = span(self.size, self.chunk_size, index)
            data = os.pread(fh.fileno(), length, start)
        if len(data) != length:
            return False  # shrank meanwhile (a fetch that starts over): not whole now
        self.hashes.append(digest(data))
        self.whole.update(data)
        return True

    def manifest(self, sha256: str) -> Chunks:
        return Chunks(
            size=self.size, chunk_size=self.chunk_size, sha256=sha256, hashes=list(self.hashes)
        )

"""Which models' weights are on this node, where, and on what storage.

The agent looks in the directories it is told to look in, plus the default
download directory (``DEFAULT_WEIGHTS_DIR``), which is always looked in. A
node told nothing and without that directory reports nothing, as before; the
caller sets ``Inventory.weights_scanned`` only when there was somewhere to
look, because "never looked" is not "looked and found none".

Only *complete* weights count. An empty directory is not weights, because a
half-finished download looks exactly like one; neither is a GGUF file cut
short, a Hugging Face index whose shards are not all there, or anything with a
download's leftovers (``*.incomplete``, ``*.part``, ...) beside it. A model
that is counted where it is not gets replicas scheduled onto a node that
cannot load it; one that is missed only costs a copy.

Each copy carries the storage it is on (``storage.classify``): local, shared,
or unknown, and for shared storage an id that is the same from every node, so
one filer seen from twenty nodes counts as one copy.

What a copy's ``path`` is: the file an engine is given for GGUF (the first
part of a split model), the directory for a Hugging Face layout. ``size_bytes``
is the size of the weight files (every part; the shards for Hugging Face).

Everything here blocks on the filesystem (and a hung NFS server blocks it for
as long as it hangs): run ``scan_weights`` in a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import attrs

from llmgw.agent.discovery.storage import Mount, classify, read_mounts
from llmgw.protocol.messages import WeightCopy

log = logging.getLogger("llmgw.agent.discovery.weights")

DEFAULT_WEIGHTS_DIR = Path("/var/lib/llmgw-weights")

# Names a download leaves beside (or instead of) a file it has not finished:
# huggingface_hub (.incomplete), browsers and wget -c scripts (.part,
# .partial, .crdownload, .downloading), aria2 (.aria2: it preallocates the
# whole file, so only this control file says the download is not done).
INCOMPLETE_SUFFIXES = (".incomplete", ".part", ".partial", ".downloading", ".crdownload", ".aria2")

# Bounds on the walk: entries looked at in one directory; JSON files read whole.
MAX_DIR_ENTRIES = 10_000
MAX_JSON_BYTES = 64 << 20  # config.json, index files

# --- GGUF -------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32

# Bounds on what a header may claim, so a corrupt count cannot make the
# check allocate or walk without end. Real files stay far below: a 256k-token
# vocabulary is a few MiB of header and arrays of at most a few 100k items.
MAX_GGUF_HEADER_BYTES = 256 << 20
MAX_GGUF_TENSORS = 1 << 20
MAX_GGUF_KV = 1 << 16
MAX_GGUF_ARRAY_LEN = 1 << 22
MAX_GGUF_KEY_LEN = 1 << 16
MAX_GGUF_DIMS = 4  # GGML_MAX_DIMS
MAX_GGUF_ARRAY_DEPTH = 3

# GGUF metadata value types -> fixed size in bytes (8 string, 9 array are variable).
_GGUF_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING = 8
_GGUF_ARRAY = 9
_GGUF_INT_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}

# ggml tensor types -> (elements per block, bytes per block), from ggml's
# type traits (gguf-py's GGML_QUANT_SIZES). Types 4 and 5 (Q4_2, Q4_3) were
# removed from ggml long ago and are not valid in a GGUF file.
GGML_BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}


class _Short(Exception):
    """The header needs bytes the file does not have (truncated, or a corrupt length)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class _Corrupt(Exception):
    pass


class _Reader:
    """Bounded reads: never past the end of the file, never past the header budget.

    Every read is checked before it is made, so ``f.read(n)`` is only ever
    called with an ``n`` the file can satisfy (a buffered read of a huge ``n``
    allocates ``n`` bytes up front). Reads go through a window of up to
    ``CHUNK`` bytes, so walking a vocabulary of 100k strings is not 100k reads.
    """

    CHUNK = 1 << 20

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0
        self.buf = b""
        self.buf_start = 0
        self.set_endian("<")

    def set_endian(self, endian: str) -> None:
        self.endian = endian
        self._u32 = struct.Struct(endian + "I")
        self._u64 = struct.Struct(endian + "Q")

    def _check(self, n: int) -> None:
        end = self.pos + n
        if end > MAX_GGUF_HEADER_BYTES:
            raise _Corrupt(f"header longer than {MAX_GGUF_HEADER_BYTES} bytes")
        if end > self.size:
            raise _Short(end)

    def _window(self, n: int) -> int:
        """Make the window hold [pos, pos + n); return pos's index in it."""
        self._check(n)
        off = self.pos - self.buf_start
        if off >= 0 and off + n <= len(self.buf):
            return off
        want = min(max(n, self.CHUNK), self.size - self.pos)
        self.f.seek(self.pos)
        data = self.f.read(want)
        if len(data) < n:  # the file shrank while we read it
            raise _Short(self.pos + n)
        self.buf = data
        self.buf_start = self.pos
        return 0

    def read(self, n: int) -> bytes:
        off = self._window(n)
        self.pos += n
        return self.buf[off : off + n]

    def skip(self, n: int) -> None:
        self._check(n)
        self.pos += n

    def _struct(self, s: struct.Struct) -> int:
        off = self._window(s.size)
        self.pos += s.size
        value: int = s.unpack_from(self.buf, off)[0]
        return value

    def unpack(self, fmt: str) -> int:
        return self._struct(struct.Struct(self.endian + fmt))

    def u32(self) -> int:
        return self._struct(self._u32)

    def u64(self) -> int:
        return self._struct(self._u64)

    def skip_strings(self, count: int) -> None:
        """Skip ``count`` GGUF strings (u64 length, bytes): a vocabulary's hot loop."""
        unpack = self._u64.unpack_from
        limit = min(self.size, MAX_GGUF_HEADER_BYTES)
        buf, start, pos = self.buf, self.buf_start, self.pos
        for _ in range(count):
            off = pos - start
            if off < 0 or off + 8 > len(buf):
                self.pos = pos
                off = self._window(8)
                buf, start = self.buf, self.buf_start
            n = unpack(buf, off)[0]
            if pos + 8 + n > limit:
                self.pos = pos + 8
                if n > MAX_GGUF_HEADER_BYTES:
                    raise _Corrupt(f"string of {n} bytes")
                self._check(n)  # raises, saying which bound
            pos += 8 + n
        self.pos = pos

    def string_len(self, limit: int, what: str) -> int:
        n = self.u64()
        if n > limit:
            raise _Corrupt(f"{what} of {n} bytes")
        return n


def _skip_value(r: _Reader, vtype: int, depth: int = 0) -> None:
    if vtype in _GGUF_SCALAR_SIZE:
        r.skip(_GGUF_SCALAR_SIZE[vtype])
    elif vtype == _GGUF_STRING:
        r.skip(r.string_len(MAX_GGUF_HEADER_BYTES, "string"))
    elif vtype == _GGUF_ARRAY:
        if depth >= MAX_GGUF_ARRAY_DEPTH:
            raise _Corrupt("arrays nested too deep")
        etype = r.u32()
        count = r.u64()
        if count > MAX_GGUF_ARRAY_LEN:
            raise _Corrupt(f"array of {count} items")
        if etype in _GGUF_SCALAR_SIZE:
            r.skip(count * _GGUF_SCALAR_SIZE[etype])
        elif etype == _GGUF_STRING:  # a vocabulary: the hot loop
            r.skip_strings(count)
        elif etype == _GGUF_ARRAY:
            for _ in range(count):
                _skip_value(r, etype, depth + 1)
        else:
            raise _Corrupt(f"array of unknown value type {etype}")
    else:
        raise _Corrupt(f"unknown value type {vtype}")


@attrs.frozen
class GgufCheck:
    reason: str | None  # None: complete
    tensors: int = 0
    needed: int = 0  # bytes the file must have


def check_gguf(f: BinaryIO, size: int) -> GgufCheck:
    """Read a GGUF header from ``f`` (``size`` bytes long) and say whether the file is whole.

    Never raises for what is in the file; every count and length is bounded
    before anything is read or skipped.
    """
    try:
        return _check_gguf(f, size)
    except _Short as e:
        return GgufCheck(f"truncated: {size} bytes, needs at least {e.needed}", needed=e.needed)
    except _Corrupt as e:
        return GgufCheck(f"corrupt GGUF header: {e}")


def _check_gguf(f: BinaryIO, size: int) -> GgufCheck:
    r = _Reader(f, size)
    magic = r.read(4)
    if magic != GGUF_MAGIC:
        return GgufCheck(f"not a GGUF file (starts with {magic!r})")
    raw_version = r.read(4)
    # GGUF files are little-endian unless written for a big-endian host; the
    # version field tells which (a byte-swapped 3 has its low half zero).
    for endian in ("<", ">"):
        version = struct.unpack(endian + "I", raw_version)[0]
        if version in (2, 3):
            r.set_endian(endian)
            break
    else:
        version = struct.unpack("<I", raw_version)[0]
        return GgufCheck(f"unsupported GGUF version {version}")
    n_tensors = r.u64()
    n_kv = r.u64()
    if n_tensors > MAX_GGUF_TENSORS:
        raise _Corrupt(f"{n_tensors} tensors")
    if n_kv > MAX_GGUF_KV:
        raise _Corrupt(f"{n_kv} metadata keys")

    alignment = GGUF_DEFAULT_ALIGNMENT
    wanted = b"general.alignment"
    for _ in range(n_kv):
        klen = r.string_len(MAX_GGUF_KEY_LEN, "key")
        if klen == len(wanted):
            key = r.read(klen)
        else:
            r.skip(klen)
            key = b""
        vtype = r.u32()
        if key == wanted and vtype in _GGUF_INT_FORMAT:
            alignment = r.unpack(_GGUF_INT_FORMAT[vtype])
            if alignment <= 0 or alignment & (alignment - 1):
                raise _Corrupt(f"alignment {alignment} is not a power of two")
        else:
            _skip_value(r, vtype)

    end = 0  # end of the last tensor, relative to the data section
    for _ in range(n_tensors):
        r.skip(r.string_len(MAX_GGUF_KEY_LEN, "tensor name"))
        n_dims = r.u32()
        if n_dims > MAX_GGUF_DIMS:
            raise _Corrupt(f"tensor with {n_dims} dimensions")
        dims = [r.u64() for _ in range(n_dims)]
        ttype = r.u32()
        offset = r.u64()
        if offset % alignment:
            raise _Corrupt(f"tensor offset {offset} not aligned to {alignment}")
        n = 1
        for d in dims:
            n *= d
        block = GGML_BLOCK.get(ttype)
        if block is None:
            # A type newer than this table: its size is unknown, so the file is
            # only checked to reach the tensor's start (the header reads).
            end = max(end, offset)
            continue
        per_block, block_bytes = block
        row = dims[0] if dims else 1
        if row % per_block:
            raise _Corrupt(f"tensor row of {row} not a multiple of block {per_block}")
        end = max(end, offset + n // per_block * block_bytes)

    data_start = -(-r.pos // alignment) * alignment
    needed = data_start + end
    if n_tensors == 0:
        # Vocabulary-only files (ggml-vocab-*.gguf) and the metadata-only
        # first part some splits have: readable, but not a model by itself.
        return GgufCheck("no tensors", tensors=0, needed=needed)
    if size < needed:
        return GgufCheck(
            f"truncated: {size} bytes, needs at least {needed}", tensors=n_tensors, needed=needed
        )
    return GgufCheck(None, tensors=n_tensors, needed=needed)


def _download_leftover(path: Path) -> str | None:
    for suffix in INCOMPLETE_SUFFIXES:
        side = path.with_name(path.name + suffix)
        if os.path.lexists(side):
            return f"download in progress ({side.name})"
    return None


# Header checks already made, by file identity and version: discovery runs
# again every minute, and walking a large vocabulary takes a tenth of a second.
_GGUF_CACHE: dict[tuple[int, int, int, int, int], GgufCheck] = {}
_GGUF_CACHE_MAX = 4096


def _gguf_file(path: Path) -> GgufCheck:
    leftover = _download_leftover(path)
    if leftover:
        return GgufCheck(leftover)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            hit = _GGUF_CACHE.get(key)
            if hit is not None:
                return hit
            result = check_gguf(f, st.st_size)
    except OSError as e:
        return GgufCheck(f"cannot read: {e.strerror or e}")
    if len(_GGUF_CACHE) >= _GGUF_CACHE_MAX:
        _GGUF_CACHE.clear()
    _GGUF_CACHE[key] = result
    return result


def gguf_complete(path: Path) -> str | None:
    """None when ``path`` is a whole GGUF model file; otherwise why not, in words.

    Whole: the header reads (magic, version 2 or 3, metadata, tensor infos),
    there is at least one tensor, the file reaches the end of its last tensor,
    and no download leftover (``<name>.part``, ...) sits beside it.
    """
    return _gguf_file(Path(path)).reason


# --- safetensors / Hugging Face ----------------------------------------------

MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors format's own limit


def safetensors_complete(path: Path) -> str | None:
    """None when the file is whole: an 8-byte little-endian header length, a JSON
    header, and tensor data reaching at least the end its header promises."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                return f"truncated: {size} bytes, needs at least 8"
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_SAFETENSORS_HEADER:
                return f"corrupt safetensors header: length {n}"
            if 8 + n > size:
                return f"truncated: {size} bytes, needs at least {8 + n}"
            raw = f.read(n)
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return "corrupt safetensors header: not JSON"
    if not isinstance(header, dict):
        return "corrupt safetensors header: not a JSON object"
    end = 0
    tensors = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            return f"corrupt safetensors header: tensor {name!r}"
        end = max(end, offsets[1])
        tensors += 1
    if tensors == 0:
        return "no tensors"
    needed = 8 + n + end
    if size < needed:
        return f"truncated: {size} bytes, needs at least {needed}"
    return None


def _read_json(path: Path) -> object:
    """A small JSON file, or raises ValueError/OSError."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_JSON_BYTES:
            raise ValueError("too large")
        return json.loads(f.read(MAX_JSON_BYTES))


def _shard_path(directory: Path, name: str) -> Path | None:
    """A shard named in an index, if it stays inside the model directory."""
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts:
        return None
    return directory / p


def _leftovers_in(directory: Path) -> str | None:
    """A download's leftovers in the model directory, or in the place
    ``huggingface-cli download --local-dir`` keeps its unfinished files."""
    places = [directory, directory / ".cache" / "huggingface" / "download"]
    for place in places:
        try:
            with os.scandir(place) as it:
                for i, entry in enumerate(it):
                    if i >= MAX_DIR_ENTRIES:
                        break
                    if entry.name.endswith(INCOMPLETE_SUFFIXES):
                        return f"download in progress ({entry.name})"
        except OSError:
            continue
    return None


@attrs.frozen
class HfCheck:
    reason: str | None
    size: int = 0  # bytes of the weight files


def _index_shards(directory: Path, index: Path) -> tuple[str | None, list[Path]]:
    try:
        data = _read_json(index)
    except (OSError, ValueError, RecursionError):
        return f"{index.name} unreadable", []
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return f"{index.name} names no shards", []
    shards: list[Path] = []
    for name in sorted({v for v in weight_map.values() if isinstance(v, str)}):
        p = _shard_path(directory, name)
        if p is None:
            return f"{index.name} names a shard outside the directory: {name!r}", []
        shards.append(p)
    if not shards or len(shards) > MAX_DIR_ENTRIES:
        return f"{index.name} names {len(shards)} shards", []
    return None, shards


def check_hf(directory: Path) -> HfCheck:
    """Whether ``directory`` holds a whole Hugging Face model (see ``hf_complete``)."""
    directory = Path(directory)
    leftover = _leftovers_in(directory)
    if leftover:
        return HfCheck(leftover)
    config = directory / "config.json"
    try:
        if not isinstance(_read_json(config), dict):
            return HfCheck("config.json is not a JSON object")
    except FileNotFoundError:
        return HfCheck("no config.json")
    except (OSError, ValueError, RecursionError):
        return HfCheck("config.json unreadable")

    # The first layout present decides: an engine that sees safetensors loads
    # them and does not fall back to .bin files when a shard is missing.
    st_index = directory / "model.safetensors.index.json"
    st_single = directory / "model.safetensors"
    pt_index = directory / "pytorch_model.bin.index.json"
    pt_single = directory / "pytorch_model.bin"
    if st_index.exists():
        reason, shards = _index_shards(directory, st_index)
        if reason:
            return HfCheck(reason)
        return _check_files(shards, safetensors=True)
    if st_single.exists():
        return _check_files([st_single], safetensors=True)
    if pt_index.exists():
        reason, shards = _index_shards(directory, pt_index)
        if reason:
            return HfCheck(reason)
        return _check_files(shards, safetensors=False)
    if pt_single.exists():
        return _check_files([pt_single], safetensors=False)
    return HfCheck("no weight files (model.safetensors, pytorch_model.bin, or an index)")


def _check_files(files: list[Path], *, safetensors: bool) -> HfCheck:
    total = 0
    for p in files:
        try:
            st = p.stat()
        except OSError:
            return HfCheck(f"shard {p.name} missing")
        if not stat.S_ISREG(st.st_mode):
            return HfCheck(f"shard {p.name} is not a file")
        size = st.st_size
        if safetensors:
            reason = safetensors_complete(p)
            if reason:
                return HfCheck(f"shard {p.name}: {reason}")
        elif size == 0:  # .bin: presence only (a pickle cannot be checked cheaply)
            return HfCheck(f"shard {p.name} is empty")
        total += size
    return HfCheck(None, total)


def hf_complete(directory: Path) -> str | None:
    """None when ``directory`` is a whole Hugging Face model; otherwise why not.

    Whole: ``config.json`` reads, and either ``model.safetensors.index.json``
    whose ``weight_map`` names shards that are all present and whole, or a
    single whole ``model.safetensors``; failing those, the same with
    ``pytorch_model.bin[.index.json]`` (present and not empty: a pickle is not
    checked further). Any download leftover in the directory makes it not whole.
    """
    return check_hf(directory).reason


# --- the scan -----------------------------------------------------------------

_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


@attrs.frozen
class _Found:
    model: str
    path: Path
    format: str
    size: int


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    """Up to MAX_DIR_ENTRIES entries, dot-files left out, in name order."""
    out: list[os.DirEntry[str]] = []
    try:
        with os.scandir(directory) as it:
            for i, entry in enumerate(it):
                if i >= MAX_DIR_ENTRIES:
                    log.warning("weights: more than %d entries in %s", MAX_DIR_ENTRIES, directory)
                    break
                if not entry.name.startswith("."):
                    out.append(entry)
    except OSError as e:
        log.debug("weights: cannot list %s: %s", directory, e)
    return sorted(out, key=lambda e: e.name)


def _is_file(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_file()  # follows symlinks; a symlink loop is OSError or False
    except OSError:
        return False


def _is_dir(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_dir()
    except OSError:
        return False


def _gguf_stem(name: str) -> str:
    m = _SPLIT.match(name)
    return m["prefix"] if m else Path(name).stem


def _is_projector(name: str) -> bool:
    return name.lower().startswith("mmproj")


def _gguf_models(files: list[Path]) -> Iterator[tuple[str, Path, int]]:
    """(stem, first file, total size) of each whole GGUF model among ``files``.

    A split model (``name-00001-of-00003.gguf``) counts only when every part
    is there and whole. Vision projectors (``mmproj*.gguf``) are not models.
    """
    singles: list[Path] = []
    splits: dict[tuple[str, int], dict[int, Path]] = {}
    for p in files:
        if _is_projector(p.name):
            continue
        m = _SPLIT.match(p.name)
        if m:
            splits.setdefault((m["prefix"], int(m["count"])), {})[int(m["no"])] = p
        else:
            singles.append(p)
    for p in singles:
        check = _gguf_file(p)
        if check.reason:
            log.debug("weights: %s skipped: %s", p, check.reason)
            continue
        yield p.stem, p, _size(p)
    for (prefix, count), parts in sorted(splits.items()):
        yield from _gguf_split(prefix, count, parts)


def _gguf_split(prefix: str, count: int, parts: dict[int, Path]) -> Iterator[tuple[str, Path, int]]:
    missing = [i for i in range(1, count + 1) if i not in parts]
    if count == 0 or missing:
        log.debug("weights: %s skipped: parts %s of %d missing", prefix, missing[:5], count)
        return
    tensors = 0
    total = 0
    for i in range(1, count + 1):
        check = _gguf_file(parts[i])
        # The first part may hold only metadata (gguf-split --no-tensor-first-split).
        if check.reason and not (check.reason == "no tensors" and i == 1):
            log.debug("weights: %s skipped: %s", parts[i], check.reason)
            return
        tensors += check.tensors
        total += _size(parts[i])
    if tensors == 0:
        log.debug("weights: %s skipped: no tensors in any part", prefix)
        return
    yield prefix, parts[1], total


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _model_dir(name: str, directory: Path) -> Iterator[_Found]:
    """A subdirectory (or a hub snapshot) as a model named ``name``: a Hugging
    Face layout, and/or GGUF files (one: the model is ``name``; several:
    ``name/<stem>`` each). "Several" counts the files there, whole or not, so
    that a second quantisation still downloading does not rename the first
    when it completes."""
    entries = _entries(directory)
    ggufs = [Path(e.path) for e in entries if e.name.lower().endswith(".gguf") and _is_file(e)]
    several = len({_gguf_stem(p.name) for p in ggufs if not _is_projector(p.name)}) > 1
    models = list(_gguf_models(ggufs))
    for stem, path, size in models:
        yield _Found(f"{name}/{stem}" if several else name, path, "gguf", size)
    hf_like = any(e.name == "config.json" or e.name.endswith(_HF_WEIGHT_SUFFIXES) for e in entries)
    if hf_like:
        check = check_hf(directory)
        if check.reason:
            log.debug("weights: %s skipped: %s", directory, check.reason)
        else:
            yield _Found(name, directory, "hf", check.size)
    elif not models:
        log.debug("weights: %s skipped: no whole model in it", directory)


def _hub_repo(directory: Path, name: str) -> Iterator[_Found]:
    """A Hugging Face hub cache entry ``models--org--name``: the snapshot that
    ``refs/main`` names if it is whole, else the newest whole one."""
    model = name[len("models--") :].replace("--", "/", 1)
    blobs = directory / "blobs"
    leftover = _leftovers_in(blobs)
    if leftover:
        log.debug("weights: %s skipped: %s", directory, leftover)
        return
    snapshots = [Path(e.path) for e in _entries(directory / "snapshots") if _is_dir(e)]
    try:
        main = (directory / "refs" / "main").read_text(errors="replace").strip()
    except OSError:
        main = ""

    def order(p: Path) -> tuple[bool, float]:
        try:
            mtime = p.stat().st_mtime
        except OSError:
            mtime = 0.0
        return (p.name != main, -mtime)

    for snap in sorted(snapshots, key=order):
        found = list(_model_dir(model, snap))
        if found:
            yield from found
            return


def _scan_root(root: Path) -> Iterator[_Found]:
    entries = _entries(root)
    top_ggufs = [Path(e.path) for e in entries if e.name.lower().endswith(".gguf") and _is_file(e)]
    for stem, path, size in _gguf_models(top_ggufs):
        yield _Found(stem, path, "gguf", size)
    for e in entries:
        if e.name.lower().endswith(".gguf") or not _is_dir(e):
            continue
        if e.name.startswith("models--") and len(e.name) > len("models--"):
            yield from _hub_repo(Path(e.path), e.name)
        else:
            yield from _model_dir(e.name, Path(e.path))


def scan_weights(
    dirs: Sequence[Path],
    *,
    default_dir: Path = DEFAULT_WEIGHTS_DIR,
    mounts: Sequence[Mount] | None = None,
    mounts_path: Path = Path("/proc/mounts"),
) -> list[WeightCopy]:
    """Every whole model in ``dirs`` and ``default_dir`` (always; missing is fine).

    One level deep: ``<dir>/<name>.gguf`` (or a complete split set) is model
    ``name``; ``<dir>/<name>/`` holding a Hugging Face layout or GGUF file(s)
    is model ``name``; ``<dir>/models--org--name/snapshots/<rev>/`` (the hub
    cache) is model ``org/name``. The same real file or directory reached
    through two dirs (or a symlink) is one copy. The walk has a fixed depth,
    so a symlink loop cannot make it wander; each directory listing is
    bounded.

    ``mounts`` defaults to the mount table at ``mounts_path``, read *after* the
    walk so that automounts the walk triggered are in it.
    """
    roots: list[Path] = []
    seen_roots: set[str] = set()
    for d in [*dirs, default_dir]:
        d = Path(d)
        real = os.path.realpath(d)
        if real in seen_roots:
            continue
        seen_roots.add(real)
        if not d.is_dir():
            if d != default_dir:
                log.warning("weights: %s is not a directory", d)
            continue
        roots.append(d)

    found: list[_Found] = []
    seen: set[str] = set()
    for root in roots:
        for f in _scan_root(root):
            real = os.path.realpath(f.path)
            if real in seen:
                continue
            seen.add(real)
            found.append(f)

    if mounts is None:
        mounts = read_mounts(mounts_path)
    copies: list[WeightCopy] = []
    for f in found:
        s = classify(f.path, mounts)
        copies.append(
            WeightCopy(
                model=f.model,
                path=str(f.path),
                format=f.format,
                size_bytes=f.size,
                storage=s.kind,
                filesystem=s.filesystem,
                storage_id=s.storage_id,
            )
        )
    return copies

"""GGUF model files: is this one whole? The one reader of the format in llmgw.

Weights discovery asks it of every file it finds, and the llama.cpp adapter
of the file a shard is given, so a model is judged the same way when it is
counted and when it is launched.

Whole: the header reads (magic, version 2 or 3, metadata, tensor infos),
there is at least one tensor, the file reaches the end of its last tensor, and
no download leftover (``<name>.part``, ...) sits beside it. Only the header is
read; every count and length it claims is bounded before anything is read or
skipped, so a corrupt file costs a bounded read, never a huge allocation.

Everything here reads the filesystem, and a hung NFS server blocks it for as
long as it hangs: call it from a worker thread, never from the event loop.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import attrs

# Names a download leaves beside (or instead of) a file it has not finished:
# huggingface_hub (.incomplete), browsers and wget -c scripts (.part,
# .partial, .crdownload, .downloading), aria2 (.aria2: it preallocates the
# whole file, so only this control file says the download is not done).
INCOMPLETE_SUFFIXES = (".incomplete", ".part", ".partial", ".downloading", ".crdownload", ".aria2")

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
class KvShape:
    """What a model's KV cache holds per token of context, all layers together, in
    elements (the cache type gives the bytes): what memory estimates need."""

    layers: int
    k_per_token: int  # sum over layers of KV heads x key length
    v_per_token: int  # sum over layers of KV heads x value length


@attrs.frozen
class GgufCheck:
    reason: str | None  # None: complete
    tensors: int = 0
    needed: int = 0  # bytes the file must have
    kv: KvShape | None = None  # None: the metadata does not say (or not a model)


# metadata read for the KV shape: "<arch>.<suffix>"; every other value is skipped
_KV_SUFFIXES = (
    b".block_count",
    b".embedding_length",
    b".attention.head_count",
    b".attention.head_count_kv",
    b".attention.key_length",
    b".attention.value_length",
)
_MAX_KV_KEY = 128  # longer keys are not read at all


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
    arch = b""
    meta: dict[bytes, int | list[int]] = {}  # the KV-shape keys, by full name
    for _ in range(n_kv):
        klen = r.string_len(MAX_GGUF_KEY_LEN, "key")
        if klen <= _MAX_KV_KEY:
            key = r.read(klen)
        else:
            r.skip(klen)
            key = b""
        vtype = r.u32()
        if key == wanted and vtype in _GGUF_INT_FORMAT:
            alignment = r.unpack(_GGUF_INT_FORMAT[vtype])
            if alignment <= 0 or alignment & (alignment - 1):
                raise _Corrupt(f"alignment {alignment} is not a power of two")
        elif key == b"general.architecture" and vtype == _GGUF_STRING:
            n = r.string_len(MAX_GGUF_HEADER_BYTES, "string")
            if n <= _MAX_KV_KEY:
                arch = r.read(n)
            else:
                r.skip(n)
        elif key.endswith(_KV_SUFFIXES) and vtype in _GGUF_INT_FORMAT:
            meta[key] = r.unpack(_GGUF_INT_FORMAT[vtype])
        elif key.endswith(b".attention.head_count_kv") and vtype == _GGUF_ARRAY:
            values = _int_array(r)  # per layer (0 for a layer without attention)
            if values is not None:
                meta[key] = values
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
    return GgufCheck(None, tensors=n_tensors, needed=needed, kv=_kv_shape(arch, meta))


def _int_array(r: _Reader) -> list[int] | None:
    """An array of up to 4,096 integers (one per layer), or None: anything else, which
    is skipped as any array is."""
    start = r.pos
    etype = r.u32()
    count = r.u64()
    if etype not in _GGUF_INT_FORMAT or count > 4096:  # no model has more layers
        r.pos = start
        _skip_value(r, _GGUF_ARRAY)
        return None
    return [r.unpack(_GGUF_INT_FORMAT[etype]) for _ in range(count)]


def _kv_shape(arch: bytes, meta: dict[bytes, int | list[int]]) -> KvShape | None:
    """The KV cache's elements per token from llama.cpp's metadata keys: per layer,
    KV heads (``head_count_kv``, else ``head_count``) times the key and value lengths
    (``key_length``/``value_length``, else ``embedding_length / head_count``)."""

    def one(suffix: bytes) -> int | None:
        value = meta.get(arch + suffix)
        return value if isinstance(value, int) and value > 0 else None

    layers = one(b".block_count")
    heads = one(b".attention.head_count")
    if not arch or layers is None or heads is None:
        return None
    embd = one(b".embedding_length")
    head_dim = embd // heads if embd is not None else None
    k_len = one(b".attention.key_length") or head_dim
    v_len = one(b".attention.value_length") or head_dim
    if k_len is None or v_len is None:
        return None
    kv_heads = meta.get(arch + b".attention.head_count_kv", heads)
    per_layer = kv_heads[:layers] if isinstance(kv_heads, list) else [kv_heads] * layers
    total_heads = sum(max(0, h) for h in per_layer)
    return KvShape(layers=layers, k_per_token=total_heads * k_len, v_per_token=total_heads * v_len)


def download_leftover(path: Path) -> str | None:
    """Why ``path`` is still being downloaded (a leftover beside it), or None."""
    for suffix in INCOMPLETE_SUFFIXES:
        side = path.with_name(path.name + suffix)
        if os.path.lexists(side):
            return f"download in progress ({side.name})"
    return None


# Header checks already made, by file identity and version: discovery runs
# again every minute, and walking a large vocabulary takes a tenth of a second.
_GGUF_CACHE: dict[tuple[int, int, int, int, int], GgufCheck] = {}
_GGUF_CACHE_MAX = 4096


def gguf_file(path: Path) -> GgufCheck:
    """The check of the file at ``path`` (cached by its identity and version)."""
    leftover = download_leftover(path)
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
    return gguf_file(Path(path)).reason

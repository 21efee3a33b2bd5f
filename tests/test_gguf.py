"""The GGUF reader: only whole model files pass, and no file makes it read without bound.

GGUF files are written by gguf-py's own GGUFWriter (the llama.cpp project's
package), and cross-checked against its GGUFReader, so the header walk is
tested against the format's reference implementation, not against itself.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import gguf as G
from llmgw.gguf import check_gguf, gguf_complete

# --- writers ------------------------------------------------------------------


def write_gguf(
    path: Path,
    *,
    vocab: int = 0,
    alignment: int | None = None,
    big_endian: bool = False,
    quantized: bool = False,
    split_max_tensors: int = 0,
    small_first_shard: bool = False,
) -> Path:
    """A real (tiny) model file: metadata and F32 + F16 tensors, optionally more."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(
        path,
        "llama",
        endianess=endian,
        split_max_tensors=split_max_tensors,
        small_first_shard=small_first_shard,
    )
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    if vocab:
        w.add_token_list([f"tok{i}".encode() for i in range(vocab)])
        w.add_token_scores([float(i) for i in range(vocab)])
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.add_tensor("output_norm.weight", np.ones((4, 32), dtype=np.float16))
    if quantized:
        a = np.linspace(-1, 1, 4 * 256, dtype=np.float32).reshape(4, 256)
        for qt in (QT.Q8_0, QT.Q4_0):
            w.add_tensor(f"blk.{qt.name}.weight", quants.quantize(a, qt), raw_dtype=qt)
        # Types gguf-py cannot quantize to: blocks of the right byte size.
        for qt in (QT.BF16, QT.Q2_K, QT.Q4_K, QT.Q6_K, QT.IQ4_XS, QT.IQ2_XXS, QT.TQ1_0):
            per_block, block_bytes = gguf.GGML_QUANT_SIZES[qt]
            raw = np.zeros((4, 256 // per_block * block_bytes), dtype=np.uint8)
            w.add_tensor(f"blk.{qt.name}.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_end(path: Path) -> int:
    """Where gguf-py's reader says the last tensor ends."""
    r = gguf.GGUFReader(path)
    return max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)


# --- the reader ---------------------------------------------------------------


def test_complete_gguf(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "m.gguf")
    assert gguf_complete(p) is None
    with open(p, "rb") as f:
        check = check_gguf(f, p.stat().st_size)
    assert check.reason is None
    assert check.tensors == 2
    assert check.needed == reference_end(p)


def kv_model(path: Path, arch: str = "llama", **keys: object) -> G.KvShape | None:
    """A model whose metadata says its attention shape; what the reader makes of it."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return G.gguf_file(path).kv


def test_the_kv_shape_is_read_as_llama_cpp_sizes_its_cache(tmp_path: Path) -> None:
    # grouped-query attention: 32 layers x 8 KV heads x 128 (4096 / 32 heads)
    gqa = kv_model(
        tmp_path / "gqa.gguf", block_count=32, embedding_length=4096, head_count=32,
        head_count_kv=8,
    )  # fmt: skip
    assert gqa == G.KvShape(layers=32, k_per_token=32 * 8 * 128, v_per_token=32 * 8 * 128)
    # explicit key and value lengths, and KV heads per layer (0: no attention there)
    mixed = kv_model(
        tmp_path / "mixed.gguf", arch="qwen3next", block_count=4, embedding_length=2048,
        head_count=16, head_count_kv=[2, 0, 2, 0], key_length=192, value_length=128,
    )  # fmt: skip
    assert mixed == G.KvShape(layers=4, k_per_token=4 * 192, v_per_token=4 * 128)
    # no KV heads said: every head has its own
    mha = kv_model(tmp_path / "mha.gguf", block_count=2, embedding_length=64, head_count=4)
    assert mha == G.KvShape(layers=2, k_per_token=2 * 4 * 16, v_per_token=2 * 4 * 16)
    # not enough said: unknown, and the file is still whole
    assert kv_model(tmp_path / "bare.gguf", block_count=2) is None
    assert gguf_complete(tmp_path / "bare.gguf") is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantized": True},
        {"alignment": 64, "quantized": True},
        {"big_endian": True, "quantized": True},
        {"vocab": 120_000},  # a header longer than the reader's 1 MiB window
    ],
    ids=["quantized", "align64", "big-endian", "vocab"],
)
def test_gguf_end_matches_reference(tmp_path: Path, kwargs: dict[str, object]) -> None:
    p = write_gguf(tmp_path / "m.gguf", **kwargs)  # type: ignore[arg-type]
    with open(p, "rb") as f:
        check = check_gguf(f, p.stat().st_size)
    assert check.reason is None
    assert check.needed == reference_end(p)
    # One byte short of the last tensor is a half-finished download.
    size = p.stat().st_size
    os.truncate(p, check.needed - 1)
    assert gguf_complete(p) == f"truncated: {check.needed - 1} bytes, needs at least {check.needed}"
    assert size >= check.needed


def test_block_sizes_match_gguf_py() -> None:
    for t, size in G.GGML_BLOCK.items():
        assert gguf.GGML_QUANT_SIZES[QT(t)] == size, QT(t).name


@pytest.mark.parametrize("qt", [QT(t) for t in G.GGML_BLOCK], ids=lambda qt: qt.name)
def test_each_tensor_type_size(tmp_path: Path, qt: QT) -> None:
    # The tensor of this type is the last one, so its size decides the end.
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qt]
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_tensor("first", np.zeros(8, dtype=np.float32))
    w.add_tensor("last", np.zeros((3, 512 // per_block * block_bytes), np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = tmp_path / "m.gguf"
    with open(p, "rb") as f:
        check = check_gguf(f, p.stat().st_size)
    assert check.reason is None
    assert check.needed == reference_end(p)


def test_every_truncation_is_incomplete(tmp_path: Path) -> None:
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    end = reference_end(tmp_path / "m.gguf")
    for cut in range(len(data)):
        reason = check_gguf(io.BytesIO(data[:cut]), cut).reason
        if cut < end:
            assert reason is not None and reason.startswith("truncated: "), (cut, reason)
        else:  # only alignment padding after the last tensor is missing
            assert reason is None
    assert check_gguf(io.BytesIO(data), len(data)).reason is None


def test_truncated_file(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "m.gguf")
    end = reference_end(p)
    half = p.stat().st_size // 2
    os.truncate(p, half)
    assert gguf_complete(p) == f"truncated: {half} bytes, needs at least {end}"


@pytest.mark.parametrize(
    ("data", "start"),
    [
        (b"", "truncated: 0 bytes"),
        (b"GGML" + bytes(20), "not a GGUF file"),
        (b"GGUF" + struct.pack("<I", 1) + bytes(16), "unsupported GGUF version 1"),
        (b"GGUF" + struct.pack("<I", 4) + bytes(16), "unsupported GGUF version 4"),
        # No tensors: a vocabulary-only file is not a model.
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 0), "no tensors"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**63, 0), "corrupt GGUF header: "),
        (b"GGUF" + struct.pack("<IQQ", 3, 1, 2**40), "corrupt GGUF header: "),
        # A key that claims to be 2^60 bytes long.
        (b"GGUF" + struct.pack("<IQQQ", 3, 1, 1, 2**60), "corrupt GGUF header: key of"),
        # A string value longer than any header may be.
        (
            b"GGUF" + struct.pack("<IQQQ", 3, 1, 1, 3) + b"abc" + struct.pack("<IQ", 8, 2**62),
            "corrupt GGUF header: ",
        ),
        # An array of 2^50 strings.
        (
            b"GGUF" + struct.pack("<IQQQ", 3, 1, 1, 3) + b"abc" + struct.pack("<IIQ", 9, 8, 2**50),
            "corrupt GGUF header: array of",
        ),
        # general.alignment = 3
        (
            b"GGUF"
            + struct.pack("<IQQQ", 3, 1, 1, 17)
            + b"general.alignment"
            + struct.pack("<II", 4, 3),
            "corrupt GGUF header: alignment 3",
        ),
        # A tensor with 9 dimensions.
        (b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 1) + b"t" + struct.pack("<I", 9), "corrupt"),
        # Unknown metadata value type.
        (b"GGUF" + struct.pack("<IQQQ", 3, 1, 1, 1) + b"k" + struct.pack("<I", 99), "corrupt"),
    ],
)
def test_bad_headers(data: bytes, start: str) -> None:
    stream = Recording(data)
    reason = check_gguf(stream, len(data)).reason
    assert reason is not None and reason.startswith(start), reason


def test_corrupt_lengths_in_a_huge_file_read_little() -> None:
    # The file claims 1 TiB; the header's lengths are garbage. Nothing is read
    # beyond the reader's window, however large the numbers.
    header = b"GGUF" + struct.pack("<IQQQ", 3, 1, 1, 3) + b"abc" + struct.pack("<IQ", 8, 2**50)
    stream = Recording(header, claimed=1 << 40)
    reason = check_gguf(stream, 1 << 40).reason
    assert reason is not None
    assert max(stream.reads) <= G._Reader.CHUNK


def test_unknown_tensor_type_checks_the_header_only(tmp_path: Path) -> None:
    # One tensor of a type newer than the table, at offset 0: the file must
    # reach the data section, nothing more can be said.
    body = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    body += struct.pack("<Q", 1) + b"t" + struct.pack("<IQI", 1, 32, 200) + struct.pack("<Q", 0)
    data = body + bytes(-len(body) % 32)
    assert check_gguf(io.BytesIO(data), len(data)).reason is None
    assert check_gguf(io.BytesIO(data[:-1]), len(data) - 1).reason is not None


def test_gguf_complete_on_odd_paths(tmp_path: Path) -> None:
    assert (gguf_complete(tmp_path / "missing.gguf") or "").startswith("cannot read")
    assert (gguf_complete(tmp_path) or "").startswith("cannot read")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert gguf_complete(tmp_path / "empty.gguf") == "truncated: 0 bytes, needs at least 4"


# --- fuzzing: never raises, never reads past the file ----------------------


class Recording(io.BytesIO):
    """A file that fails the test on any read it could not satisfy."""

    def __init__(self, data: bytes, claimed: int | None = None) -> None:
        super().__init__(data)
        self.claimed = len(data) if claimed is None else claimed
        self.reads: list[int] = [0]

    def read(self, n: int | None = -1, /) -> bytes:
        assert n is not None and n >= 0, "unbounded read"
        assert self.tell() + n <= self.claimed, "read past the end of the file"
        self.reads.append(n)
        return super().read(n)


@functools.cache
def sample_gguf() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_gguf(Path(d) / "m.gguf", quantized=True).read_bytes()


@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    reason = check_gguf(Recording(data), len(data)).reason
    assert reason is not None  # nothing random is a model


@given(
    version=st.sampled_from([2, 3]),
    endian=st.sampled_from(["<", ">"]),
    rest=st.binary(max_size=2048),
)
def test_fuzz_after_a_valid_start(version: int, endian: str, rest: bytes) -> None:
    data = b"GGUF" + struct.pack(endian + "I", version) + rest
    check = check_gguf(Recording(data), len(data))
    assert check.reason is not None or check.needed <= len(data)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(st.data())
def test_fuzz_mutated_real_file(data: st.DataObject) -> None:
    buf = bytearray(sample_gguf())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    blob = bytes(buf[:cut])
    check = check_gguf(Recording(blob), len(blob))
    assert check.reason is not None or check.needed <= len(blob)

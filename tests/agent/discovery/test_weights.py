"""Weights discovery: only whole models count, each with its storage.

GGUF files are written by gguf-py's own GGUFWriter (see tests/test_gguf.py,
which tests the reader itself).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest

from llmgw.agent.discovery import weights as W
from llmgw.agent.discovery.storage import Mount
from llmgw.agent.discovery.weights import (
    DEFAULT_WEIGHTS_DIR,
    check_hf,
    hf_complete,
    safetensors_complete,
    scan_weights,
)
from llmgw.gguf import INCOMPLETE_SUFFIXES, gguf_complete
from llmgw.protocol.messages import WeightCopy
from llmgw.weights.budget import Budget
from tests.test_gguf import write_gguf

# --- writers ------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, list[int]]) -> int:
    """A real safetensors file of F32 zeros; returns its size."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = struct.pack("<Q", len(raw)) + raw + bytes(offset)
    path.write_bytes(data)
    return len(data)


def write_hf(directory: Path, shards: int = 2) -> int:
    """A sharded Hugging Face layout; returns the bytes of its shards."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    (directory / "tokenizer.json").write_text("{}")
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{i}.w": [4, 4], f"model.layers.{i}.b": [4]}
        total += write_safetensors(directory / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def scan(
    *dirs: Path, mounts: list[Mount] | None = None, default: Path | None = None
) -> list[WeightCopy]:
    """What discovery finds, less each copy's last use (its mtime, as the file was just
    written: ``test_last_use_is_the_engines_start_else_the_files_mtime`` says it)."""
    found = scan_weights(
        list(dirs),
        default_dir=default if default is not None else Path("/nonexistent/llmgw-test-default"),
        mounts=[] if mounts is None else mounts,
    )
    for copy in found:
        assert copy.last_used is not None, copy
    return [msgspec.structs.replace(c, last_used=None) for c in found]


def test_last_use_is_the_engines_start_else_the_files_mtime(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path)
    os.utime(path, (1000.0, 2000.0))
    (found,) = scan_weights([tmp_path], default_dir=tmp_path / "none", mounts=[])
    assert found.last_used == 2000.0
    Budget(tmp_path, 1 << 30).mark_used(path, at=3000.0)  # what the agent does at a start
    (found,) = scan_weights([tmp_path], default_dir=tmp_path / "none", mounts=[])
    assert found.last_used == 3000.0


def models(copies: list[WeightCopy]) -> list[tuple[str, str]]:
    return sorted((c.model, c.format) for c in copies)


# --- GGUF header ----------------------------------------------------------


def test_default_dir() -> None:
    assert Path("/var/lib/llmgw-weights") == DEFAULT_WEIGHTS_DIR


@pytest.mark.parametrize("suffix", INCOMPLETE_SUFFIXES)
def test_download_leftover_beside_gguf(tmp_path: Path, suffix: str) -> None:
    # aria2 preallocates the whole file: only its control file says "not done".
    p = write_gguf(tmp_path / "m.gguf")
    (tmp_path / f"m.gguf{suffix}").write_bytes(b"")
    assert gguf_complete(p) == f"download in progress (m.gguf{suffix})"
    assert scan(tmp_path) == []


# --- safetensors and Hugging Face layouts --------------------------------


def test_safetensors(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    size = write_safetensors(p, {"w": [4, 4], "b": [4]})
    assert safetensors_complete(p) is None
    os.truncate(p, size - 1)
    assert safetensors_complete(p) == f"truncated: {size - 1} bytes, needs at least {size}"
    p.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    assert (safetensors_complete(p) or "").startswith("corrupt")
    p.write_bytes(struct.pack("<Q", 100) + b"{}")
    assert (safetensors_complete(p) or "").startswith("truncated")
    p.write_bytes(struct.pack("<Q", 4) + b"nope")
    assert (safetensors_complete(p) or "").startswith("corrupt")
    p.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert safetensors_complete(p) == "no tensors"
    p.write_bytes(b"abc")
    assert (safetensors_complete(p) or "").startswith("truncated")


def test_hf_sharded_complete(tmp_path: Path) -> None:
    d = tmp_path / "llama"
    total = write_hf(d)
    assert hf_complete(d) is None
    assert check_hf(d).size == total


def test_hf_missing_shard(tmp_path: Path) -> None:
    d = tmp_path / "llama"
    write_hf(d, shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    assert hf_complete(d) == "shard model-00002-of-00003.safetensors missing"
    assert scan(tmp_path) == []


def test_hf_truncated_shard(tmp_path: Path) -> None:
    d = tmp_path / "llama"
    write_hf(d)
    shard = d / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 4)
    assert (hf_complete(d) or "").startswith("shard model-00002-of-00002.safetensors: truncated")
    assert scan(tmp_path) == []


@pytest.mark.parametrize(
    "leftover",
    [
        "model-00002-of-00002.safetensors.incomplete",
        "model.safetensors.part",
        ".cache/huggingface/download/model-00002-of-00002.safetensors.incomplete",
    ],
)
def test_hf_download_in_progress(tmp_path: Path, leftover: str) -> None:
    d = tmp_path / "llama"
    write_hf(d)
    (d / leftover).parent.mkdir(parents=True, exist_ok=True)
    (d / leftover).write_bytes(b"")
    assert (hf_complete(d) or "").startswith("download in progress")
    assert scan(tmp_path) == []


def test_hf_layout_problems(tmp_path: Path) -> None:
    d = tmp_path / "m"
    write_hf(d)
    (d / "config.json").unlink()
    assert hf_complete(d) == "no config.json"
    (d / "config.json").write_text("[1]")
    assert hf_complete(d) == "config.json is not a JSON object"
    (d / "config.json").write_text("{")
    assert hf_complete(d) == "config.json unreadable"
    (d / "config.json").write_text("{}")
    assert hf_complete(d) is None
    idx = d / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {}}))
    assert hf_complete(d) == "model.safetensors.index.json names no shards"
    idx.write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    assert (hf_complete(d) or "").startswith("model.safetensors.index.json names a shard outside")
    idx.write_text("not json")
    assert hf_complete(d) == "model.safetensors.index.json unreadable"
    idx.unlink()
    for p in d.glob("*.safetensors"):
        p.unlink()
    assert (hf_complete(d) or "").startswith("no weight files")


def test_hf_single_safetensors_and_bin(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    size = write_safetensors(d / "model.safetensors", {"w": [2, 2]})
    assert check_hf(d) == W.HfCheck(None, size)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"")
    assert hf_complete(d) == "shard pytorch_model.bin is empty"
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    assert check_hf(d) == W.HfCheck(None, 64)
    (d / "pytorch_model.bin").unlink()
    (d / "pytorch_model-00001-of-00002.bin").write_bytes(b"x" * 10)
    (d / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "a": "pytorch_model-00001-of-00002.bin",
                    "b": "pytorch_model-00002-of-00002.bin",
                }
            }
        )
    )
    assert hf_complete(d) == "shard pytorch_model-00002-of-00002.bin missing"
    (d / "pytorch_model-00002-of-00002.bin").mkdir()
    assert hf_complete(d) == "shard pytorch_model-00002-of-00002.bin is not a file"
    (d / "pytorch_model-00002-of-00002.bin").rmdir()
    (d / "pytorch_model-00002-of-00002.bin").write_bytes(b"y" * 5)
    assert check_hf(d) == W.HfCheck(None, 15)


def test_safetensors_decide_over_bin(tmp_path: Path) -> None:
    # With a safetensors index present, its missing shard is not made up for
    # by .bin files: the engine would load the safetensors and fail.
    d = tmp_path / "m"
    write_hf(d)
    (d / "pytorch_model.bin").write_bytes(b"x" * 10)
    (d / "model-00001-of-00002.safetensors").unlink()
    assert hf_complete(d) is not None


# --- the scan -------------------------------------------------------------


def test_nothing_configured_nothing_found(tmp_path: Path) -> None:
    assert scan_weights([], default_dir=tmp_path / "missing", mounts=[]) == []


def test_empty_dirs_are_not_weights(tmp_path: Path) -> None:
    (tmp_path / "llama-3-8b").mkdir()  # a download that has not written anything yet
    (tmp_path / "other" / "nested").mkdir(parents=True)
    assert scan(tmp_path) == []
    assert scan(tmp_path / "llama-3-8b") == []


def test_partial_downloads_are_not_weights(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "half.gguf")
    os.truncate(p, p.stat().st_size - 1)
    d = tmp_path / "hf-half"
    write_hf(d, shards=2)
    (d / "model-00001-of-00002.safetensors").unlink()
    e = tmp_path / "hf-inflight"
    write_hf(e)
    (e / "model-00003-of-00003.safetensors.incomplete").write_bytes(b"")
    (tmp_path / "next.gguf.part").write_bytes(b"GGUF")
    assert scan(tmp_path) == []


def test_top_level_gguf(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "qwen2-0.5b-q8_0.gguf")
    assert scan(tmp_path) == [
        WeightCopy(
            model="qwen2-0.5b-q8_0",
            path=str(p),
            format="gguf",
            size_bytes=p.stat().st_size,
            storage="unknown",
        )
    ]


def test_gguf_in_subdirectory(tmp_path: Path) -> None:
    one = tmp_path / "llama-3-8b"
    one.mkdir()
    p = write_gguf(one / "Meta-Llama-3-8B.Q8_0.gguf")
    write_gguf(one / "mmproj-model-f16.gguf")  # a vision projector is not a model
    several = tmp_path / "qwen"
    several.mkdir()
    write_gguf(several / "q4.gguf")
    write_gguf(several / "q8.gguf")
    copies = scan(tmp_path)
    assert models(copies) == [("llama-3-8b", "gguf"), ("qwen/q4", "gguf"), ("qwen/q8", "gguf")]
    llama = next(c for c in copies if c.model == "llama-3-8b")
    assert llama.path == str(p) and llama.size_bytes == p.stat().st_size
    # q8 still downloading: q4 keeps the name it will have once q8 is whole.
    q8 = several / "q8.gguf"
    os.truncate(q8, q8.stat().st_size - 1)
    assert ("qwen/q4", "gguf") in models(scan(tmp_path))
    assert ("qwen/q8", "gguf") not in models(scan(tmp_path))


def test_split_gguf(tmp_path: Path) -> None:
    write_gguf(tmp_path / "big.gguf", split_max_tensors=1, small_first_shard=True)
    parts = sorted(tmp_path.glob("big-*.gguf"))
    assert [p.name for p in parts] == [
        "big-00001-of-00003.gguf",
        "big-00002-of-00003.gguf",
        "big-00003-of-00003.gguf",
    ]
    assert gguf_complete(parts[0]) == "no tensors"  # metadata only: not a model by itself
    (copy,) = scan(tmp_path)
    assert copy.model == "big"
    assert copy.path == str(parts[0])
    assert copy.size_bytes == sum(p.stat().st_size for p in parts)
    # A missing part, or a truncated one, and the model is not there.
    data = parts[2].read_bytes()
    parts[2].unlink()
    assert scan(tmp_path) == []
    parts[2].write_bytes(data[:-1])
    assert scan(tmp_path) == []


def test_hf_layout_found(tmp_path: Path) -> None:
    total = write_hf(tmp_path / "Llama-3-8B-Instruct")
    assert scan(tmp_path) == [
        WeightCopy(
            model="Llama-3-8B-Instruct",
            path=str(tmp_path / "Llama-3-8B-Instruct"),
            format="hf",
            size_bytes=total,
            storage="unknown",
        )
    ]


def test_hf_and_gguf_in_one_directory(tmp_path: Path) -> None:
    d = tmp_path / "m"
    write_hf(d)
    write_gguf(d / "m.Q8_0.gguf")
    assert models(scan(tmp_path)) == [("m", "gguf"), ("m", "hf")]


def make_hub_repo(cache: Path, repo: str, revision: str = "a" * 40) -> Path:
    """The huggingface_hub cache layout: blobs, refs/main, snapshot symlinks."""
    root = cache / ("models--" + repo.replace("/", "--"))
    src = cache / f".src-{revision}"
    write_hf(src)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        blob = root / "blobs" / f"{abs(hash((revision, f.name))):x}"
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    src.rmdir()
    return snap


def test_hub_cache_layout(tmp_path: Path) -> None:
    snap = make_hub_repo(tmp_path, "meta-llama/Llama-3.1-8B")
    (copy,) = scan(tmp_path)
    assert (copy.model, copy.path, copy.format) == ("meta-llama/Llama-3.1-8B", str(snap), "hf")
    # A blob still downloading: not there yet.
    (snap.parent.parent / "blobs" / "0123.incomplete").write_bytes(b"")
    assert scan(tmp_path) == []


def test_hub_cache_prefers_refs_main(tmp_path: Path) -> None:
    make_hub_repo(tmp_path, "gpt2", revision="b" * 40)
    (tmp_path / "models--gpt2" / "snapshots" / ("a" * 40)).mkdir()  # an empty, older one
    (copy,) = scan(tmp_path)
    assert copy.model == "gpt2" and copy.path.endswith("b" * 40)


def test_default_dir_always_looked_in(tmp_path: Path) -> None:
    default = tmp_path / "default"
    default.mkdir()
    write_gguf(default / "m.gguf")
    assert models(scan_weights([], default_dir=default, mounts=[])) == [("m", "gguf")]
    other = tmp_path / "other"
    other.mkdir()
    write_gguf(other / "n.gguf")
    assert models(scan_weights([other], default_dir=default, mounts=[])) == [
        ("m", "gguf"),
        ("n", "gguf"),
    ]


def test_missing_configured_dir_is_fine(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf")
    assert models(scan(tmp_path / "missing", tmp_path)) == [("m", "gguf")]


def test_same_copy_seen_twice_counts_once(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    write_gguf(real / "m.gguf")
    write_hf(real / "h")
    (tmp_path / "alias").symlink_to(real)
    other = tmp_path / "other"
    other.mkdir()
    (other / "m.gguf").symlink_to(real / "m.gguf")
    (other / "h").symlink_to(real / "h")
    copies = scan(real, tmp_path / "alias", other, default=real)
    assert models(copies) == [("h", "hf"), ("m", "gguf")]
    assert all(c.path.startswith(str(real)) for c in copies)


def test_symlink_loops_are_harmless(tmp_path: Path) -> None:
    d = tmp_path / "w"
    d.mkdir()
    (d / "self").symlink_to(d / "self")
    (d / "a").symlink_to(d / "b")
    (d / "b").symlink_to(d / "a")
    (d / "up").symlink_to(d)  # a directory that contains itself
    (d / "loop.gguf").symlink_to(d / "loop.gguf")
    write_gguf(d / "m.gguf")
    # "up/m.gguf" is m.gguf again: one copy, under its own name.
    assert models(scan(d)) == [("m", "gguf")]


def test_storage_attached(tmp_path: Path) -> None:
    filer = tmp_path / "filer"
    filer.mkdir()
    local = tmp_path / "nvme"
    local.mkdir()
    write_gguf(filer / "m.gguf")
    write_hf(local / "h")
    mounts = [
        Mount("/dev/sda1", "/", "ext4"),
        Mount("10.0.0.5:/export/models/", str(filer.resolve()), "nfs4"),
        Mount("/dev/nvme0n1", str(local.resolve()), "xfs"),
    ]
    copies = {c.model: c for c in scan(filer, local, mounts=mounts)}
    assert (copies["m"].storage, copies["m"].filesystem, copies["m"].storage_id) == (
        "shared",
        "nfs4",
        "nfs:10.0.0.5:/export/models",
    )
    assert (copies["h"].storage, copies["h"].filesystem, copies["h"].storage_id) == (
        "local",
        "xfs",
        "local:/dev/nvme0n1",
    )


def test_reads_the_node_mounts_by_default(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf")
    (copy,) = scan_weights([tmp_path], default_dir=tmp_path / "missing")
    assert copy.storage in ("local", "shared", "unknown")
    assert copy.filesystem  # this machine's /proc/mounts holds tmp_path somewhere


def test_walk_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "MAX_DIR_ENTRIES", 3)
    for name in "abcdef":
        write_gguf(tmp_path / f"{name}.gguf")
    assert len(scan(tmp_path)) <= 3

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

import attrs

from llmgw.agent.discovery.storage import Mount, classify, read_mounts
from llmgw.gguf import INCOMPLETE_SUFFIXES, KvShape, gguf_file
from llmgw.protocol.messages import WeightCopy
from llmgw.weights.budget import last_used

log = logging.getLogger("llmgw.agent.discovery.weights")

DEFAULT_WEIGHTS_DIR = Path("/var/lib/llmgw-weights")

# Bounds on the walk: entries looked at in one directory; JSON files read whole.
MAX_DIR_ENTRIES = 10_000
MAX_JSON_BYTES = 64 << 20  # config.json, index files
# fetched weights: how deep under the default dir their records are looked for
# (hf/ORG/REPO/REVISION/PATH, whose PATH may have folders of its own)
MAX_FETCHED_DEPTH = 8
MAX_SOURCE_BYTES = 4096

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
    kv: KvShape | None = None


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


def _gguf_models(files: list[Path]) -> Iterator[tuple[str, Path, int, KvShape | None]]:
    """(stem, first file, total size, KV shape) of each whole GGUF model among ``files``.

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
        check = gguf_file(p)
        if check.reason:
            log.debug("weights: %s skipped: %s", p, check.reason)
            continue
        yield p.stem, p, _size(p), check.kv
    for (prefix, count), parts in sorted(splits.items()):
        yield from _gguf_split(prefix, count, parts)


def _gguf_split(
    prefix: str, count: int, parts: dict[int, Path]
) -> Iterator[tuple[str, Path, int, KvShape | None]]:
    missing = [i for i in range(1, count + 1) if i not in parts]
    if count == 0 or missing:
        log.debug("weights: %s skipped: parts %s of %d missing", prefix, missing[:5], count)
        return
    tensors = 0
    total = 0
    kv = None
    for i in range(1, count + 1):
        check = gguf_file(parts[i])
        kv = kv or check.kv  # the metadata is in the first part
        # The first part may hold only metadata (gguf-split --no-tensor-first-split).
        if check.reason and not (check.reason == "no tensors" and i == 1):
            log.debug("weights: %s skipped: %s", parts[i], check.reason)
            return
        tensors += check.tensors
        total += _size(parts[i])
    if tensors == 0:
        log.debug("weights: %s skipped: no tensors in any part", prefix)
        return
    yield prefix, parts[1], total, kv


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
    for stem, path, size, kv in models:
        yield _Found(f"{name}/{stem}" if several else name, path, "gguf", size, kv)
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
    for stem, path, size, kv in _gguf_models(top_ggufs):
        yield _Found(stem, path, "gguf", size, kv)
    for e in entries:
        if e.name.lower().endswith(".gguf") or not _is_dir(e):
            continue
        if e.name.startswith("models--") and len(e.name) > len("models--"):
            yield from _hub_repo(Path(e.path), e.name)
        else:
            yield from _model_dir(e.name, Path(e.path))


def fetched_record(path: Path) -> Path:
    """Beside a file the agent fetched: the source it came from, one line, written
    once it landed whole (``agent.weights``)."""
    return path.with_name(f".{path.name}.source")


def _fetched(root: Path, depth: int = MAX_FETCHED_DEPTH) -> Iterator[tuple[Path, str]]:
    """(file or folder, its source) of everything under ``root`` that a fetch
    landed: it has its source's record, and is itself there (a ``.part`` never
    has one, nor a repository's folder before its last file landed)."""
    try:
        with os.scandir(root) as it:
            entries = [e for _, e in zip(range(MAX_DIR_ENTRIES), it, strict=False)]
    except OSError as exc:
        log.debug("weights: cannot list %s: %s", root, exc)
        return
    for e in sorted(entries, key=lambda entry: entry.name):
        if e.name.startswith(".") and e.name.endswith(".source"):
            target = root / e.name[1 : -len(".source")]
            try:
                with open(e.path, "rb") as f:
                    source = f.read(MAX_SOURCE_BYTES).decode("utf-8", "replace").strip()
            except OSError:
                continue
            if source and (target.is_file() or target.is_dir()):
                yield target, source
        elif depth > 0 and not e.name.startswith(".") and e.is_dir(follow_symlinks=False):
            yield from _fetched(Path(e.path), depth - 1)


def _fetched_found(path: Path, source: str) -> _Found | None:
    """A file a fetch landed, or a folder (a whole repository: named ORG/REPO, as a
    hub cache's is); None for a folder that holds no whole model."""
    if path.is_dir():
        name = source.removeprefix("hf://").split("@")[0]
        return next(_model_dir(name, path), None)
    for stem, first, size, kv in _gguf_models([path]):
        return _Found(stem, first, "gguf", size, kv)
    return _Found(path.stem, path, "gguf" if path.suffix.lower() == ".gguf" else "", _size(path))


def _last_used(path: Path) -> float | None:
    try:
        return last_used(path, path.stat().st_mtime)
    except OSError:
        return None


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
    sources: dict[str, str] = {}
    if default_dir in roots:
        for path, source in _fetched(default_dir):
            real = os.path.realpath(path)
            sources[real] = source
            if real not in seen and (landed := _fetched_found(path, source)) is not None:
                seen.add(real)
                found.append(landed)

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
                layers=f.kv.layers if f.kv else None,
                kv_k_per_token=f.kv.k_per_token if f.kv else None,
                kv_v_per_token=f.kv.v_per_token if f.kv else None,
                source=sources.get(os.path.realpath(f.path), ""),
                last_used=_last_used(f.path),
            )
        )
    return copies

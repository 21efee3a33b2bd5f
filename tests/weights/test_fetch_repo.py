"""A whole hub repository (``hf://ORG/REPO[@REV]``), fetched into a folder through
the real huggingface_hub against the stand-in: every file verified (LFS files by
their sha256), ``config.json`` landing last, the folder listed once whole and then
used without asking the hub; a file cut midway resumes."""

from __future__ import annotations

import hashlib
import json
import random
import struct
from pathlib import Path

import pytest

from llmgw.agent.discovery.weights import fetched_record, scan_weights
from llmgw.weights.errors import Corrupt, FetchError
from llmgw.weights.fetch import fetch
from llmgw.weights.repo import files_path
from llmgw.weights.source import HubRepo
from llmgw.weights.transfer import Progress
from tools.support.hubstandin import HubStandIn


def safetensors(seed: int, size: int) -> bytes:
    """A whole safetensors file: one tensor of ``size`` random bytes."""
    header = json.dumps({"t": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + random.Random(seed).randbytes(size)


def write_repo(root: Path) -> dict[str, bytes]:
    repo = root / "acme" / "tiny-vllm"
    files = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        "model-00001-of-00002.safetensors": safetensors(1, 3 << 20),
        "model-00002-of-00002.safetensors": safetensors(2, 1 << 20),
        "model.safetensors.index.json": json.dumps(
            {
                "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                }
            }
        ).encode(),
        "sub/generation_config.json": b"{}",
    }
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    return files


async def test_a_repository_lands_whole_config_last_and_is_then_used_offline(
    hub_root: Path, hub: HubStandIn, weights: Path
) -> None:
    files = write_repo(hub_root)
    seen: list[Progress] = []
    folder = await fetch(HubRepo("acme/tiny-vllm"), weights, endpoint=hub.url, progress=seen.append)
    assert folder == weights / "hf" / "acme" / "tiny-vllm" / "main"
    for name, data in files.items():
        assert (folder / name).read_bytes() == data, name
    gets = [r.path.split("/resolve/main/")[-1] for r in hub.gets("/resolve/")]
    assert gets[-1] == "config.json", gets  # what makes it a model, last
    total = sum(len(d) for d in files.values())
    fetched_record(folder).write_text("hf://acme/tiny-vllm\n")  # as the agent writes it
    (found,) = scan_weights([], default_dir=weights, mounts=[])  # a whole HF model
    assert (found.model, found.format, found.path) == ("acme/tiny-vllm", "hf", str(folder))
    assert seen and seen[-1].total == total and seen[-1].done == total
    assert files_path(folder).exists()
    asked = len(hub.requests)
    again = await fetch(HubRepo("acme/tiny-vllm"), weights, endpoint="http://127.0.0.1:9")
    assert again == folder and len(hub.requests) == asked  # whole: no network


async def test_a_repository_cut_midway_resumes_and_a_damaged_file_is_refused(
    hub_root: Path, hub: HubStandIn, weights: Path
) -> None:
    write_repo(hub_root)
    hub.cut_after = 1 << 20  # every answer ends after 1 MiB: the big file takes three
    await fetch(HubRepo("acme/tiny-vllm"), weights, endpoint=hub.url, stall_s=10)
    folder = weights / "hf" / "acme" / "tiny-vllm" / "main"
    big = folder / "model-00001-of-00002.safetensors"
    assert (
        hashlib.sha256(big.read_bytes()).digest()
        == hashlib.sha256((hub_root / "acme" / "tiny-vllm" / big.name).read_bytes()).digest()
    )
    hub.cut_after = None
    other = tmp_folder = weights / "other"
    hub.corrupt = True  # one byte flipped in every file served; the listing stays right
    with pytest.raises(Corrupt):
        await fetch(HubRepo("acme/tiny-vllm"), weights, target=tmp_folder, endpoint=hub.url)
    assert not files_path(other).exists()
    with pytest.raises(FetchError, match="has no repository acme/absent"):
        await fetch(HubRepo("acme/absent"), weights, endpoint=hub.url)

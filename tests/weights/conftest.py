"""A hub stand-in over a folder of generated model files, and a huggingface_hub that
knows no token, endpoint or offline mode of whoever runs the tests."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from tools.support.hubstandin import HubStandIn

SIZE = 3 * (1 << 20) + 12345  # a few blocks, and not a whole number of them


@attrs.frozen
class Model:
    repo: str  # ORG/REPO
    path: str  # in the repository
    file: Path  # the stand-in's copy
    data: bytes
    sha256: str

    @property
    def source(self) -> str:
        return f"hf://{self.repo}/{self.path}"


def model_file(root: Path, repo: str, path: str, size: int = SIZE, seed: int = 1) -> Model:
    data = random.Random(seed).randbytes(size)
    file = root.joinpath(repo, path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data)
    return Model(repo, path, file, data, hashlib.sha256(data).hexdigest())


@pytest.fixture(autouse=True)
def _no_hub_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    from huggingface_hub import constants

    # the token `hf auth login` saved, if the machine has one: never sent from a test
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub_root(tmp_path: Path) -> Path:
    root = tmp_path / "hub"
    root.mkdir()
    return root


@pytest.fixture
def model(hub_root: Path) -> Model:
    return model_file(hub_root, "acme/tiny-GGUF", "tiny-Q4_K_M.gguf")


@pytest.fixture
def hub(hub_root: Path) -> Iterator[HubStandIn]:
    with HubStandIn(hub_root) as h:
        yield h


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return tmp_path / "weights"

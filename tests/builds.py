"""Single files (``tools/build --host``) of this checkout or of a named older commit,
built once a test session and kept under its temporary directory.

An older commit is checked out from this repository's own history (a local
clone that shares its objects: nothing is fetched, nothing changes here). A
checkout that lacks it skips the test that needs it when the clone is shallow
(or not a git repository), and fails it otherwise, saying which commit and how
to get it: a test that quietly built this checkout again would upgrade a fleet
to itself and prove nothing about upgrading.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build(out: Path, *, host: bool, root: Path = ROOT) -> Path:
    args = [str(root / "tools" / "build"), "-o", str(out)] + (["--host"] if host else [])
    result = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"tools/build failed:\n{result.stdout}\n{result.stderr}"
    return out


def built(factory: pytest.TempPathFactory, commit: str | None = None) -> Path:
    """The single file for this host: of the working tree (``commit`` None), or of
    ``commit``; built at the first ask of the session, the same file after."""
    cache = factory.getbasetemp() / "builds"
    cache.mkdir(exist_ok=True)
    out = cache / f"llmgw-{commit or 'checkout'}.pyz"
    if not out.exists():
        root = ROOT if commit is None else checkout(commit, cache / f"src-{commit}")
        build(cache / f"{out.name}.part", host=True, root=root).rename(out)
    return out


def checkout(commit: str, dest: Path) -> Path:
    """``commit`` checked out at ``dest`` from this repository's history, with this
    checkout's virtualenv (``tools/build`` runs pex from it)."""
    have = _git("cat-file", "-e", f"{commit}^{{commit}}", check=False)
    if have.returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository", check=False)
        why = (
            f"commit {commit} is not in this checkout's history"
            + (" (a shallow clone)" if shallow.stdout.strip() == "true" else "")
            + f": the upgrade test builds the fleet it upgrades from it; fetch it with"
            f" `git fetch --unshallow` (or `git fetch origin {commit}`) and run again"
        )
        if shallow.returncode != 0 or shallow.stdout.strip() == "true":
            # history that was never cloned cannot be had without a network: say so loudly
            pytest.skip(why)
        pytest.fail(why)  # a full clone without it: something is wrong with the history
    if not dest.exists():
        _git("clone", "--quiet", "--shared", "--no-checkout", str(ROOT), str(dest))
        _git("-C", str(dest), "checkout", "--quiet", "--detach", commit)
        (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


def protocol_of(commit: str) -> str:
    """The agent-stream subprotocol that ``commit`` speaks (``llmgw.agent.vN``)."""
    text = _git("show", f"{commit}:llmgw/protocol/version.py").stdout
    m = re.search(r"^PROTOCOL_VERSION = (\d+)$", text, re.MULTILINE)
    assert m is not None, f"no PROTOCOL_VERSION in {commit}'s llmgw/protocol/version.py"
    return f"llmgw.agent.v{m[1]}"


def _git(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(
        ["git", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=check, timeout=120
    )

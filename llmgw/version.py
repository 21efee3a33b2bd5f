"""What this llmgw is: its version and its build (the git commit it was built from).

The build is read, in order, from ``_build.txt`` beside this module (written
by ``tools/build`` into the single file), from the source checkout's git
(a development run), or is ``unknown``. Read once, on first use.
"""

from __future__ import annotations

import functools
import subprocess
from importlib import resources
from pathlib import Path

from llmgw import __version__

VERSION = __version__
BUILD_FILE = "_build.txt"


@functools.cache
def build() -> str:
    """The git commit (short) this llmgw was built from, ``-dirty`` if it had changes."""
    try:
        written = resources.files("llmgw").joinpath(BUILD_FILE).read_text().strip()
        if written:
            return written
    except (OSError, ValueError):
        pass
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=2,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def describe() -> str:
    """``0.1.0 (build 1a2b3c4d5e6f)``: what ``--version`` prints and agents report."""
    return f"{VERSION} (build {build()})"

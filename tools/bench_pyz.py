"""How fast does the single file (``tools/build``'s ``dist/llmgw.pyz``) start?

Prints:

1. the file's size;
2. the first run of ``--version`` with an empty PEX_ROOT (what a node's first
   start pays: pex unpacks the file into a venv under PEX_ROOT), and of that the
   extraction (first run minus a warm run);
3. the first run of ``ctl nodes`` with an empty PEX_ROOT, against a running
   server (started from the project's venv, config and certificates in a
   temporary folder);
4. after the first run, ``--version`` and ``ctl nodes`` from the file and from
   the venv (``.venv/bin/llmgw``), interleaved, ``--runs`` times each: median
   and min, and the file's median minus the venv's (the goal: at most 0.2 s).

The file runs under ``--python`` (default: /usr/bin/python3 when it is 3.11 or
newer, else this interpreter's base python) with ``-I``, from a clean folder.
A venv's ``--version`` also asks git which commit the checkout is at (the file
reads it from ``_build.txt``), so it does a little more work than the file.

    .venv/bin/python -m tools.bench_pyz [--pyz dist/llmgw.pyz] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.support.procs import ROOT, Failed, Proc

VENV_LLMGW = ROOT / ".venv" / "bin" / "llmgw"


def default_python() -> str:
    system = Path("/usr/bin/python3")
    if system.exists():
        ok = subprocess.run(
            [str(system), "-c", "import sys; sys.exit(sys.version_info < (3, 11))"], check=False
        )
        if ok.returncode == 0:
            return str(system)
    return str(Path(sys.base_prefix) / "bin" / "python3")


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"bench_pyz: {' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return took


def start_server(work: Path) -> tuple[Proc, list[str]]:
    """A server from the venv; returns it and the ctl arguments that reach it."""
    for args in (["init"], ["server", "127.0.0.1"]):
        subprocess.run(
            [str(VENV_LLMGW), "ctl", "cert", *args, "--dir", "pki"],
            cwd=work,
            check=True,
            capture_output=True,
        )
    (work / "server.toml").write_text(
        'state_dir = "state"\n[agent_stream]\nlisten = "127.0.0.1:0"\n'
        'ca = "pki/ca.pem"\ncert = "pki/server.pem"\nkey = "pki/server-key.pem"\n'
        '[admin]\nlisten = "127.0.0.1:0"\n'
    )
    server = Proc("server", [str(VENV_LLMGW), "server", "--config", "server.toml"], work)
    server.start()
    try:
        found = server.wait_log(r"admin API listening on (http://\S+)", timeout=30)
    except Failed as e:
        server.kill()
        sys.exit(f"bench_pyz: the server did not start: {e}")
    token = str(work / "state" / "admin-token")
    return server, ["--admin-url", found[1], "--token-file", token]


def fmt(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s, min {min(values):.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pyz", type=Path, default=ROOT / "dist" / "llmgw.pyz")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--python", default=None, help="interpreter that runs the file")
    opts = parser.parse_args()
    pyz = opts.pyz.resolve()
    if not pyz.exists():
        sys.exit(f"bench_pyz: no {pyz}; build it with tools/build (or tools/build --host)")
    if not VENV_LLMGW.exists():
        sys.exit("bench_pyz: no .venv/bin/llmgw; run tools/setup first")
    python = opts.python or default_python()

    with tempfile.TemporaryDirectory(prefix="bench-pyz-") as tmp:
        work = Path(tmp)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(work),
            "PEX_ROOT": str(work / "pex-root"),
        }
        file_cmd = [python, "-I", str(pyz)]
        server, ctl_args = start_server(work)
        try:
            version = subprocess.run(
                [*file_cmd, "--version"], env=env, capture_output=True, text=True, check=False
            ).stdout.strip()
            shutil.rmtree(work / "pex-root", ignore_errors=True)
            print(f"file:               {pyz} ({pyz.stat().st_size / 2**20:.1f} MiB), {version}")
            print(f"interpreter:        {python} -I")

            first_version = timed([*file_cmd, "--version"], work, env)
            warm_after_first = timed([*file_cmd, "--version"], work, env)
            shutil.rmtree(work / "pex-root")
            first_nodes = timed([*file_cmd, "ctl", "nodes", *ctl_args], work, env)
            print(f"first run --version (empty PEX_ROOT): {first_version:.3f} s")
            print(f"  of which extraction (first - warm): {first_version - warm_after_first:.3f} s")
            print(f"first run ctl nodes (empty PEX_ROOT): {first_nodes:.3f} s")

            venv_env = dict(os.environ)
            rows = {
                "--version": ["--version"],
                "ctl nodes": ["ctl", "nodes", *ctl_args],
            }
            print(f"after the first run, {opts.runs} runs each, interleaved:")
            for label, args in rows.items():
                from_file: list[float] = []
                from_venv: list[float] = []
                for _ in range(opts.runs):
                    from_file.append(timed([*file_cmd, *args], work, env))
                    from_venv.append(timed([str(VENV_LLMGW), *args], work, venv_env))
                gap = statistics.median(from_file) - statistics.median(from_venv)
                print(f"  {label:10} file: {fmt(from_file)}")
                print(f"  {label:10} venv: {fmt(from_venv)}")
                print(f"  {label:10} file - venv (medians): {gap:+.3f} s")
        finally:
            server.stop(grace_s=10)


if __name__ == "__main__":
    main()

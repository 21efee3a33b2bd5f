"""A benchmark killed with SIGTERM (``timeout``, a killed job) stops what it started,
as on Ctrl-C: ``tools.support.procs.interrupt_on_sigterm``; and what it starts of
this Python imports the checkout it runs from."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.support.procs import ROOT, Proc, alive, python_path

SCRIPT = """
import sys, time
from pathlib import Path
from tools.support.procs import Procs, interrupt_on_sigterm
if sys.argv[2] == "on":
    interrupt_on_sigterm()
procs = Procs(Path(sys.argv[1]))
try:
    child = procs.start("child", ["sleep", "60"])
    print(child.pid, flush=True)
    time.sleep(60)
finally:
    procs.stop_all()
"""


@pytest.mark.parametrize("handled", [True, False])
def test_a_tool_stopped_with_sigterm_stops_its_children(tmp_path: Path, handled: bool) -> None:
    tool = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path), "on" if handled else "off"],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**python_path(), "PATH": "/usr/bin:/bin"},
    )
    child = 0
    try:
        assert tool.stdout is not None
        child = int(tool.stdout.readline())
        tool.send_signal(signal.SIGTERM)
        tool.wait(10)
        deadline = time.monotonic() + 5
        while alive(child) and handled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child) is not handled  # without the handler it was left running
    finally:
        tool.kill()
        if child:
            subprocess.run(["kill", "-9", str(child)], check=False, capture_output=True)


def test_a_child_of_this_python_imports_the_checkout_the_tool_runs_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m llmgw`` started in a run's folder, from a worktree whose virtualenv
    has another checkout installed, imported that one: a benchmark of a change measured
    the unchanged router. A child of this Python gets this checkout first on its path;
    another program's Python (a venv of its own) is left as it is."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    code = "import sys; print(sys.path[1])"  # [0]: the script's ("" for -c)
    ours = Proc("ours", [sys.executable, "-c", code], tmp_path, fresh=True).start()
    other = Proc("other", ["/usr/bin/env", "python3", "-c", code], tmp_path, fresh=True).start()
    for p in (ours, other):
        assert p.proc is not None and p.proc.wait(timeout=30) == 0
    assert (tmp_path / "ours.log").read_text().strip() == str(ROOT)
    assert (tmp_path / "other.log").read_text().strip() != str(ROOT)

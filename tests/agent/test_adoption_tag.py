"""Recognising an engine by its tag, with a real process."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from llmgw.agent.adoption import is_our_engine, tagged_leaders
from llmgw.agent.env import engine_env
from llmgw.agent.procs import ProcessIdentity, identity


@contextmanager
def sleeper(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(5)


def settled(pid: int) -> ProcessIdentity:
    """The identity once exec has laid out the argv (bounded: 5 s)."""
    for _ in range(500):
        seen = identity(pid)
        if seen is not None and seen.cmdline:
            return seen
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never showed its command line")


def test_a_tagged_engine_is_ours_even_when_its_record_has_another_command_line(
    tmp_path: Path,
) -> None:
    """A record read from its previous copy may hold a launcher's command line."""
    with sleeper(engine_env({"PATH": "/usr/bin"}, {}, "s1", tmp_path)) as proc:
        seen = settled(proc.pid)
        launcher = attrs.evolve(seen, cmdline=("sh", "-c", "exec python ..."))
        assert is_our_engine(seen, "s1", tmp_path)
        assert is_our_engine(launcher, "s1", tmp_path)
        assert not is_our_engine(launcher, "s2", tmp_path)  # another shard's tag
        assert not is_our_engine(launcher, "s1", tmp_path / "other")  # another agent's
        recycled = attrs.evolve(launcher, start_time=seen.start_time + 1)
        assert not is_our_engine(recycled, "s1", tmp_path)
        assert tagged_leaders(tmp_path) == {proc.pid: "s1"}


def test_an_untagged_process_is_ours_only_by_its_command_line(tmp_path: Path) -> None:
    with sleeper({"PATH": "/usr/bin"}) as proc:
        seen = settled(proc.pid)
        assert is_our_engine(seen, "s1", tmp_path)
        assert not is_our_engine(attrs.evolve(seen, cmdline=("other",)), "s1", tmp_path)
        assert tagged_leaders(tmp_path) == {}

"""The state dir's lock: held for the block, refused to a second holder with the
first one's pid, free again once released."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.lock import LOCK_FILE, StateDirBusy, hold


def test_a_second_holder_is_refused_naming_the_first_pid(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with hold(state):
        assert (state / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(StateDirBusy) as refused, hold(state):
            pass
        assert str(refused.value) == (
            f"another agent (pid {os.getpid()}) runs with state dir {state}; "
            "stop it first, or give this one another state_dir"
        )
    with hold(state):  # released with the block
        pass

"""An agent whose state dir is full says so: in its log, once, and to the control
plane in its inventory, until there is room again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llmgw.agent.inventory import InventorySource, same_inventory
from llmgw.config.schema import InventoryOverrides


def test_a_full_state_dir_is_a_problem_in_the_inventory_and_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent.discovery")
    source = InventorySource(InventoryOverrides(), ("127.0.0.1", 7443))
    source.state_dir = tmp_path
    roomy = source.inventory()
    assert roomy.problems == []
    # the disk of tmp_path as full as it gets: more asked free than it has
    source.min_free_bytes = 1 << 62
    full = source.inventory()
    [problem] = full.problems
    assert problem.startswith(f"state dir {tmp_path} is full: ")
    assert problem.endswith(" KiB free")
    assert not same_inventory(roomy, full)  # so the next heartbeat carries it
    source.inventory()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"state dir {tmp_path} is full" in warnings[0].getMessage()
    source.min_free_bytes = 0
    assert source.inventory().problems == []
    assert "has room again" in caplog.records[-1].getMessage()

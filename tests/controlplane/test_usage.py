"""The usage ledger: routers' counts that only grow become what each tenant used, by
the hour and the day; kept across a restart without counting anything twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.controlplane.usage import DAY, HOUR, UsageLedger, UsageRefused
from llmgw.routing import UsageRow

T0 = 1_800_000_000.0  # a wall time, on an hour


def row(tenant: str, model: str, requests: int, tokens: int = 0, **refused: int) -> UsageRow:
    return UsageRow(
        tenant=tenant,
        model=model,
        requests=requests,
        prompt_tokens=tokens,
        completion_tokens=2 * tokens,
        refused=refused,
    )


def summed(
    ledger: UsageLedger, since: float, now: float, tenant: str | None = None
) -> list[tuple[str, str, int, int, int, dict[str, int]]]:
    return [
        (r.tenant, r.model, r.requests, r.prompt_tokens, r.completion_tokens, r.refused)
        for r in ledger.rows(since, now, tenant)
    ]


def test_what_grew_is_added_once_per_router_and_summed_since_a_time() -> None:
    ledger = UsageLedger(None)
    ledger.take("r1", [row("acme", "m", 2, 10)], T0 + 10)
    ledger.take("r1", [row("acme", "m", 2, 10)], T0 + 20)  # said again: nothing grew
    ledger.take("r2", [row("acme", "m", 1, 5, rpm=3)], T0 + 30)
    ledger.take("r1", [row("acme", "m", 5, 40), row("beta", "", 0, rpm=1)], T0 + HOUR + 5)
    now = T0 + HOUR + 60
    assert summed(ledger, T0, now) == [
        ("acme", "m", 6, 45, 90, {"rpm": 3}),
        ("beta", "", 0, 0, 0, {"rpm": 1}),
    ]
    assert summed(ledger, T0 + HOUR, now, "acme") == [("acme", "m", 3, 30, 60, {})]
    # beyond two days: by the day it was taken in
    later = T0 + 3 * DAY
    assert summed(ledger, T0 - 1, later, "acme")[0][2] == 6


def test_a_restarted_control_plane_counts_only_what_grew_since(tmp_path: Path) -> None:
    path = tmp_path / "usage.json"
    ledger = UsageLedger(path)
    ledger.take("r1", [row("acme", "m", 3, 10)], T0)
    ledger.save()
    again = UsageLedger(path)
    again.take("r1", [row("acme", "m", 4, 12)], T0 + 60)  # the same router, a bit more
    assert summed(again, T0 - 1, T0 + 120) == [("acme", "m", 4, 12, 24, {})]
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_report_not_well_formed_changes_nothing() -> None:
    ledger = UsageLedger(None)
    with pytest.raises(UsageRefused, match="at least 0"):
        ledger.take("r1", [row("acme", "m", -1)], T0)
    with pytest.raises(UsageRefused, match="each with a tenant"):
        ledger.take("r1", [row("", "m", 1)], T0)
    assert ledger.rows(T0 - 1, T0 + 1) == []


def test_old_buckets_and_routers_not_heard_from_are_forgotten(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "u.json")
    ledger.take("r1", [row("acme", "m", 1)], T0)
    ledger.prune(T0 + 3 * DAY)
    assert ledger.rows(T0 - 1, T0 + 3 * DAY) != []  # the day is kept
    assert ledger.rows(T0 + 3 * DAY - HOUR, T0 + 3 * DAY) == []  # its hours are not
    ledger.take("r1", [row("acme", "m", 1)], T0 + 3 * DAY)  # forgotten: counted anew
    assert summed(ledger, T0 - 1, T0 + 3 * DAY)[0][2] == 2


def test_the_in_process_routers_counts_start_again_with_the_server(tmp_path: Path) -> None:
    """Its counts start at 0 in each server process: read under an id of the process's
    own, a restart's small counts add to what was kept, never go below it."""
    path = tmp_path / "usage.json"
    counts = [row("acme", "m", 5, 10)]
    ledger = UsageLedger(path)
    ledger.read_in_process(lambda: counts)
    ledger.refresh(T0)
    ledger.save()
    again = UsageLedger(path)  # restarted: its router counted 1 since
    again.read_in_process(lambda: [row("acme", "m", 1, 2)])
    again.refresh(T0 + 60)
    assert summed(again, T0 - 1, T0 + 120) == [("acme", "m", 6, 12, 24, {})]

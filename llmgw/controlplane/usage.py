"""What tenants used, fleet-wide: requests, tokens and refusals per tenant and model.

Theory of operation
-------------------
Every router counts what tenants' keys used through it since it started
(``llmgw.router.tally``): counts that only grow. A standalone router sends them
whole with each report, the router inside ``llmgw server`` is read in process,
and ``UsageLedger.take`` adds what grew since that router's last word to the
hour and the day it is taken in. ``rows`` sums them since a time: by the hour
for the last ``HOURS_KEPT_S``, by the day (UTC) before that, for
``DAYS_KEPT_S``.

The ledger lives in ``usage.json`` in the state directory, saved every
``SAVE_S`` when it changed (``files.write_atomic``), with each router's last
counts: a control plane restarted adds only what grew since, and at most the
last ``SAVE_S`` of counts is lost to a crash. A report that is not well formed
changes nothing. Bounded: routers not heard from for ``ROUTER_TTL_S`` are
forgotten (their ids are random per process), and a report holds at most
``MAX_ROWS`` rows.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import trio

from llmgw.files import KeptFile
from llmgw.routing import UsageRow

log = logging.getLogger("llmgw.tenants")

FILE = "usage.json"
HOUR, DAY = 3600.0, 86400.0
HOURS_KEPT_S = 2 * DAY
DAYS_KEPT_S = 400 * DAY
SAVE_S = 10.0
ROUTER_TTL_S = DAY
MAX_ROWS = 10_000


class UsageRefused(ValueError):
    """A report's usage that is not well formed, in words for its 400."""


class _Bucket(msgspec.Struct, kw_only=True):
    start: float
    row: UsageRow


class _Seen(msgspec.Struct, kw_only=True):
    at: float  # wall time it was last heard from
    rows: list[UsageRow]


class _Saved(msgspec.Struct, kw_only=True):
    version: int = 1
    hours: list[_Bucket] = []
    days: list[_Bucket] = []
    routers: dict[str, _Seen] = {}


def _key(row: UsageRow) -> tuple[str, str]:
    return row.tenant, row.model


def _add(into: UsageRow, row: UsageRow, sign: int = 1) -> None:
    into.requests += sign * row.requests
    into.prompt_tokens += sign * row.prompt_tokens
    into.completion_tokens += sign * row.completion_tokens
    for limit, n in row.refused.items():
        into.refused[limit] = into.refused.get(limit, 0) + sign * n


def _grown(now: UsageRow, before: UsageRow | None) -> UsageRow:
    """What grew from ``before`` to ``now`` (a count that shrank: none of it)."""
    d = UsageRow(tenant=now.tenant, model=now.model, refused={})
    _add(d, now)
    if before is not None:
        _add(d, before, -1)
    d.requests = max(d.requests, 0)
    d.prompt_tokens = max(d.prompt_tokens, 0)
    d.completion_tokens = max(d.completion_tokens, 0)
    d.refused = {k: v for k, v in d.refused.items() if v > 0}
    return d


def check(rows: list[UsageRow]) -> None:
    """Raises UsageRefused when a report's usage is not well formed."""
    if len(rows) > MAX_ROWS:
        raise UsageRefused(f"usage must be at most {MAX_ROWS:,} rows")
    for r in rows:
        counts = [r.requests, r.prompt_tokens, r.completion_tokens, *r.refused.values()]
        if any(n < 0 for n in counts) or not r.tenant:
            raise UsageRefused("usage counts must be numbers of at least 0, each with a tenant")


class UsageLedger:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._hours: dict[tuple[float, str, str], UsageRow] = {}
        self._days: dict[tuple[float, str, str], UsageRow] = {}
        self._routers: dict[str, _Seen] = {}
        self._dirty = False
        self._file = (
            None
            if path is None
            else KeptFile(
                path, "tenants' usage", "it is kept in memory and saved when it can be", log
            )
        )
        self._in_process: tuple[str, Callable[[], list[UsageRow]]] | None = None
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            saved = msgspec.json.decode(path.read_bytes(), type=_Saved)
        except FileNotFoundError:
            return
        except (OSError, msgspec.DecodeError) as exc:  # usage is history: start anew, say so
            log.error(
                "tenants' usage in %s cannot be read (%s): counting from now; move the file "
                "aside to keep it",
                path,
                exc,
            )
            return
        for b in saved.hours:
            self._hours[(b.start, *_key(b.row))] = b.row
        for b in saved.days:
            self._days[(b.start, *_key(b.row))] = b.row
        self._routers = dict(saved.routers)

    def take(self, router: str, rows: list[UsageRow], wall: float) -> None:
        """``router``'s counts since it started, as it says now: what grew is added.

        Raises:
            UsageRefused: the rows are not well formed; nothing was taken.
        """
        check(rows)
        seen = self._routers.get(router)
        before = {} if seen is None else {_key(r): r for r in seen.rows}
        for row in rows:
            grown = _grown(row, before.get(_key(row)))
            if grown.requests or grown.prompt_tokens or grown.completion_tokens or grown.refused:
                self._count(grown, wall)
        if seen is None or seen.rows != rows:
            self._dirty = True
        self._routers[router] = _Seen(at=wall, rows=rows)

    def _count(self, row: UsageRow, wall: float) -> None:
        for buckets, size in ((self._hours, HOUR), (self._days, DAY)):
            key = (math.floor(wall / size) * size, row.tenant, row.model)
            into = buckets.get(key)
            if into is None:
                into = buckets[key] = UsageRow(tenant=row.tenant, model=row.model, refused={})
            _add(into, row)

    def rows(self, since: float, now: float, tenant: str | None = None) -> list[UsageRow]:
        """Each tenant's usage of each model since ``since`` (by the hour within
        ``HOURS_KEPT_S``, else from the start of its day), sorted."""
        hourly = since >= now - HOURS_KEPT_S
        size = HOUR if hourly else DAY
        buckets = self._hours if hourly else self._days
        start = math.floor(since / size) * size
        out: dict[tuple[str, str], UsageRow] = {}
        for (at, who, model), row in buckets.items():
            if at < start or (tenant is not None and who != tenant):
                continue
            into = out.get((who, model))
            if into is None:
                into = out[who, model] = UsageRow(tenant=who, model=model, refused={})
            _add(into, row)
        return [out[k] for k in sorted(out)]

    def prune(self, wall: float) -> None:
        for buckets, kept in ((self._hours, HOURS_KEPT_S), (self._days, DAYS_KEPT_S)):
            for key in [k for k in buckets if k[0] < wall - kept]:
                del buckets[key]
                self._dirty = True
        for router in [r for r, s in self._routers.items() if s.at < wall - ROUTER_TTL_S]:
            del self._routers[router]
            self._dirty = True

    def save(self) -> None:
        """Write the ledger if it changed; a failure is said once, and tried again."""
        data = self._encoded()
        if data is not None:
            self._write(data)

    def _encoded(self) -> bytes | None:
        """The ledger as saved, if it changed since the last save (then counted saved:
        a failed write marks it changed again)."""
        if not self._dirty or self.path is None:
            return None
        self._dirty = False
        saved = _Saved(
            hours=_buckets(self._hours.items()),
            days=_buckets(self._days.items()),
            routers=self._routers,
        )
        return msgspec.json.encode(saved)

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        if not self._file.save(data):
            self._dirty = True

    def read_in_process(self, counts: Callable[[], list[UsageRow]]) -> None:
        """The router inside this server: its counts are read by ``refresh``, under an
        id of this process's own (its counts start again with the process)."""
        self._in_process = (f"in-process-{secrets.token_hex(6)}", counts)

    def refresh(self, wall: float) -> None:
        """Take what the in-process router counted, as of now."""
        if self._in_process is not None:
            router, counts = self._in_process
            self.take(router, counts(), wall)

    async def run(self, wall: Callable[[], float]) -> None:
        """Read the in-process router's counts, prune and save, every ``SAVE_S``."""
        try:
            while True:
                await trio.sleep(SAVE_S)
                self.refresh(wall())
                self.prune(wall())
                data = self._encoded()  # read here; written and fsync-ed off the loop
                if data is not None:
                    await trio.to_thread.run_sync(self._write, data)
        finally:
            self.refresh(wall())
            self.save()


def _buckets(items: Iterable[tuple[tuple[float, str, str], UsageRow]]) -> list[_Bucket]:
    return [_Bucket(start=k[0], row=row) for k, row in sorted(items)]

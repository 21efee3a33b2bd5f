"""Leases: every router's slice of each tenant's limits, so that the limits hold
across every router process.

Theory of operation
-------------------
A tenant's limits (``llmgw.routing.Limits``: requests and tokens a minute,
requests in flight, tokens a day or a month) and its keys' own are held by the
control plane, here, and spent by routers. A router (each worker of a
standalone router, and the one inside ``llmgw server``) holds leases: units of
one limit of one owner that it may spend without asking (``router.quota``).
It asks for more before it runs out, or when a request waits on it, and gives
back what it did not spend, all in one ``LeaseExchange``; the control plane
answers from what it counts, each limit's ``_Pot``:

- ``rpm``, ``tpm``: units granted within the last ``COUNTED_S`` (the minute of
  the limit plus ``LEASE_S``, the time a router may spend a grant), by the
  second they were granted in, less what came back unspent. What routers spend
  in any minute was granted within the ``COUNTED_S`` before its end, so it is
  at most the limit, however the spending falls between them.
- ``budget_day``, ``budget_month``: units granted in the period (a calendar
  day or month, UTC), less what came back; a grant may be spent until the
  period ends.
- ``in_flight``: slots, held by each router until it gives them back. A router
  not heard from for ``GONE_S`` has no requests in flight: its slots are free.

What a router was granted and could not give back (it was killed) stays
counted, as spent: a router lost loses at most its leases, never more.

Never a false refusal: a grant is at most half of what a limit has left (at
least what a waiting request needs), and each exchange says what the router
holds unspent (``holds``; with what it was granted since, at most what it can
hold: what it reserved and did not use comes back to it, but never more than
it was granted). A request whose need does not fit what is left is denied for
good (``final``) only when what the other routers may hold unspent would not
make it fit either (in flight: their slots not in use when they last said, a
second ago at most), nor, for a budget, what requests in flight reserved at any
router (``reserved``: a request reserves its worst case, and what it does not
use comes back at its end; a budget refused is refused until the period ends,
so it waits for them); otherwise the limit is ``contended`` for
``CONTENDED_S``: every router told so in its next exchange (within a second)
gives back what it does not need now and asks for nothing ahead, and the
waiting request asks again. A router holding anything says so every second
(``router.leases``); what one not heard from for ``HELD_S`` said it holds is
counted on no more (it was killed: what it held is lost, counted as spent). A
limit that becomes contended is logged, once a minute at most (``TELL_S``);
``stats``, ``contended`` and ``routers`` are for the metrics
(``llmgw_leases_*``).

The counts live in ``leases.json`` in the state directory, written
(``files.write_atomic``) before an answer that grants anything leaves: a
control plane restarted knows every grant it made. A write that fails (a full
disk) is said once and tried again with the next; the grant stands, kept in
memory, rather than refusing every tenant while the disk is full.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import msgspec
import trio

from llmgw.files import KeptFile
from llmgw.routing import (
    BUDGETS,
    LeaseAnswer,
    LeaseAsk,
    LeaseBack,
    LeaseDenied,
    LeaseExchange,
    LeaseGrant,
    LeaseHold,
    Limits,
)

log = logging.getLogger("llmgw.tenants")

FILE = "leases.json"
WINDOW_S = 60.0  # the minute of a per-minute limit
LEASE_S = 10.0  # how long a router may spend a per-minute grant
COUNTED_S = WINDOW_S + LEASE_S  # how long a per-minute grant counts here
GONE_S = 30.0  # a router not heard from this long holds no slots
HELD_S = 5.0  # what a router not heard from this long said it holds may not come back
CONTENDED_S = 3.0  # routers keep nothing ahead of a limit another waits on, this long
TELL_S = 60.0  # a limit's contention is logged once in this long at most
DAY = 86400
KINDS = ("rpm", "tpm", "in_flight", *BUDGETS)
SCOPES = ("tenant", "key")
MAX_ITEMS = 10_000  # asks plus backs in one exchange


class LeaseRefused(ValueError):
    """An exchange that is not well formed, in words for its 400."""


class _Pot(msgspec.Struct, kw_only=True):
    """What one limit of one owner has granted: units by grant id (the second, or the
    period's start), or slots by router (in flight)."""

    grants: dict[int, int] = {}
    slots: dict[str, int] = {}


class _Saved(msgspec.Struct, kw_only=True):
    version: int = 1
    pots: dict[str, _Pot] = {}
    seen: dict[str, float] = {}  # router id: wall time last heard from


def period_start(kind: str, wall: float) -> int:
    """The start of the calendar day or month (UTC) ``wall`` is in."""
    if kind == "budget_day":
        return int(wall // DAY * DAY)
    t = time.gmtime(wall)
    return calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))


def period_end(kind: str, wall: float) -> int:
    if kind == "budget_day":
        return period_start(kind, wall) + DAY
    t = time.gmtime(wall)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0))


def check(ex: LeaseExchange) -> None:
    """Raises LeaseRefused when an exchange is not well formed."""
    if not ex.router or len(ex.router) > 64:
        raise LeaseRefused("router must be an id of 1 to 64 characters")
    if len(ex.asks) + len(ex.backs) + len(ex.holds) > MAX_ITEMS:
        raise LeaseRefused(f"at most {MAX_ITEMS:,} asks, backs and holds in one exchange")
    items: list[LeaseAsk | LeaseBack | LeaseHold] = [*ex.asks, *ex.backs, *ex.holds]
    for item in items:
        if item.scope not in SCOPES or item.kind not in KINDS:
            raise LeaseRefused(
                f"scope must be one of {', '.join(SCOPES)} and kind one of {', '.join(KINDS)}"
            )
        if item.units < 0:
            raise LeaseRefused("units must be at least 0")
        if not item.owner or "/" in item.owner or len(item.owner) > 64:
            raise LeaseRefused("owner must be a tenant's or key's name")
    if any(a.needed < 0 or a.needed > a.units for a in ex.asks):
        raise LeaseRefused("needed must be between 0 and units")


@attrs.define
class LeaseStats:
    """What the bank did since it started, for the metrics."""

    exchanges: int = 0
    granted: dict[str, int] = attrs.Factory(dict)  # units, by kind of limit
    denied: dict[tuple[str, str], int] = attrs.Factory(dict)  # (kind, why)


class LeaseBank:
    """Every limit's grants, against the limits as ``limits`` says them now
    (``(scope, owner)``: its ``Limits``, or None for an owner unknown)."""

    def __init__(
        self, limits: Callable[[str, str], Limits | None], path: Path | None = None
    ) -> None:
        self.limits = limits
        self.path = path
        self._pots: dict[str, _Pot] = {}
        self._seen: dict[str, float] = {}
        # what each router said it holds unspent, and its requests in flight reserved,
        # by limit; and limits another waits on
        self._unspent: dict[str, dict[str, int]] = {}
        self._reserved: dict[str, dict[str, int]] = {}
        self._contended: dict[str, float] = {}  # until (wall)
        self._told: dict[str, float] = {}  # when each limit's contention was logged
        self.stats = LeaseStats()
        self._changes = 0  # grows with every change: what a save covers
        self._saved = 0
        self._file = (
            None
            if path is None
            else KeptFile(
                path,
                "tenants' leases",
                "what was granted is kept in memory (a restart now would forget it) and "
                "saved when it can be",
                log,
            )
        )
        self._lock = trio.Lock()
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            saved = msgspec.json.decode(path.read_bytes(), type=_Saved)
        except FileNotFoundError:
            return
        except (OSError, msgspec.DecodeError) as exc:
            log.error(
                "tenants' leases in %s cannot be read (%s): what routers hold now is not "
                "counted until it comes back; move the file aside to silence this",
                path,
                exc,
            )
            return
        self._pots, self._seen = dict(saved.pots), dict(saved.seen)

    def used(self, scope: str, owner: str, kind: str, wall: float) -> int:
        """What the limit counts now: granted and not given back."""
        pot = self._pots.get(f"{scope}/{owner}/{kind}")
        if pot is None:
            return 0
        if kind == "in_flight":
            return sum(pot.slots.values())
        if kind in BUDGETS:
            return pot.grants.get(period_start(kind, wall), 0)
        return sum(n for at, n in pot.grants.items() if at > wall - COUNTED_S)

    def exchange(self, ex: LeaseExchange, wall: float) -> LeaseAnswer:
        """Take back what ``ex`` gives back, then grant what it asks where the limit
        has room (denied where a waiting request's need does not fit).

        Raises:
            LeaseRefused: the exchange is not well formed; nothing changed.
        """
        check(ex)
        self.stats.exchanges += 1
        self._seen[ex.router] = wall
        self._forget(wall)
        for said in (*self._unspent.values(), *self._reserved.values()):
            said.pop(ex.router, None)
        for hold in ex.holds:
            key = f"{hold.scope}/{hold.owner}/{hold.kind}"
            self._unspent.setdefault(key, {})[ex.router] = hold.units
            if hold.reserved:
                self._reserved.setdefault(key, {})[ex.router] = hold.reserved
        for back in ex.backs:
            pot = self._pots.get(f"{back.scope}/{back.owner}/{back.kind}")
            if pot is None or back.units == 0:
                continue
            if back.kind == "in_flight":
                held = pot.slots.get(ex.router, 0)
                pot.slots[ex.router] = max(0, held - back.units)
            elif back.grant in pot.grants:
                pot.grants[back.grant] = max(0, pot.grants[back.grant] - back.units)
            self._changes += 1
        grants: list[LeaseGrant] = []
        denied: list[LeaseDenied] = []
        for ask in ex.asks:
            limits = self.limits(ask.scope, ask.owner)
            limit = None if limits is None else getattr(limits, ask.kind)
            if limit is None:  # no such limit (any more): nothing to count
                grants.append(
                    LeaseGrant(
                        scope=ask.scope,
                        owner=ask.owner,
                        kind=ask.kind,
                        units=ask.units,
                        grant=0,
                        ttl_s=LEASE_S,
                        left=ask.units,
                    )
                )
                continue
            key = f"{ask.scope}/{ask.owner}/{ask.kind}"
            free = limit - self.used(ask.scope, ask.owner, ask.kind, wall)
            if ask.needed and free < ask.needed:
                others = self._may_come_back(key, ex.router, wall)
                final = free + others < ask.needed
                if not final:  # held unspent elsewhere: they give it back
                    self._contend(key, limit, others, wall)
                why = "limit" if final else "held_elsewhere"
                self.stats.denied[ask.kind, why] = self.stats.denied.get((ask.kind, why), 0) + 1
                denied.append(
                    LeaseDenied(
                        scope=ask.scope,
                        owner=ask.owner,
                        kind=ask.kind,
                        limit=limit,
                        retry_after_s=(
                            self._retry_after(ask.scope, ask.owner, ask.kind, wall)
                            if final
                            else 1.0
                        ),
                        final=final,
                    )
                )
                continue
            units = min(ask.units, max(ask.needed, free // 2), free)
            if units <= 0:
                continue
            pot = self._pots.setdefault(key, _Pot(grants={}, slots={}))
            if ask.kind == "in_flight":
                pot.slots[ex.router] = pot.slots.get(ex.router, 0) + units
                grant, ttl = 0, 0.0
            elif ask.kind in BUDGETS:
                grant = period_start(ask.kind, wall)
                ttl = period_end(ask.kind, wall) - wall
            else:
                grant, ttl = int(wall), LEASE_S
            if ask.kind != "in_flight":
                pot.grants[grant] = pot.grants.get(grant, 0) + units
                # what it may hold unspent now: at most what it said, and this grant
                maybe = self._unspent.setdefault(key, {})
                maybe[ex.router] = maybe.get(ex.router, 0) + units
            self._changes += 1
            self.stats.granted[ask.kind] = self.stats.granted.get(ask.kind, 0) + units
            grants.append(
                LeaseGrant(
                    scope=ask.scope,
                    owner=ask.owner,
                    kind=ask.kind,
                    units=units,
                    grant=grant,
                    ttl_s=ttl,
                    left=free - units,
                )
            )
        contended = [
            LeaseHold(scope=scope, owner=owner, kind=kind)
            for key, until in self._contended.items()
            if until > wall
            for scope, owner, kind in [key.split("/")]
        ]
        return LeaseAnswer(grants=grants, denied=denied, contended=contended)

    def _may_come_back(self, key: str, router: str, wall: float) -> int:
        """What routers heard from lately hold of a limit and may give back: the others'
        unspent, and for a budget what requests in flight reserved at any (``router``'s
        own come back to it)."""
        live = {r for r, at in self._seen.items() if at > wall - HELD_S}
        unspent = self._unspent.get(key, {})
        back = sum(n for r, n in unspent.items() if r != router and r in live)
        if key.rsplit("/", 1)[1] in BUDGETS:
            back += sum(n for r, n in self._reserved.get(key, {}).items() if r in live)
        return back

    def _contend(self, key: str, limit: int, others: int, wall: float) -> None:
        """A request waits on a limit that other routers hold unspent: they are told to
        give it back (for ``CONTENDED_S``), and the operator once a minute at most."""
        if self._contended.get(key, 0.0) <= wall and self._told.get(key, 0.0) <= wall - TELL_S:
            self._told[key] = wall
            scope, owner, kind = key.split("/")
            log.info(
                "%s %r: its %s limit (%d) is contended: a request waits while other routers "
                "hold %d of it unspent or reserved by requests in flight; they give back what "
                "they do not use within a second (routers that share a tenant's traffic "
                "unevenly, or a budget nearly spent, do this; see `llmgw ctl tenant show %s`)",
                scope,
                owner,
                kind,
                limit,
                others,
                owner,
            )
        self._contended[key] = wall + CONTENDED_S

    def contended(self, wall: float) -> int:
        """How many limits are contended now."""
        return sum(1 for until in self._contended.values() if until > wall)

    def routers(self) -> int:
        """How many routers exchanged leases lately (within ``GONE_S``)."""
        return len(self._seen)

    def _retry_after(self, scope: str, owner: str, kind: str, wall: float) -> float:
        """Seconds until the limit may have room again: the oldest per-minute grant
        leaves the count, the period ends, or (in flight) a moment."""
        if kind == "in_flight":
            return 1.0
        if kind in BUDGETS:
            return period_end(kind, wall) - wall
        pot = self._pots.get(f"{scope}/{owner}/{kind}")
        live = sorted(at for at, n in (pot.grants.items() if pot else ()) if n)
        live = [at for at in live if at > wall - COUNTED_S]
        return max(live[0] + COUNTED_S - wall, 1.0) if live else 1.0

    def _forget(self, wall: float) -> None:
        """Routers gone hold no slots; grants no longer counted are dropped."""
        for router in [r for r, at in self._seen.items() if at < wall - GONE_S]:
            del self._seen[router]
            for pot in self._pots.values():
                if pot.slots.pop(router, 0):
                    self._changes += 1
            for said in (*self._unspent.values(), *self._reserved.values()):
                said.pop(router, None)
        self._contended = {k: t for k, t in self._contended.items() if t > wall}
        self._told = {k: t for k, t in self._told.items() if t > wall - TELL_S}
        self._unspent = {k: held for k, held in self._unspent.items() if held}
        self._reserved = {k: held for k, held in self._reserved.items() if held}
        for key, pot in list(self._pots.items()):
            kind = key.rsplit("/", 1)[1]
            oldest = period_start(kind, wall) if kind in BUDGETS else wall - COUNTED_S
            for at in [at for at in pot.grants if at < oldest]:
                del pot.grants[at]
            pot.slots = {r: n for r, n in pot.slots.items() if n}
            if not pot.grants and not pot.slots:
                del self._pots[key]

    async def serve(self, ex: LeaseExchange, wall: float) -> LeaseAnswer:
        """``exchange``, its grants saved before the answer leaves.

        Raises:
            LeaseRefused: the exchange is not well formed; nothing changed.
        """
        answer = self.exchange(ex, wall)
        if self.path is not None and self._changes != self._saved:
            wanted = self._changes
            async with self._lock:  # one write at a time; a write covers every change before it
                if self._saved < wanted:
                    upto = self._changes
                    data = msgspec.json.encode(_Saved(pots=self._pots, seen=self._seen))
                    if await trio.to_thread.run_sync(self._write, data):
                        self._saved = upto
        return answer

    def _write(self, data: bytes) -> bool:
        assert self._file is not None
        return self._file.save(data)

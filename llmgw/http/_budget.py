"""Request body bytes held at once, all connections together, shared fairly.

Theory of operation
===================
Every byte of a request body the server keeps is charged to one
``BodyBudget`` (``max_bodies_bytes``) from the moment it is read until the
request's response is written or its connection ends. Each body has two
holders: the client IP address it came from and, when its head proved who
sent it (an API key, a token: ``Request.principal``), that principal. A
holder's fair share is the budget divided by the holders of its kind that hold
bytes now, the one asking included.

While the budget has room, any body takes it. Once it is full, a body whose
holders both stay within their fair share with the bytes it asks for takes
room from bodies still arriving whose holder is over its share: the holder
most over first, its largest body first, until enough is free. Those bodies
are dropped (their connections answer 503 and close). A body that cannot find
room so is refused (503). So one key or one address, however many connections
it opens, can hold the whole budget only while nobody else wants any of it,
and whoever wants a share gets it back from whoever holds more than theirs.

Bodies already complete (their request is being handled) are never dropped:
what they hold goes back when their response is written.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable


class Holding:
    """One request body's bytes in the budget, and who holds them."""

    __slots__ = ("address", "dropped", "held", "on_drop", "principal", "reading")

    def __init__(self, principal: str, address: str, on_drop: Callable[[], None]) -> None:
        self.principal = principal  # "" when the head proved nobody
        self.address = address
        self.on_drop = on_drop  # told when the budget takes the bytes back for another body
        self.held = 0
        self.reading = True  # still arriving: the only bodies that may be dropped
        self.dropped = False


class BodyBudget:
    """Request body bytes held now by one server's connections (see the module docstring)."""

    __slots__ = ("_by_address", "_by_principal", "_reading", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._by_principal: dict[str, int] = {}
        self._by_address: dict[str, int] = {}
        self._reading: set[Holding] = set()

    def hold(self, principal: str, address: str, on_drop: Callable[[], None]) -> Holding:
        """A body about to arrive; charge its bytes with ``charge``."""
        holding = Holding(principal, address, on_drop)
        self._reading.add(holding)
        return holding

    def held_by(self, *, principal: str = "", address: str = "") -> int:
        """Bytes held now by a principal, or by an address."""
        if principal:
            return self._by_principal.get(principal, 0)
        return self._by_address.get(address, 0)

    def charge(self, holding: Holding, n: int) -> bool:
        """Take ``n`` more bytes for ``holding``, dropping bodies over their share if
        the budget is full and this one is within its own. False: refused."""
        if holding.dropped:
            return False
        if self.used + n > self.limit:
            victims = self._room_for(holding, n)
            if victims is None:
                return False
            for victim in victims:
                self._drop(victim)
        self._add(holding, n)
        return True

    def done_reading(self, holding: Holding) -> None:
        """The body is complete: it is no longer one that may be dropped."""
        holding.reading = False
        self._reading.discard(holding)

    def release(self, holding: Holding) -> None:
        """Give every byte of ``holding`` back (its response is written, or it is over)."""
        self._reading.discard(holding)
        holding.reading = False
        if holding.held:
            self._add(holding, -holding.held)

    def _add(self, holding: Holding, n: int) -> None:
        holding.held += n
        self.used += n
        if holding.principal:
            _count(self._by_principal, holding.principal, n)
        _count(self._by_address, holding.address, n)

    def _drop(self, victim: Holding) -> None:
        self.release(victim)
        victim.dropped = True
        victim.on_drop()

    def _room_for(self, asking: Holding, n: int) -> list[Holding] | None:
        """The bodies to drop so that ``asking`` gets ``n`` bytes; None: it may not."""
        principals = len(self._by_principal) + (
            1 if asking.principal and asking.principal not in self._by_principal else 0
        )
        addresses = len(self._by_address) + (0 if asking.address in self._by_address else 1)
        principal_share = self.limit / max(1, principals)
        address_share = self.limit / addresses
        if asking.principal and self.held_by(principal=asking.principal) + n > principal_share:
            return None
        if self._by_address.get(asking.address, 0) + n > address_share:
            return None

        def over(h: Holding) -> float:
            by_address = self._by_address.get(h.address, 0) / address_share
            if not h.principal:
                return by_address
            return max(by_address, self._by_principal.get(h.principal, 0) / principal_share)

        ranked = sorted(
            ((over(h), h.held, h) for h in self._reading if h is not asking and h.held),
            key=lambda t: (t[0], t[1]),
            reverse=True,
        )
        need = self.used + n - self.limit
        victims: list[Holding] = []
        for excess, held, h in ranked:
            if excess <= 1.0:
                break  # within its share: never dropped for another
            victims.append(h)
            need -= held
            if need <= 0:
                return victims
        return None


def _count(counts: dict[str, int], holder: str, n: int) -> None:
    left = counts.get(holder, 0) + n
    if left > 0:
        counts[holder] = left
    else:
        counts.pop(holder, None)

"""Deadlines for many socket waits, kept by one timer task instead of a cancel scope each.

A trio cancel scope with a deadline (enter, exit, two context managers, the
run's deadline heap) costs more than the rest of a wait for a socket: about a
sixth of the router's CPU per paced chunk, and a quarter per proxied request
(``tools/bench_router.py``). Both the upstream pool (every send, head and
body wait) and the server (the wait for the next request on a kept-alive
connection) wait on sockets all the time and time out almost never, so they
share this instead:

- a wait writes its deadline on its waiter and joins ``waiting``;
- one system task wakes every ``period`` while anything waits, marks the
  waiters past due ``expired`` and calls ``on_expire`` for each, which must
  end the wait the documented way: ``trio.lowlevel.notify_closing`` on the
  socket, which is then closed;
- the woken wait returns, and the caller reads ``expired``.

So a wait ends between its deadline and one ``period`` later; owners pick
``period`` as a quarter of their shortest timeout (at most 1 s). The timer
task is spawned on first use and parks while nothing waits.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import trio


class Waiter(Protocol):
    """What a wait is made on: the socket, and two fields this module writes."""

    sock: socket.socket
    deadline: float
    expired: bool


W = TypeVar("W", bound=Waiter)


class SocketDeadlines(Generic[W]):
    def __init__(self, period: float, on_expire: Callable[[W], None]) -> None:
        self.period = period
        self.on_expire = on_expire
        self.waiting: set[W] = set()
        self.closed = False
        self._task: trio.lowlevel.Task | None = None
        self._parked = False

    async def wait(self, waiter: W, readable: bool, deadline: float) -> None:
        """Wait until ``waiter.sock`` can be read (or written), or until ``deadline``
        has passed (``waiter.expired`` is then True, and the socket is being closed)
        or someone else notified its closing. The caller tells these apart."""
        waiter.deadline = deadline
        waiting = self.waiting
        waiting.add(waiter)
        if self._task is None:
            self._task = trio.lowlevel.spawn_system_task(self._run, name="llmgw socket deadlines")
        elif self._parked:
            self._wake()
        try:
            if readable:
                await trio.lowlevel.wait_readable(waiter.sock)
            else:
                await trio.lowlevel.wait_writable(waiter.sock)
        except trio.ClosedResourceError:
            pass
        finally:
            waiting.discard(waiter)

    def expire(self, waiter: W) -> None:
        """End ``waiter``'s wait now, as if its deadline had passed."""
        self.waiting.discard(waiter)
        waiter.expired = True
        self.on_expire(waiter)

    def expire_all(self) -> None:
        for waiter in list(self.waiting):
            self.expire(waiter)

    def close(self) -> None:
        """Let the timer task end (it does once nothing waits)."""
        self.closed = True
        if self._parked:
            self._wake()

    def _wake(self) -> None:
        assert self._task is not None
        self._parked = False
        trio.lowlevel.reschedule(self._task)

    def _unpark(self, _: Any) -> trio.lowlevel.Abort:
        self._parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    async def _run(self) -> None:
        """Every `period` while waits are pending: expire those past due."""
        try:
            while not self.closed:
                if not self.waiting:
                    self._parked = True
                    await trio.lowlevel.wait_task_rescheduled(self._unpark)
                    continue
                await trio.sleep(self.period)
                now = trio.current_time()
                for waiter in [w for w in self.waiting if w.deadline <= now]:
                    self.expire(waiter)
        finally:
            self._task = None

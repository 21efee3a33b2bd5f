"""A router's exchanges with the control plane about its tenants' leases.

Theory of operation
-------------------
``Quotas`` (``router.quota``) spends leases and says what to ask and give
back; ``LeaseClient`` carries that to the control plane and the answer home,
one exchange at a time (``send``: a ``POST routing.LEASE_PATH`` for a
standalone router, a call for the one inside ``llmgw server``):

- at once when a request waits on a limit this router holds too little of
  (``fill``); every request waiting meanwhile rides on the same exchange;
- every ``EVERY_S`` while it holds anything, to ask ahead of need, give back
  what it did not spend, and be heard from: what it holds unspent and what its
  requests in flight reserved (the control plane waits for those to come back
  before it refuses a request for good, and stops counting on them, and frees
  the slots, of a router it has not heard from for a while);
- when it stops: everything it holds, given back (``close``).

A request waits at most ``WAIT_S`` in all. An exchange that fails (the control
plane away, or refusing) leaves the waiting request a 429 that says so: a
router never spends what it was not granted.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import trio

from llmgw.router.quota import Quotas, Short
from llmgw.routing import LEASE_PATH, LeaseAnswer, LeaseExchange

log = logging.getLogger("llmgw.router")

EVERY_S = 1.0  # exchanges while anything is held
WAIT_S = 5.0  # the longest a request waits on exchanges
SEND_S = 4.0  # the longest one exchange may take
GIVE_BACK_S = 0.5  # a router stopping gives back what it holds, if it can this soon
RETRY_S = 0.25  # a need denied while other routers give it back: asked again this soon

Send = Callable[[LeaseExchange], Awaitable[LeaseAnswer]]


class Unreachable(Exception):
    """The control plane did not take an exchange, in words for the 429."""


class LeaseClient:
    def __init__(self, quotas: Quotas, send: Send, router: str) -> None:
        self.quotas = quotas
        self.send = send
        self.router = router
        self._kick = trio.Event()
        self._done = trio.Event()  # set when an exchange ends, then replaced
        self.failure = ""  # why the last exchange failed ("" when it went through)

    async def fill(self, short: Short, deadline: float) -> str:
        """Wait for an exchange that asks what ``short`` needs: "" when one went
        through (judge the request again), else why none did."""
        self.quotas.wait(short, 1)
        try:
            done = self._done
            self._kick.set()
            with trio.move_on_at(min(deadline, trio.current_time() + SEND_S + 1)):
                await done.wait()
                return self.failure
            return "the control plane did not answer in time"
        finally:
            self.quotas.wait(short, -1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                with trio.move_on_after(EVERY_S):
                    await self._kick.wait()
                self._kick = trio.Event()
                if self.quotas.holding():
                    await self._exchange(self.quotas.exchange_out(self.router, trio.current_time()))
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(GIVE_BACK_S):
                await self._exchange(self.quotas.everything_back(self.router, trio.current_time()))

    async def _exchange(self, ex: LeaseExchange) -> None:
        if not ex.asks and not ex.backs and not ex.holds:
            return self._end("")
        sent = trio.current_time()
        try:
            with trio.fail_after(SEND_S):
                answer = await self.send(ex)
        except (Unreachable, trio.TooSlowError) as exc:
            self.quotas.unsent(ex)
            why = str(exc) or "the control plane did not answer in time"
            if why != self.failure:
                log.warning("tenants' leases: %s; requests past what this router holds wait", why)
            return self._end(why)
        if self.failure:
            log.info("tenants' leases: the control plane answers again")
        if self.quotas.exchange_in(answer, sent):
            self._kick.set()  # another router waits on what this one holds: give it back
        self._end("")

    def _end(self, failure: str) -> None:
        self.failure = failure
        done, self._done = self._done, trio.Event()
        done.set()


def http_send(admin_url: str, token: str, client: httpx.AsyncClient) -> Send:
    """Exchanges posted to the control plane's admin API."""
    url = admin_url.rstrip("/") + LEASE_PATH
    headers = {"authorization": f"Bearer {token}"}

    async def send(ex: LeaseExchange) -> LeaseAnswer:
        try:
            r = await client.post(url, content=msgspec.json.encode(ex), headers=headers)
        except httpx.HTTPError as exc:
            raise Unreachable(f"the control plane cannot be reached ({exc})") from None
        if r.status_code != 200:
            raise Unreachable(f"the control plane refused the exchange: {r.text[:200]}")
        try:
            return msgspec.json.decode(r.content, type=LeaseAnswer)
        except msgspec.DecodeError as exc:
            raise Unreachable(f"the control plane's answer is not a lease answer: {exc}") from None

    return send

"""Probes of engines learned from reports: is the engine there the one reported?

An engine the control plane did not start itself (adopted after a restart,
or reported by a node) is routed only once the engine at its address answers
as its report says (``claims`` decides; this does the HTTP):

1. ``GET /v1/models`` without a key: 401 (or 403), when the report gave a key
   (every engine llmgw starts wants one; an older agent's may not);
2. the same with ``Authorization: Bearer <reported key>``: 200, and among the
   models it lists, the reported one (its catalog name or ``served_model_name``).

llama-server and vLLM both answer ``/v1/models`` behind their key. Each
request is bounded (``PROBE_TIMEOUT_S``) and so is what is read of an answer;
a failed probe is tried again after 1, 2, 4, 8 and then every 15 s, and
probes run a few at a time, so a fleet adopted after a restart is checked in
moments and a node that answers slowly holds up nobody else's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import httpx
import msgspec
import trio

from llmgw.controlplane.claims import Claim
from llmgw.controlplane.nodes import Node
from llmgw.controlplane.routing import engine_url

PROBE_TIMEOUT_S = 3.0
MAX_BODY = 1 << 16  # what is read of /v1/models' answer
RETRY_S = (1.0, 2.0, 4.0, 8.0, 15.0)
CONCURRENCY = 64  # a fleet adopted after a restart is checked in moments
WAKE_S = 1.0  # looked for new claims at least this often


class _Model(msgspec.Struct):
    id: str = ""


class _Models(msgspec.Struct):
    data: list[_Model] = []


_models = msgspec.json.Decoder(_Models)


def url_of(claim: Claim, nodes: Mapping[str, Node]) -> str | None:
    """Where the claimed engine answers, as routers would reach it; None: its node is
    not known (any more)."""
    node = nodes.get(claim.node_id)
    if node is None:
        return None
    return engine_url(node, claim.host, claim.port)


async def probe(client: httpx.AsyncClient, url: str, claim: Claim) -> str:
    """'' when the engine at ``url`` is what ``claim`` says; else why not, in words."""
    models = f"{url}/v1/models"
    try:
        with trio.fail_after(PROBE_TIMEOUT_S):
            if claim.engine_key:
                status, _ = await _get(client, models, {})
                if status not in (401, 403):
                    return f"answers {status} without the key its node reported (wants none)"
            auth = {"authorization": f"Bearer {claim.engine_key}"} if claim.engine_key else {}
            status, body = await _get(client, models, auth)
    except trio.TooSlowError:
        return f"did not answer GET /v1/models within {PROBE_TIMEOUT_S:g} s"
    except httpx.HTTPError as exc:
        return f"could not be asked for its models ({type(exc).__name__}: {exc or 'no answer'})"
    if status in (401, 403):
        return f"refuses the key its node reported ({status})"
    if status != 200:
        return f"answers {status} to GET /v1/models"
    try:
        served = {m.id for m in _models.decode(body).data}
    except msgspec.DecodeError:
        return "answers GET /v1/models with something that is not a list of models"
    if not served & claim.names:
        listed = ", ".join(sorted(served)[:3]) or "none"
        return f"serves {listed}, not {claim.model}"
    return ""


async def _get(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    async with client.stream("GET", url, headers=headers) as r:
        body = b""
        async for chunk in r.aiter_bytes():
            body += chunk
            if len(body) > MAX_BODY:
                break
        return r.status_code, body[:MAX_BODY]


@attrs.define
class _Tries:
    failures: int = 0
    next_at: float = 0.0


class Prober:
    """Probes the claims ``claims()`` lists, a few at a time, and hands each answer to
    ``done``; ``wake()`` has it look at once (a registration adopted something)."""

    def __init__(
        self,
        claims: Callable[[], list[tuple[Claim, str]]],
        done: Callable[[Claim, str], None],
    ) -> None:
        self._claims = claims
        self._done = done
        self._wake = trio.Event()
        self._in_flight: set[Claim] = set()
        self._tries: dict[Claim, _Tries] = {}

    def wake(self) -> None:
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        limiter = trio.CapacityLimiter(CONCURRENCY)
        async with (
            httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as client,
            trio.open_nursery() as nursery,
        ):
            task_status.started()
            while True:
                now = trio.current_time()
                wanted = self._claims()
                keep = {c for c, _ in wanted}
                for gone in [c for c in self._tries if c not in keep]:
                    del self._tries[gone]
                for claim, url in wanted:
                    tries = self._tries.get(claim)
                    if claim in self._in_flight or (tries is not None and tries.next_at > now):
                        continue
                    self._in_flight.add(claim)
                    nursery.start_soon(self._one, client, limiter, claim, url)
                with trio.move_on_after(WAKE_S):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _one(
        self, client: httpx.AsyncClient, limiter: trio.CapacityLimiter, claim: Claim, url: str
    ) -> None:
        try:
            async with limiter:
                why = await probe(client, url, claim)
        finally:
            self._in_flight.discard(claim)
        if why:
            tries = self._tries.setdefault(claim, _Tries())
            tries.next_at = trio.current_time() + RETRY_S[min(tries.failures, len(RETRY_S) - 1)]
            tries.failures += 1
        else:
            self._tries.pop(claim, None)
        self._done(claim, why)

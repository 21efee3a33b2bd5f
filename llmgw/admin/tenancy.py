"""The management API's tenants and keys: ``/v1/tenants`` and ``/v1/keys``.

Each change goes to the store (``llmgw.controlplane.tenants``), which saves it
before it takes effect, and then to every router with the routing snapshot
(``published``): a key made here works, and one revoked stops working, at
every router as soon as its routing watch wakes (well within a second).

    GET    /v1/tenants               every tenant, with its keys
    POST   /v1/tenants               {"name", "models"?, "limits"?, "weight"?}
    GET    /v1/tenants/{name}
    PATCH  /v1/tenants/{name}        {"models"?, "limits"?: {"rpm": 60, "in_flight": null},
                                      "weight"?}
                                     (a limit named is set, null clears it; others stay)
    DELETE /v1/tenants/{name}        its keys are revoked with it
    GET    /v1/keys[?tenant=T]
    POST   /v1/keys                  {"tenant", "name"?, "models"?, "expires_in_s"?,
                                      "limits"?}: the key, shown this once
    DELETE /v1/keys/{name}           revoked
    GET    /v1/usage[?tenant=T][&since=UNIX]
                                     what tenants used, per model (default: the
                                     last 24 h); routers' reports feed it
    POST   /v1/leases                a router's ``LeaseExchange``: what it asks of
                                     tenants' limits and gives back
                                     (``llmgw.controlplane.leases``)
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

import msgspec

from llmgw.admin.answers import error, json_body, json_response
from llmgw.admin.views import (
    KeyCreated,
    KeyList,
    TenancyAnswer,
    TenantList,
    TenantView,
    UsageList,
    key_view,
    tenant_view,
)
from llmgw.controlplane.leases import LeaseBank, LeaseRefused
from llmgw.controlplane.tenants import TenantError, TenantStore
from llmgw.controlplane.usage import DAY, UsageLedger
from llmgw.http import Request, Response
from llmgw.routing import LEASE_PATH, LeaseExchange, Limits

Handler = Callable[[Request], Awaitable[Response]]
ArgHandler = Callable[[Request, str], Awaitable[Response]]


class _TenantBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    models: list[str] = []
    limits: Limits = msgspec.field(default_factory=Limits)
    weight: float = 1.0


class _TenantPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    models: list[str] | None = None
    limits: dict[str, int | None] | None = None
    weight: float | None = None


class _KeyBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tenant: str
    name: str = ""
    models: list[str] = []
    expires_in_s: float | None = None
    limits: Limits | None = None


class TenancyApi:
    """The handlers; ``changed`` is called after every change the store saved."""

    def __init__(
        self,
        store: TenantStore,
        changed: Callable[[], object],
        ledger: UsageLedger | None = None,
        bank: LeaseBank | None = None,
    ) -> None:
        """``ledger``: what tenants used, fleet-wide (the in-process router's counts
        read before each answer); ``bank``: the routers' leases of their limits."""
        self.store = store
        self.changed = changed
        self.ledger = ledger or UsageLedger(None)
        self.bank = bank or LeaseBank(store.limits)

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("GET", "/v1/tenants"): self.list_tenants,
            ("POST", "/v1/tenants"): self.create_tenant,
            ("GET", "/v1/keys"): self.list_keys,
            ("POST", "/v1/keys"): self.create_key,
            ("GET", "/v1/usage"): self.usage,
            ("POST", LEASE_PATH): self.leases,
        }

    def patterns(self) -> list[tuple[str, tuple[str | None, ...], ArgHandler]]:
        return [
            ("GET", ("v1", "tenants", None), self.show_tenant),
            ("PATCH", ("v1", "tenants", None), self.set_tenant),
            ("DELETE", ("v1", "tenants", None), self.delete_tenant),
            ("DELETE", ("v1", "keys", None), self.revoke_key),
        ]

    async def leases(self, request: Request) -> Response:
        ex = json_body(request, LeaseExchange, "a router's lease exchange, as JSON")
        if isinstance(ex, Response):
            return ex
        try:
            return json_response(200, await self.bank.serve(ex, time.time()))
        except LeaseRefused as exc:
            return error(400, str(exc))

    def _view(self, name: str) -> TenantView:
        wall = time.time()
        tenant = self.store.tenant(name)
        view = tenant_view(tenant, self.store.keys(name), wall)
        limits = tenant.limits
        view.counted = {
            kind: self.bank.used("tenant", name, kind, wall)
            for kind in limits.__struct_fields__
            if getattr(limits, kind) is not None
        }
        return view

    async def list_tenants(self, request: Request) -> Response:
        wall = time.time()
        views = [tenant_view(t, self.store.keys(t.name), wall) for t in self.store.tenants()]
        return json_response(200, TenantList(tenants=views))

    async def show_tenant(self, request: Request, name: str) -> Response:
        try:
            return json_response(200, self._view(name))
        except TenantError as exc:
            return error(exc.status, str(exc))

    async def create_tenant(self, request: Request) -> Response:
        body = json_body(request, _TenantBody, 'JSON like {"name": "acme", "limits": {"rpm": 60}}')
        if isinstance(body, Response):
            return body
        try:
            self.store.create_tenant(body.name, body.models, body.limits, body.weight)
        except TenantError as exc:
            return error(exc.status, str(exc))
        self.changed()
        return json_response(200, self._view(body.name))

    async def set_tenant(self, request: Request, name: str) -> Response:
        body = json_body(request, _TenantPatch, 'JSON like {"limits": {"rpm": 120}}')
        if isinstance(body, Response):
            return body
        try:
            limits = None
            if body.limits is not None:
                unknown = sorted(set(body.limits) - set(Limits.__struct_fields__))
                if unknown:
                    known = ", ".join(Limits.__struct_fields__)
                    return error(400, f"no such limit: {', '.join(unknown)} (limits: {known})")
                limits = msgspec.structs.replace(self.store.tenant(name).limits, **body.limits)
            self.store.set_tenant(name, models=body.models, limits=limits, weight=body.weight)
        except TenantError as exc:
            return error(exc.status, str(exc))
        self.changed()
        return json_response(200, self._view(name))

    async def delete_tenant(self, request: Request, name: str) -> Response:
        try:
            gone = self.store.delete_tenant(name)
        except TenantError as exc:
            return error(exc.status, str(exc))
        self.changed()
        revoked = f", and its keys {', '.join(gone)} revoked" if gone else ""
        return json_response(200, TenancyAnswer(message=f"tenant {name} deleted{revoked}"))

    async def list_keys(self, request: Request) -> Response:
        tenant = parse_qs(request.query).get("tenant", [None])[0]
        wall = time.time()
        return json_response(
            200, KeyList(keys=[key_view(k, wall) for k in self.store.keys(tenant)])
        )

    async def create_key(self, request: Request) -> Response:
        body = json_body(request, _KeyBody, 'JSON like {"tenant": "acme"}')
        if isinstance(body, Response):
            return body
        expires = None
        if body.expires_in_s is not None:
            if not body.expires_in_s > 0:
                return error(400, "expires_in_s must be a positive number of seconds")
            expires = time.time() + body.expires_in_s
        try:
            key, secret = self.store.create_key(
                body.tenant, name=body.name, models=body.models, expires=expires, limits=body.limits
            )
        except TenantError as exc:
            return error(exc.status, str(exc))
        self.changed()
        return json_response(200, KeyCreated(key=secret, view=key_view(key, time.time())))

    async def revoke_key(self, request: Request, name: str) -> Response:
        try:
            key = self.store.revoke_key(name)
        except TenantError as exc:
            return error(exc.status, str(exc))
        self.changed()
        return json_response(
            200, TenancyAnswer(message=f"key {name} of tenant {key.tenant} revoked")
        )

    async def usage(self, request: Request) -> Response:
        params = parse_qs(request.query)
        wall = time.time()
        try:
            since = float(params.get("since", [wall - DAY])[0])
        except ValueError:
            since = math.nan
        if not math.isfinite(since):
            return error(400, "since must be a unix time (seconds)")
        self.ledger.refresh(wall)  # what the server's own router counted, as of now
        tenant = params.get("tenant", [None])[0]
        rows = self.ledger.rows(since, wall, tenant)
        return json_response(200, UsageList(since=since, rows=rows))

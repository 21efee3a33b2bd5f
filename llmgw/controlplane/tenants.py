"""Tenants and their API keys: who a key belongs to, what it may use, kept durably.

Theory of operation
-------------------
A tenant has keys, the models it may use (empty: every model) and limits
(``llmgw.routing.Limits``); a key may narrow its tenant's models and carry
tighter limits of its own, and may expire. Operators change them at run time
through the admin API (``ctl tenant ...``, ``ctl key ...``): no restart, no file
edit. A key is made here, shown once in the answer that made it, and only its
SHA-256 is kept.

The state lives in one file the control plane owns (``tenants.json`` in its
state directory). Every change is written whole (``files.write_atomic``: a
temporary file fsync-ed and renamed) before it takes effect: a change the API
confirmed survives a crash or a restart, and one that could not be written (a
full disk) is refused with the reason, the state as it was. A file that cannot
be read stops the server at start with a line that names it, rather than
starting with no tenants and refusing every tenant's key.

What routers are told (``published``): each key's hash with the models it may
use (its own within its tenant's), its expiry and limits, and each tenant's
limits; the routing snapshot carries them to every router (``RoutingPublisher
.set_tenancy``), in process and standalone, as soon as the change is saved.
"""

from __future__ import annotations

import errno
import logging
import re
import time
from pathlib import Path

import msgspec

from llmgw.files import write_atomic
from llmgw.routing import KEY_PREFIX, Limits, RouterKey, TenantRouting, hash_key, new_key

log = logging.getLogger("llmgw.tenants")

FILE = "tenants.json"
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
HINT = 12  # characters of a key kept to tell it apart ("llmgw-Ab3dEf"): not enough to use


class Tenant(msgspec.Struct, kw_only=True):
    name: str
    models: list[str] = []  # empty: every model
    limits: Limits = msgspec.field(default_factory=Limits)
    created: float = 0.0  # unix time
    weight: float = 1.0  # its turn in a full model's queue against others'


class Key(msgspec.Struct, kw_only=True):
    name: str
    tenant: str
    sha256: str
    hint: str  # the key's first characters, to tell it apart in a list
    models: list[str] = []  # empty: its tenant's
    expires: float | None = None  # unix time; None: never
    limits: Limits | None = None
    created: float = 0.0


class _State(msgspec.Struct, kw_only=True):
    version: int = 1
    tenants: list[Tenant] = []
    keys: list[Key] = []


class TenantError(Exception):
    """A change refused, in words an operator can act on; ``status`` for the API."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class TenantStore:
    """The tenants and keys, saved to ``path`` before any change takes effect."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[str, Key] = {}
        self._load()

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TenantError(f"the tenants file cannot be read: {exc.strerror}") from None
        try:
            state = msgspec.json.decode(data, type=_State)
        except msgspec.DecodeError as exc:
            raise TenantError(
                f"the tenants file is not valid ({exc}): restore it from a backup, or move "
                "it aside to start with no tenants"
            ) from None
        self._tenants = {t.name: t for t in state.tenants}
        self._keys = {k.name: k for k in state.keys}

    # ------------------------------------------------------------------- reading

    def tenants(self) -> list[Tenant]:
        return sorted(self._tenants.values(), key=lambda t: t.name)

    def tenant(self, name: str) -> Tenant:
        found = self._tenants.get(name)
        if found is None:
            raise TenantError(f"no tenant {name!r} (see llmgw ctl tenant list)", 404)
        return found

    def keys(self, tenant: str | None = None) -> list[Key]:
        return sorted(
            (k for k in self._keys.values() if tenant is None or k.tenant == tenant),
            key=lambda k: (k.tenant, k.name),
        )

    def limits(self, scope: str, owner: str) -> Limits | None:
        """A tenant's (``scope`` "tenant") or a key's own limits; None: no such owner,
        or a key with none of its own."""
        if scope == "tenant":
            tenant = self._tenants.get(owner)
            return None if tenant is None else tenant.limits
        key = self._keys.get(owner)
        return None if key is None else key.limits

    def published(self) -> tuple[list[RouterKey], list[TenantRouting]]:
        """What routers are told: every key (the models it may use, within its
        tenant's) and every tenant's limits."""
        keys = [
            RouterKey(
                name=k.name,
                sha256=k.sha256,
                models=allowed(self._tenants[k.tenant].models, k.models),
                tenant=k.tenant,
                expires=k.expires,
                limits=k.limits,
            )
            for k in self._keys.values()
            if k.tenant in self._tenants
        ]
        tenants = [
            TenantRouting(name=t.name, limits=t.limits, weight=t.weight)
            for t in self._tenants.values()
        ]
        return keys, tenants

    # ------------------------------------------------------------------- changing

    def create_tenant(
        self, name: str, models: list[str], limits: Limits, weight: float = 1.0
    ) -> Tenant:
        _check_name("tenant", name)
        if name in self._tenants:
            raise TenantError(f"tenant {name!r} exists already (llmgw ctl tenant set)", 409)
        _check_limits(limits)
        _check_weight(weight)
        tenant = Tenant(
            name=name,
            models=sorted(set(models)),
            limits=limits,
            created=time.time(),
            weight=weight,
        )
        self._save({**self._tenants, name: tenant}, self._keys)
        log.info("tenant %s created (%s)", name, describe(tenant.models, limits))
        return tenant

    def set_tenant(
        self,
        name: str,
        *,
        models: list[str] | None = None,
        limits: Limits | None = None,
        weight: float | None = None,
    ) -> Tenant:
        old = self.tenant(name)
        new = msgspec.structs.replace(old)
        if models is not None:
            new.models = sorted(set(models))
            narrowed = [
                k.name for k in self.keys(name) if k.models and not allowed(new.models, k.models)
            ]
            if narrowed:
                raise TenantError(
                    f"tenant {name!r}: keys {', '.join(narrowed)} would be left no model "
                    "(revoke them first, or keep a model they name)"
                )
        if limits is not None:
            _check_limits(limits)
            new.limits = limits
        if weight is not None:
            _check_weight(weight)
            new.weight = weight
        self._save({**self._tenants, name: new}, self._keys)
        log.info("tenant %s changed (%s)", name, describe(new.models, new.limits))
        return new

    def delete_tenant(self, name: str) -> list[str]:
        """Delete the tenant and revoke its keys; returns their names."""
        self.tenant(name)
        gone = [k.name for k in self.keys(name)]
        tenants = {n: t for n, t in self._tenants.items() if n != name}
        keys = {n: k for n, k in self._keys.items() if k.tenant != name}
        self._save(tenants, keys)
        log.info("tenant %s deleted, and its %d keys revoked", name, len(gone))
        return gone

    def create_key(
        self,
        tenant: str,
        *,
        name: str = "",
        models: list[str] | None = None,
        expires: float | None = None,
        limits: Limits | None = None,
    ) -> tuple[Key, str]:
        """A new key of ``tenant``: its record and the key itself (shown once, never kept)."""
        owner = self.tenant(tenant)
        secret = new_key()
        if not name:
            name = f"{tenant}-{secret[len(KEY_PREFIX) :][:6].lower()}"
        _check_name("key", name)
        if name in self._keys:
            raise TenantError(f"key {name!r} exists already (revoke it, or name another)", 409)
        wanted = sorted(set(models or []))
        if wanted and not allowed(owner.models, wanted):
            raise TenantError(
                f"key {name!r}: tenant {tenant!r} may use only {', '.join(owner.models)}, "
                f"none of {', '.join(wanted)}"
            )
        if expires is not None and expires <= time.time():
            raise TenantError(f"key {name!r}: its expiry is in the past")
        if limits is not None:
            _check_limits(limits)
        key = Key(
            name=name,
            tenant=tenant,
            sha256=hash_key(secret),
            hint=secret[:HINT],
            models=wanted,
            expires=expires,
            limits=limits,
            created=time.time(),
        )
        self._save(self._tenants, {**self._keys, name: key})
        log.info("key %s of tenant %s created", name, tenant)
        return key, secret

    def revoke_key(self, name: str) -> Key:
        key = self._keys.get(name)
        if key is None:
            raise TenantError(f"no key {name!r} (see llmgw ctl key list)", 404)
        self._save(self._tenants, {n: k for n, k in self._keys.items() if n != name})
        log.info("key %s of tenant %s revoked", name, key.tenant)
        return key

    def _save(self, tenants: dict[str, Tenant], keys: dict[str, Key]) -> None:
        """Write the new state whole, then hold it; unwritten, nothing changes."""
        state = _State(
            tenants=sorted(tenants.values(), key=lambda t: t.name),
            keys=sorted(keys.values(), key=lambda k: k.name),
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, msgspec.json.format(msgspec.json.encode(state)))
        except OSError as exc:
            hint = " (free space on its disk, then try again)" if exc.errno == errno.ENOSPC else ""
            raise TenantError(
                f"could not save the tenants file {self.path}: {exc.strerror}{hint}; "
                "nothing changed",
                507 if exc.errno == errno.ENOSPC else 500,
            ) from None
        self._tenants, self._keys = tenants, keys


def allowed(tenant: list[str], key: list[str]) -> list[str]:
    """The models a key may use: its own within its tenant's (empty: every model)."""
    if not tenant:
        return list(key)
    if not key:
        return list(tenant)
    return sorted(set(tenant) & set(key))


def _check_name(kind: str, name: str) -> None:
    if not NAME.fullmatch(name):
        raise TenantError(
            f"{kind} name {name!r}: use lowercase letters, digits, '.', '_' or '-' "
            "(at most 63, starting with a letter or digit)"
        )


def _check_limits(limits: Limits) -> None:
    for field in limits.__struct_fields__:
        value = getattr(limits, field)
        if value is not None and value < 1:
            raise TenantError(f"limit {field} must be at least 1 (leave it out for none)")


def _check_weight(weight: float) -> None:
    if not 0.01 <= weight <= 100:
        raise TenantError(f"weight {weight:g}: give a number from 0.01 to 100 (1: an equal turn)")


def describe(models: list[str], limits: Limits) -> str:
    """ "models a, b; rpm 60, in_flight 4" in a line."""
    said = [f"models {', '.join(models)}" if models else "every model"]
    set_ = [f"{f} {getattr(limits, f)}" for f in limits.__struct_fields__ if getattr(limits, f)]
    said.append(", ".join(set_) if set_ else "no limits")
    return "; ".join(said)

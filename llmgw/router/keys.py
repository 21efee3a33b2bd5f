"""API keys: stored hashed, each optionally limited to some models.

Keys are random and long, so a fast hash (SHA-256) is enough to keep them
out of config files; the key itself never appears in logs, only its name.

A ring is replaced in place (``replace``) when the config is read again:
whoever holds the ring checks the next request against the new keys. A
standalone router's ring also holds the keys of the control plane it follows
(``follow``: its config's ``[[router.keys]]``, as hashes in the routing
snapshot), so that a key added there and reloaded reaches every router; a
key in both is limited as the router's own file says.
"""

from __future__ import annotations

import hmac

import attrs

from llmgw.config.schema import RouterConfig
from llmgw.routing import KEY_PREFIX, Limits, RouterKey, hash_key, new_key

__all__ = ["KEY_PREFIX", "ApiKey", "KeyRing", "hash_key", "new_key"]


@attrs.frozen
class ApiKey:
    name: str
    sha256: str
    models: frozenset[str] = frozenset()  # empty: every model
    tenant: str = ""  # "": a key of a config file, no tenant's
    expires: float | None = None  # unix time; None: never
    limits: Limits | None = None  # its own, within its tenant's

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def expired(self, wall: float) -> bool:
        return self.expires is not None and wall >= self.expires


def api_keys(config: RouterConfig) -> list[ApiKey]:
    """The keys a ``[router]`` table lists."""
    return [ApiKey(k.name, k.sha256, frozenset(k.models)) for k in config.keys]


def published(keys: list[ApiKey]) -> list[RouterKey]:
    """A config's keys as the routing snapshot carries them (hashes, never keys)."""
    return [RouterKey(name=k.name, sha256=k.sha256, models=sorted(k.models)) for k in keys]


def followed(keys: list[RouterKey]) -> list[ApiKey]:
    """The control plane's keys (its config's and its tenants'), from its routing."""
    return [
        ApiKey(k.name, k.sha256, frozenset(k.models), k.tenant, k.expires, k.limits) for k in keys
    ]


class KeyRing:
    def __init__(self, keys: list[ApiKey], follows: list[ApiKey] | None = None) -> None:
        self._own = list(keys)
        self._follows = list(follows or [])
        self._by_hash: dict[str, ApiKey] = {}
        self._merge()

    def replace(self, keys: list[ApiKey]) -> str:
        """Check every request from now on against ``keys`` (and the control plane's,
        if it follows one); say what changed, by name: "3 keys (added a, removed b,
        changed c)"."""
        old, self._own = self._own, list(keys)
        self._merge()
        return changes(old, keys)

    def follow(self, keys: list[ApiKey]) -> str | None:
        """The control plane's keys, as its routing says now; what changed, or None
        when nothing did."""
        if sorted(keys, key=_order) == sorted(self._follows, key=_order):
            return None
        old, self._follows = self._follows, list(keys)
        self._merge()
        return changes(old, keys)

    def _merge(self) -> None:
        by_hash = {k.sha256: k for k in self._follows}
        by_hash.update({k.sha256: k for k in self._own})  # its own file says last
        self._by_hash = by_hash

    def __len__(self) -> int:
        return len(self._by_hash)

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key named by an ``Authorization: Bearer ...`` header, or None."""
        if not authorization:
            return None
        scheme, _, credential = authorization.partition(" ")
        if scheme.lower() != "bearer" or not credential:
            return None
        digest = hash_key(credential.strip())
        found = self._by_hash.get(digest)
        # the dict lookup already matched; compare again in constant time for form's sake
        if found is None or not hmac.compare_digest(found.sha256, digest):
            return None
        return found


def changes(old: list[ApiKey], keys: list[ApiKey]) -> str:
    """What a new list of keys changed, by name: "3 keys (added a; removed b)"."""
    before = {k.name: k for k in old}
    new = {k.name: k for k in keys}
    said = [
        f"{verb} {', '.join(names)}"
        for verb, names in (
            ("added", sorted(new.keys() - before.keys())),
            ("removed", sorted(before.keys() - new.keys())),
            ("changed", sorted(n for n in new.keys() & before.keys() if new[n] != before[n])),
        )
        if names
    ]
    count = f"{len(keys)} key{'' if len(keys) == 1 else 's'}"
    return f"{count} ({'; '.join(said) or 'unchanged'})"


def _order(key: ApiKey) -> tuple[str, str]:
    return key.name, key.sha256

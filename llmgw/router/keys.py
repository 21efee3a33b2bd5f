"""API keys: stored hashed, each optionally limited to some models.

Keys are random and long, so a fast hash (SHA-256) is enough to keep them
out of config files; the key itself never appears in logs, only its name.

A ring is replaced in place (``replace``) when the config is read again:
whoever holds the ring checks the next request against the new keys.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import attrs

from llmgw.config.schema import RouterConfig

KEY_PREFIX = "llmgw-"


@attrs.frozen
class ApiKey:
    name: str
    sha256: str
    models: frozenset[str] = frozenset()  # empty: every model

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def api_keys(config: RouterConfig) -> list[ApiKey]:
    """The keys a ``[router]`` table lists."""
    return [ApiKey(k.name, k.sha256, frozenset(k.models)) for k in config.keys]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyRing:
    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_hash = {k.sha256: k for k in keys}

    def replace(self, keys: list[ApiKey]) -> str:
        """Check every request from now on against ``keys``; say what changed, by
        name: "3 keys (added a, removed b, changed c)"."""
        old = {k.name: k for k in self._by_hash.values()}
        self._by_hash = {k.sha256: k for k in keys}
        new = {k.name: k for k in keys}
        changes = [
            f"{verb} {', '.join(names)}"
            for verb, names in (
                ("added", sorted(new.keys() - old.keys())),
                ("removed", sorted(old.keys() - new.keys())),
                ("changed", sorted(n for n in new.keys() & old.keys() if new[n] != old[n])),
            )
            if names
        ]
        count = f"{len(keys)} key{'' if len(keys) == 1 else 's'}"
        return f"{count} ({'; '.join(changes) or 'unchanged'})"

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

"""API keys: stored hashed, each optionally limited to some models.

Keys are random and long, so a fast hash (SHA-256) is enough to keep them
out of config files; the key itself never appears in logs, only its name.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import attrs

KEY_PREFIX = "llmgw-"


@attrs.frozen
class ApiKey:
    name: str
    sha256: str
    models: frozenset[str] = frozenset()  # empty: every model

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyRing:
    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_hash = {k.sha256: k for k in keys}

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

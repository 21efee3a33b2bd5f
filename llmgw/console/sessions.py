"""Sign-in for the web console: tokens checked by the server, sessions in memory.

Two tokens sign in: the viewer token (sees everything but secrets) and the admin
token (may also act). A session is a random id in an HttpOnly, SameSite=Strict cookie
(Secure when served over TLS) and a CSRF token the page sends back in a header with
every POST; both are compared in constant time. Sessions live in memory, bounded in
number and in age: a restart signs everyone out, which is what a console can afford.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict

import attrs

COOKIE = "llmgw_console"
CSRF_HEADER = "x-csrf-token"
MAX_SESSIONS = 1000  # past it, the oldest is signed out


@attrs.define
class Session:
    role: str  # "viewer" or "admin"
    csrf: str
    expires: float  # on the clock ``Sessions`` was given
    address: str  # where it signed in from, for the log


class Sessions:
    def __init__(self, admin_token: str, viewer_token: str, ttl_s: float) -> None:
        if not admin_token or not viewer_token:
            raise ValueError("the console needs an admin token and a viewer token")
        if admin_token == viewer_token:
            raise ValueError("the viewer token must differ from the admin token")
        self._tokens = ((admin_token.encode(), "admin"), (viewer_token.encode(), "viewer"))
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def role_of(self, token: str) -> str | None:
        """Which role ``token`` signs in as; None for neither. Both are compared, always."""
        given = token.strip().encode()
        found = None
        for known, role in self._tokens:
            if hmac.compare_digest(given, known) and found is None:
                found = role
        return found

    def open(self, role: str, now: float, address: str) -> tuple[str, Session]:
        sid = secrets.token_urlsafe(32)
        session = Session(role, secrets.token_urlsafe(24), now + self.ttl_s, address)
        self._sessions[sid] = session
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return sid, session

    def find(self, sid: str, now: float) -> Session | None:
        session = self._sessions.get(sid) if sid else None
        if session is None:
            return None
        if session.expires <= now:
            del self._sessions[sid]
            return None
        return session

    def close(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def __len__(self) -> int:
        return len(self._sessions)


def csrf_ok(session: Session, sent: str | None) -> bool:
    return bool(sent) and hmac.compare_digest(session.csrf.encode(), (sent or "").encode())


def cookie_value(header: str | None) -> str:
    """The console's session id from a Cookie header ("" without one)."""
    for part in (header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return ""


def set_cookie(sid: str, *, secure: bool, max_age: int) -> str:
    return f"{COOKIE}={sid}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}" + (
        "; Secure" if secure else ""
    )

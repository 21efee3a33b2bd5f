"""The web console's listener: its page, sign-in, the fleet's views, actions, live feed.

Every view is the admin API's own answer (the same structs ``ctl`` reads), asked
in process: the console adds sign-in and roles, not another picture of the fleet.
A viewer reads; an admin may also cordon, uncordon, drain and reload, each logged
as the same ``ctl`` command is, with who asked from where. Every POST needs the
session's CSRF token in ``X-CSRF-Token`` and, when the browser says where it comes
from, this very origin; the session cookie is HttpOnly and SameSite=Strict.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from urllib.parse import parse_qs, unquote, urlsplit

import msgspec
import trio

from llmgw.admin.answers import error, json_body, json_response
from llmgw.admin.api import AdminApi
from llmgw.bench.svg import svg as draw_svg
from llmgw.console.sessions import (
    CSRF_HEADER,
    Session,
    Sessions,
    cookie_value,
    csrf_ok,
    set_cookie,
)
from llmgw.console.traffic import TrafficHistory
from llmgw.controlplane.changes import Bell
from llmgw.http import Request, Response, Throttled
from llmgw.version import describe

log = logging.getLogger("llmgw.console")

MAX_STREAMS = 200  # live feeds open at once; past it, a new one is answered 503
KEEPALIVE_S = 15.0  # a comment this often keeps proxies from closing a quiet feed
GATHER_S = 0.1  # after a change, what else changes this soon goes in the same event
# a view is built once per change and shared by every console that asks for it, for at
# most this long (what changes without a ring, the router's in-flight counts, is as old)
VIEW_AGE_S = 1.0
MAX_VIEWS = 256  # views kept (one per path, per model's placement)

_SECURITY = [
    (
        "content-security-policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self';"
        " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
]
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

Handler = Callable[[Request, Session], Awaitable[Response]]


class _Login(msgspec.Struct):
    token: str


class SessionAnswer(msgspec.Struct, kw_only=True):
    role: str  # "" when not signed in
    csrf: str
    server_version: str


def static_files() -> dict[str, tuple[bytes, str, str]]:
    """The page's files, read once from the package (or the single file): name ->
    (bytes, content type, ETag)."""
    found: dict[str, tuple[bytes, str, str]] = {}
    folder = resources.files("llmgw.console") / "static"
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            data = entry.read_bytes()
            tag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
            found[entry.name] = (data, _TYPES[suffix], tag)
    return found


class ConsoleApp:
    def __init__(
        self,
        admin: AdminApi,
        sessions: Sessions,
        bell: Bell,
        traffic: TrafficHistory,
        *,
        secure: bool,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.admin = admin
        self.sessions = sessions
        self.bell = bell
        self.traffic = traffic
        self.secure = secure  # served over TLS: the cookie is Secure
        self._wall = wall
        self._files = static_files()
        self.streams = 0  # live feeds open now
        # a wrong sign-in, and a feed refused, are said at most once per interval
        self._warn_wrong = Throttled("console: a sign-in with a wrong token from %s")
        self._warn_feeds = Throttled(
            "console: %d live feeds are open, the most it keeps: a new one from %s is refused"
        )
        # path -> (the bell's count, when built, status, headers, body)
        self._views: dict[str, tuple[int, float, int, list[tuple[str, str]], bytes]] = {}
        self._gets: dict[str, Handler] = {
            "/api/session": self._session,
            "/api/nodes": lambda r, s: self._shared(r, self.admin.nodes),
            "/api/models": lambda r, s: self._shared(r, self.admin.models),
            "/api/replicas": lambda r, s: self._shared(r, self.admin.replicas),
            "/api/status": lambda r, s: self._shared(r, self.admin.status),
            "/api/traffic": self._traffic,
            "/api/events": self._events,
        }
        self._posts: dict[str, Handler] = {
            "/api/logout": self._logout,
            "/api/reload": self._reload,
        }

    # --- the door -----------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        answer = await self._answer(request)
        answer.headers.extend(_SECURITY)
        return answer

    async def _answer(self, request: Request) -> Response:
        path = request.path
        if request.method == "GET" and not path.startswith("/api/"):
            return self._static(request)
        if path == "/api/login":
            if request.method != "POST":
                return error(405, "sign in with POST")
            return self._login(request)
        session = self.sessions.find(cookie_value(request.headers.get("cookie")), self._wall())
        if session is None and path == "/api/session" and request.method == "GET":
            # the page asks before it shows anything: no session is an answer, not an error
            # (a browser logs every 401 as an error in its console)
            return json_response(200, SessionAnswer(role="", csrf="", server_version=""))
        if session is None:
            return error(401, "not signed in, or the session is over: sign in again")
        if request.method == "POST":
            refused = self._cross_site(request, session)
            if refused is not None:
                return refused
            handler = self._posts.get(path)
            if handler is not None:
                return await handler(request, session)
            parts = [p for p in path.split("/") if p]
            if len(parts) == 3 and parts[:2] == ["api", "nodes"]:
                return await self._intent(request, session, unquote(parts[2]))
            return error(404, f"no such action: {path}")
        if request.method != "GET":
            return error(405, f"{request.method} is not allowed on {path}")
        handler = self._gets.get(path)
        if handler is not None:
            answer = await handler(request, session)
            if handler is not self._events:
                answer.headers.append(("cache-control", "no-store"))
            return answer
        parts = [unquote(p) for p in path.split("/") if p]
        if len(parts) == 4 and parts[:2] == ["api", "models"]:
            model, what = parts[2], parts[3]
            if what == "placement":
                return await self._shared(request, lambda r: self.admin.placement(r, model))
            if what == "bench":
                return self._bench(model)
            if what == "bench.svg":
                return self._bench_svg(request, model)
        return error(404, f"no such page: {path}")

    def _cross_site(self, request: Request, session: Session) -> Response | None:
        """A POST from another site: no CSRF token of this session, or a browser that
        says the page came from elsewhere."""
        if not csrf_ok(session, request.headers.get(CSRF_HEADER)):
            return error(403, "refused: this request does not carry the session's CSRF token")
        origin = request.headers.get("origin")
        host = request.headers.get("host") or ""
        if origin is not None and urlsplit(origin).netloc != host:
            return error(403, f"refused: a request from {origin!r}, another site")
        return None

    def _static(self, request: Request) -> Response:
        name = "index.html" if request.path == "/" else request.path.removeprefix("/static/")
        found = self._files.get(name) if "/" not in name else None
        if found is None or (request.path != "/" and not request.path.startswith("/static/")):
            return error(404, f"no such page: {request.path}")
        data, kind, tag = found
        headers = [("content-type", kind), ("etag", tag), ("cache-control", "no-cache")]
        if request.headers.get("if-none-match") == tag:
            return Response(status=304, headers=headers)
        return Response(status=200, headers=headers, body=data)

    # --- sign-in --------------------------------------------------------------------

    def _login(self, request: Request) -> Response:
        body = json_body(request, _Login, 'JSON like {"token": "..."}')
        if isinstance(body, Response):
            return body
        address = request.client[0]
        role = self.sessions.role_of(body.token)
        if role is None:
            self._warn_wrong.warn(address)
            return error(
                401,
                "wrong token: give the console's viewer token or the admin token (see"
                " `llmgw ctl console`)",
            )
        sid, session = self.sessions.open(role, self._wall(), address)
        log.info("console: %s signed in from %s", role, address)
        answer = json_response(200, self._said(session))
        answer.headers.append(
            ("set-cookie", set_cookie(sid, secure=self.secure, max_age=int(self.sessions.ttl_s)))
        )
        answer.headers.append(("cache-control", "no-store"))
        return answer

    async def _session(self, request: Request, session: Session) -> Response:
        return json_response(200, self._said(session))

    async def _logout(self, request: Request, session: Session) -> Response:
        self.sessions.close(cookie_value(request.headers.get("cookie")))
        log.info("console: %s signed out from %s", session.role, request.client[0])
        answer = json_response(200, {})
        answer.headers.append(("set-cookie", set_cookie("", secure=self.secure, max_age=0)))
        return answer

    @staticmethod
    def _said(session: Session) -> SessionAnswer:
        return SessionAnswer(role=session.role, csrf=session.csrf, server_version=describe())

    # --- actions ----------------------------------------------------------------------

    def _may_act(self, request: Request, session: Session, what: str) -> Response | None:
        if session.role == "admin":
            log.info("console: admin at %s asked: llmgw ctl %s", request.client[0], what)
            return None
        log.warning(
            "console: a viewer at %s tried `llmgw ctl %s`: refused", request.client[0], what
        )
        return error(403, f"signed in as a viewer: `{what}` needs the admin token")

    async def _intent(self, request: Request, session: Session, node: str) -> Response:
        try:
            intent = msgspec.json.decode(request.body or b"{}", type=dict).get("intent", "?")
        except msgspec.DecodeError:
            intent = "?"
        refused = self._may_act(request, session, f"{intent} {node}")
        if refused is not None:
            return refused
        return await self.admin.node_intent(request, node)

    async def _reload(self, request: Request, session: Session) -> Response:
        refused = self._may_act(request, session, "reload")
        if refused is not None:
            return refused
        return await self.admin.reload(request)

    # --- views of its own -------------------------------------------------------------

    async def _shared(
        self, request: Request, build: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """The admin API's view, built once per change of the fleet (and at most
        ``VIEW_AGE_S`` old): ten consoles woken by one change cost one build, not ten."""
        now = trio.current_time()
        kept = self._views.get(request.path)
        if kept is not None and kept[0] == self.bell.count and now - kept[1] < VIEW_AGE_S:
            _, _, status, headers, body = kept
            return Response(status=status, headers=list(headers), body=body)
        count = self.bell.count
        answer = await build(request)
        if isinstance(answer.body, bytes):
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            self._views[request.path] = (
                count,
                now,
                answer.status,
                list(answer.headers),
                answer.body,
            )
        return answer

    async def _traffic(self, request: Request, session: Session) -> Response:
        return json_response(200, self.traffic.view())

    def _bench(self, model: str) -> Response:
        benches = self.admin.benches
        if benches is None:
            return json_response(200, {"runs": []})
        return json_response(200, benches.listed(model))

    def _bench_svg(self, request: Request, model: str) -> Response:
        runs = self.admin.benches.runs(model) if self.admin.benches is not None else []
        try:
            index = int(parse_qs(request.query).get("run", ["0"])[0])
        except ValueError:
            index = -1
        if not 0 <= index < len(runs):
            return error(404, f"no bench result {index} of {model!r}: see /api/models/M/bench")
        return Response(
            status=200,
            headers=[("content-type", "image/svg+xml"), ("cache-control", "no-store")],
            body=draw_svg(runs[index]).encode(),
        )

    # --- live -------------------------------------------------------------------------

    async def _events(self, request: Request, session: Session) -> Response:
        """Server-sent events: one ``change`` event as soon as the control plane's bell
        rings (gathering what rings with it), naming what changed."""
        if self.streams >= MAX_STREAMS:
            self._warn_feeds.warn(MAX_STREAMS, request.client[0])
            return error(503, f"{MAX_STREAMS} live feeds are open: close a console tab")
        sid = cookie_value(request.headers.get("cookie"))
        return Response(
            status=200,
            headers=[
                ("content-type", "text/event-stream"),
                ("cache-control", "no-store"),
                ("x-accel-buffering", "no"),
            ],
            body=self._feed(sid),
        )

    async def _feed(self, sid: str) -> AsyncIterator[bytes]:
        self.streams += 1
        try:
            seen = self.bell.count
            yield b"retry: 1000\n: open\n\n"
            while True:
                with trio.move_on_after(KEEPALIVE_S):
                    await self.bell.wait(seen)
                if self.sessions.find(sid, self._wall()) is None:
                    yield b"event: signedout\ndata: {}\n\n"
                    return
                if self.bell.count == seen:
                    yield b": keepalive\n\n"
                    continue
                await trio.sleep(GATHER_S)
                what = self.bell.since(seen)
                seen = self.bell.count
                data = msgspec.json.encode({"seq": seen, "what": what})
                yield b"event: change\ndata: " + data + b"\n\n"
        finally:
            self.streams -= 1

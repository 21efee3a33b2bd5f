"""Request parsing: httptools callbacks into complete requests, limits enforced on the way.

Sans-I/O: the connection feeds bytes in and reads complete messages, in
order, from ``msgs``. Parsing stops for good at the first error, recorded in
``failure`` to be answered after the requests that completed before it.

Memory a client can make the server hold is bounded before anything else:
the head by ``max_header_bytes``; the body by ``admit``, which sees each
head before any byte of its body is kept and may answer it there (a request
without a good key never gets a byte of its body buffered); and every body
held, all connections together, by one ``BodyBudget`` (``max_bodies_bytes``,
shared fairly per principal and per address: ``_budget.py``): a body that
finds no room is a 503, one dropped for a client holding less is a 503 too,
and a request's bytes go back to it when its response is written or its
connection ends.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from urllib.parse import unquote

import httptools

from ._budget import BodyBudget, Holding
from .types import Admit, Headers, Request, Response, ServerLimits

logger = logging.getLogger("llmgw.http")

# Request headers the callbacks look at as they arrive.
_SPECIAL = frozenset(("content-length", "transfer-encoding", "expect", "host"))

_METHODS = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")}


class _Reject(Exception):
    """Raised inside a parser callback to stop parsing with an error response."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


class _Answered(Exception):
    """Raised inside a parser callback: ``admit`` answered a request whose body is coming."""


Gate = Callable[[Request], Response | None]
"""Called after ``admit`` with each complete head: a ``Response`` overrides the
verdict (the connection's reserve rule), None leaves it."""

FULL = "the server holds too many request bodies now; retry shortly"
DROPPED = (
    "the server needed the memory your request body held for clients holding less"
    " (its share is per key and per address); retry shortly"
)


class Message:
    """Parser-side state of one request while it is being read."""

    __slots__ = (
        "answer",
        "body",
        "body_len",
        "chunked",
        "content_length",
        "done",
        "expect_continue",
        "has_host",
        "head_bytes",
        "head_done",
        "headers",
        "holding",
        "keep_alive",
        "method",
        "path",
        "query",
        "request",
        "url",
        "version",
    )

    def __init__(self) -> None:
        self.answer: Response | None = None  # admit's answer: the handler does not run
        self.request: Request | None = None  # made once the head is complete
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.body_len = 0
        self.holding: Holding | None = None  # its bytes in the body budget
        self.head_bytes = 0
        self.head_done = False
        self.done = False
        self.content_length: int | None = None
        self.chunked = False
        self.expect_continue = False
        self.has_host = False
        self.keep_alive = False
        self.method = ""
        self.path = ""
        self.query = ""
        self.version = ""


def split_target(url: bytes) -> tuple[str, str]:
    """Request target -> (percent-decoded path, raw query)."""
    if url[:1] == b"/":
        target = url.decode("latin-1")
        if "#" in target:
            target = target.partition("#")[0]
        path, _, query = target.partition("?")
    elif url == b"*":
        return "*", ""
    else:  # absolute form
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            raise _Reject(400, "malformed request target") from None
        path = (parsed.path or b"/").decode("latin-1")
        query = (parsed.query or b"").decode("latin-1")
    if "%" in path:
        path = unquote(path, errors="replace")
    return path, query


class RequestParser:
    """One connection's parser state: a queue of requests being read."""

    def __init__(
        self,
        limits: ServerLimits,
        name: str,
        client: tuple[str, int] = ("", 0),
        admit: Admit | None = None,
        budget: BodyBudget | None = None,
        gate: Gate | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.limits = limits
        self.name = name
        self.client = client
        self.admit = admit
        self.gate = gate
        self.on_drop = on_drop  # told when the budget dropped the body being read
        self.budget = budget or BodyBudget(limits.max_bodies_bytes)
        self.holdings: set[Holding] = set()  # this connection's, charged to the budget
        self.dropped: Message | None = None  # a body the budget took back, while it arrived
        self.refused = ""  # the principal of a body the full budget refused
        self.parser = httptools.HttpRequestParser(self)
        self.msgs: collections.deque[Message] = collections.deque()
        self.cur: Message | None = None  # the request the parser is inside, if any
        # Set when parsing stopped for good: (status, message) answered after every
        # already complete request; status 0 means close without a response.
        self.failure: tuple[int, str] | None = None
        self.progress = False  # some callback ran during the current feed
        self.stall = 0  # bytes fed without any callback (one header or framing piece)

    @property
    def idle(self) -> bool:
        """No byte of a next request has arrived."""
        return self.cur is None and self.stall == 0

    def release(self, msg: Message) -> None:
        """``msg``'s body is no longer held: give its bytes back to the budget."""
        holding = msg.holding
        if holding is not None:
            msg.holding = None
            self.holdings.discard(holding)
            self.budget.release(holding)

    def dispose(self) -> None:
        """Drop buffered requests, give back every byte still charged, and break
        the parser <-> callbacks reference cycle."""
        self.msgs.clear()
        for holding in self.holdings:
            self.budget.release(holding)
        self.holdings.clear()
        self.on_drop = None
        del self.parser

    def _dropped(self, msg: Message) -> None:
        """The budget took ``msg``'s bytes back for a client holding less: parsing is
        over, and the connection answers 503 once woken."""
        if self.failure is not None or msg.done:
            return
        msg.holding = None
        msg.body = []
        self.dropped = msg
        self.failure = (503, DROPPED)
        self.cur = None
        if self.on_drop is not None:
            self.on_drop()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.progress = True
        msg = Message()
        self.cur = msg
        self.msgs.append(msg)

    def on_url(self, url: bytes) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.url += url
        msg.head_bytes += len(url)
        if msg.head_bytes > self.limits.max_header_bytes:
            raise _Reject(431, "request header too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.head_bytes += len(name) + len(value) + 4
        if msg.head_bytes > self.limits.max_header_bytes:
            raise _Reject(431, "request header too large")
        if msg.head_done:
            return  # a chunked trailer: bounded above, otherwise ignored
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        msg.headers.append((key, text))
        if key in _SPECIAL:
            if key == "content-length":
                msg.content_length = int(text)  # llhttp has validated it
            elif key == "transfer-encoding":
                if text.strip().lower() != "chunked" or msg.chunked:
                    raise _Reject(501, f"transfer-encoding {text!r} is not supported")
                msg.chunked = True
            elif key == "expect":
                if text.strip().lower() != "100-continue":
                    raise _Reject(417, f"expectation {text!r} is not supported")
                msg.expect_continue = True
            else:
                msg.has_host = True

    def on_headers_complete(self) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        parser = self.parser
        version = parser.get_http_version()
        if version == "1.1":
            msg.version = "1.1"
            if not msg.has_host:
                raise _Reject(400, "missing Host header")
        elif version == "1.0":
            msg.version = "1.0"
            msg.expect_continue = False  # HTTP/1.0 clients cannot expect it
        else:
            raise _Reject(505, f"HTTP/{version} is not supported")
        raw_method = parser.get_method()
        method = _METHODS.get(raw_method) or raw_method.decode("ascii")
        msg.method = method
        msg.keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():
            # Serve it as a plain request (the upgrade is declined) and close after.
            if method == "CONNECT":
                raise _Reject(501, "CONNECT is not supported")
            if msg.chunked or msg.content_length:
                raise _Reject(501, "protocol upgrade with a request body is not supported")
            msg.keep_alive = False
        if msg.content_length is not None and msg.content_length > self.limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        msg.path, msg.query = split_target(msg.url)
        msg.head_bytes = 0  # from here on it counts trailers
        msg.head_done = True
        request = Request(
            method, msg.path, msg.query, Headers(msg.headers), b"", self.client, msg.version
        )
        msg.request = request
        admit = self.admit
        verdict = admit(request) if admit is not None else None
        if self.gate is not None:
            verdict = self.gate(request) or verdict
        if isinstance(verdict, Response):
            msg.answer = verdict
            if msg.chunked or msg.content_length:
                # A body is coming that nobody will read: answer, then close.
                msg.keep_alive = False
                msg.done = True
                self.cur = None
                raise _Answered
        else:
            request.admitted = verdict

    def on_body(self, data: bytes) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        n = len(data)
        if msg.body_len + n > self.limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        holding = msg.holding
        if holding is None:
            request = msg.request
            assert request is not None
            holding = msg.holding = self.budget.hold(
                request.principal, self.client[0], lambda: self._dropped(msg)
            )
            self.holdings.add(holding)
        if not self.budget.charge(holding, n):
            self.refused = holding.principal
            raise _Reject(503, FULL)
        msg.body_len += n
        msg.body.append(data)

    def on_chunk_header(self) -> None:
        self.progress = True

    def on_chunk_complete(self) -> None:
        self.progress = True

    def on_message_complete(self) -> None:
        self.progress = True
        msg = self.cur
        assert msg is not None
        msg.done = True
        self.cur = None
        if msg.holding is not None:
            self.budget.done_reading(msg.holding)

    def feed(self, data: bytes) -> None:
        """Feed bytes to the parser; turn its errors into `self.failure`."""
        if self.failure is not None:
            return  # parsing is over (a dropped body: the rest of it is not wanted)
        self.progress = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.failure = (0, "")  # the upgrade request itself completed; nothing after it
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self.failure = (cause.status, cause.message)
            elif isinstance(cause, _Answered):
                self.failure = (0, "")  # the answered request is complete; nothing after it
            elif isinstance(cause, Exception):
                logger.error("%s: request parsing failed", self.name, exc_info=cause)
                self.failure = (500, "internal server error")
            else:
                self.failure = (400, f"malformed request: {exc}")
        else:
            if self.progress:
                self.stall = 0
                return
            # No callback fired: all of `data` belongs to one header (or piece of
            # chunk framing / trailer) the parser buffers until it ends. Bound it.
            self.stall += len(data)
            if self.stall <= self.limits.max_header_bytes:
                return
            msg = self.cur
            if msg is None or not msg.head_done:
                self.failure = (431, "request header too large")
            else:
                self.failure = (400, "chunk framing or trailers too large")
        # Parsing is over: a request that had not completed never will.
        self.cur = None
        msgs = self.msgs
        while msgs and not msgs[-1].done:
            self.release(msgs.pop())

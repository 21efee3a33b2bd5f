"""Arbitrary bytes never wedge or break the server."""

from __future__ import annotations

import logging

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.http import HttpServer, Request, Response, ServerLimits

from .helpers import RawClient

# Pieces of requests, so that examples get past the request line often.
FRAGMENTS = [
    b"GET ",
    b"POST ",
    b"HEAD ",
    b"PUT ",
    b"/",
    b"/x?y=1",
    b"*",
    b"http://h/p",
    b" HTTP/1.1\r\n",
    b" HTTP/1.0\r\n",
    b" HTTP/2.0\r\n",
    b"Host: t\r\n",
    b"Content-Length: 5\r\n",
    b"Content-Length: 99999999\r\n",
    b"Content-Length: -1\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Connection: close\r\n",
    b"Connection: keep-alive\r\n",
    b"Connection: Upgrade\r\n",
    b"Upgrade: websocket\r\n",
    b"Expect: 100-continue\r\n",
    b"X-Long: " + b"a" * 300 + b"\r\n",
    b"\r\n",
    b"\n",
    b"\r",
    b"0\r\n\r\n",
    b"5\r\nhello\r\n",
    b"ffffffffffffffffff\r\n",
    b"hello",
    b":",
    b" ",
    b"\x00",
    b"\xff",
]

junk = st.one_of(
    st.binary(min_size=1, max_size=200),
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=25).map(b"".join),
    st.tuples(
        st.lists(st.sampled_from(FRAGMENTS), max_size=12).map(b"".join),
        st.binary(max_size=40),
        st.lists(st.sampled_from(FRAGMENTS), max_size=12).map(b"".join),
    ).map(b"".join),
)


async def handler(request: Request) -> Response:
    return Response(200, [("x-ok", "1")], b"ok")


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=junk)
async def test_arbitrary_bytes_get_an_error_or_a_close(
    data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.clear()
    server = HttpServer(handler, limits=ServerLimits(max_header_bytes=512, max_body_bytes=64))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            port = listener.socket.getsockname()[1]

            c = await RawClient.connect(port)
            await c.send(data)
            await c.stream.send_eof()
            try:
                rest = await c.closed()
                parse_error = None
            except trio.BrokenResourceError:
                rest, parse_error = b"", None
            except Exception as exc:  # the reply itself was not valid HTTP
                rest, parse_error = b"", exc
            else:
                c.parser.feed_data(rest)
            assert parse_error is None, f"unparseable reply: {parse_error!r}"
            statuses = [reply.status for reply in c.replies]
            for status in statuses:
                # The handler's 200 only if the bytes held a valid request; otherwise
                # the server's own words: 100 Continue, or a 4xx/5xx before closing.
                assert status in (100, 200) or 400 <= status < 600, statuses
            if any(status >= 400 for status in statuses):
                assert statuses[-1] >= 400, statuses  # an error is the last thing said

            # And the server still serves a well-formed request on a fresh connection.
            fresh = await RawClient.connect(port)
            await fresh.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            reply = await fresh.reply()
            assert (reply.status, reply.body) == (200, b"ok")
            nursery.cancel_scope.cancel()
    problems = [r for r in caplog.records if r.name == "llmgw.http" and r.levelno >= logging.ERROR]
    assert not problems, problems[0].getMessage()

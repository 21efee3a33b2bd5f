"""The browser harness itself (tests/console/browser.py), against pages it serves itself:
clicks and text, the console's errors, screenshots and the PNG decoder, failure messages,
and the same from a trio test whose server runs in the trio loop."""

from __future__ import annotations

import random
import struct
import time
import zlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import trio

from tests.console.browser import (
    Browser,
    chromium_missing,
    distinct_colours,
    open_browser,
    open_browser_async,
    png_is_blank,
    png_pixels,
    serve_pages,
)

NO_ICON = '<link rel="icon" href="data:,">'  # else Chromium asks for /favicon.ico
PAGES = {
    "/": f"""<!doctype html><html><head><title>clean</title>{NO_ICON}</head>
<body style="margin:0;font:16px sans-serif;background:#fff">
<h1 style="margin:0;padding:20px;background:#246;color:#fff">Harness</h1>
<button id="go" onclick="document.getElementById('out').textContent = 'after'">Go</button>
<span id="out">before</span> <input id="name">
<script>console.log("just a log")</script>
</body></html>""",
    "/error": f"""<!doctype html><html><head>{NO_ICON}</head><body><p>errors</p>
<script>console.error("boom from the page")</script>
<script>throw new Error("uncaught on load")</script>
</body></html>""",
    "/blank": f"""<!doctype html><html><head>{NO_ICON}</head>
<body style="margin:0;background:#fff"></body></html>""",
}


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_pages(PAGES) as url:
        yield url


@pytest.fixture
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def test_chromium_and_its_driver_are_installed() -> None:
    assert chromium_missing() == "", chromium_missing()


def test_a_click_changes_the_text_and_inputs_take_what_is_typed(
    browser: Browser, site: str
) -> None:
    browser.get(site + "/")
    assert browser.text("#out") == "before"
    browser.click("#go")
    assert browser.wait_for_text("#out", "after") == "after"
    browser.fill("#name", "fleet one")
    assert browser.js("return document.getElementById('name').value;") == "fleet one"
    assert browser.js("return arguments[0] + arguments[1];", 2, 3) == 5
    assert abs(browser.now_ms() - time.time() * 1000) < 5000
    assert browser.js("return [window.innerWidth, window.innerHeight];") == [1280, 800]
    browser.assert_no_console_errors()


def test_the_console_errors_are_caught_once_each(browser: Browser, site: str) -> None:
    browser.get(site + "/")
    assert browser.console_errors() == []
    assert any("just a log" in m for m in browser.console_messages())

    browser.get(site + "/error")
    errors = browser.console_errors()
    assert len(errors) == 2, errors
    assert "boom from the page" in errors[0]
    assert "uncaught on load" in errors[1]
    assert browser.console_errors() == []  # only those since the last call

    browser.js("console.error('once more');")
    with pytest.raises(AssertionError, match="once more"):
        browser.assert_no_console_errors()
    browser.assert_no_console_errors()


def test_a_screenshot_of_a_page_is_not_blank_and_of_a_white_page_is(
    browser: Browser, site: str, tmp_path: Path
) -> None:
    browser.get(site + "/")
    shot = browser.screenshot(tmp_path / "clean.png")
    width, height, _, _ = png_pixels(shot)
    assert (width, height) == (1280, 800)
    assert distinct_colours(shot) > 10  # the heading's blue, white, antialiased text
    assert not png_is_blank(shot)

    browser.get(site + "/blank")
    blank = browser.screenshot(tmp_path / "blank.png")
    assert distinct_colours(blank) == 1
    assert png_is_blank(blank)


def test_a_failed_wait_says_what_it_awaited_and_what_the_page_shows(
    browser: Browser, site: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_SCREENSHOTS", str(tmp_path))
    browser.get(site + "/error")
    with pytest.raises(AssertionError) as failed:
        browser.wait_for("#never", timeout=0.3)
    message = str(failed.value)
    assert "'#never'" in message and "errors" in message and "boom from the page" in message
    assert list(tmp_path.glob("*.png")), "no screenshot of the page that failed"

    def the_answer(b: Browser) -> bool:
        return bool(b.js("return 6 * 7 === 43;"))

    with pytest.raises(AssertionError, match="the_answer"):
        browser.wait_for(the_answer, timeout=0.3)


def write_png(path: Path, rows: list[bytes], width: int, bpp: int) -> None:
    """An 8-bit RGB/RGBA PNG whose rows take the five filter types in turn."""

    def paeth(a: int, b: int, c: int) -> int:
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        return a if pa <= pb and pa <= pc else b if pb <= pc else c

    raw = bytearray()
    prev = bytes(width * bpp)
    for y, row in enumerate(rows):
        kind = y % 5
        raw.append(kind)
        for i, x in enumerate(row):
            a = row[i - bpp] if i >= bpp else 0
            c = prev[i - bpp] if i >= bpp else 0
            predictor = (0, a, prev[i], (a + prev[i]) // 2, paeth(a, prev[i], c))[kind]
            raw.append((x - predictor) & 0xFF)
        prev = row

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, len(rows), 8, 2 if bpp == 3 else 6, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(bytes(raw)))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("bpp", [3, 4])
def test_the_png_decoder_undoes_every_filter(tmp_path: Path, bpp: int) -> None:
    rng = random.Random(bpp)
    width = 37
    rows = [bytes(rng.randrange(256) for _ in range(width * bpp)) for _ in range(23)]
    path = tmp_path / "noise.png"
    write_png(path, rows, width, bpp)
    assert png_pixels(path) == (width, 23, bpp, rows)
    assert not png_is_blank(path)

    white = [b"\xff" * (width * bpp)] * 30
    write_png(path, white, width, bpp)
    assert png_is_blank(path) and distinct_colours(path) == 1
    white[7] = b"\xff" * bpp * 3 + b"\x00" * bpp + b"\xff" * bpp * (width - 4)
    write_png(path, white, width, bpp)
    assert distinct_colours(path) == 2
    assert not png_is_blank(path, tolerance=0)
    assert png_is_blank(path, tolerance=0.001)  # one pixel in 1110


async def test_from_trio_with_the_server_in_the_trio_loop() -> None:
    """The pattern for trio tests: the browser's calls in worker threads, so a server in
    the trio loop answers the page's requests meanwhile."""

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                data = await stream.receive_some(4096)
                if not data:
                    return
                request += data
            body = PAGES.get(request.split(b" ")[1].decode(), "").encode()
            head = f"HTTP/1.1 {200 if body else 404} -\r\nContent-Type: text/html\r\n"
            head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            await stream.send_all(head.encode() + body)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with open_browser_async() as b:
                await trio.to_thread.run_sync(b.get, f"http://127.0.0.1:{port}/")
                await trio.to_thread.run_sync(b.click, "#go")
                assert await trio.to_thread.run_sync(b.wait_for_text, "#out", "after") == "after"
                await trio.to_thread.run_sync(b.assert_no_console_errors)
            nursery.cancel_scope.cancel()

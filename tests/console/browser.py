"""A headless Chromium for tests of web pages (the console), driven through Selenium.

Debian's ``chromium`` and ``chromium-driver`` (``tools/setup`` installs them as root) and
Selenium from the test extra. Selenium is handed the driver's path, so its Selenium
Manager never runs and nothing is downloaded. A machine without them fails the test
(``open_browser`` calls ``pytest.fail`` with ``chromium_missing()``), it does not skip.

Every call blocks. From a sync test, call them directly (the server under test in a
subprocess or a thread); from a trio test, open the browser with ``open_browser_async``
and run each call in a worker thread, so the trio loop (and a server in it) keeps going::

    async with open_browser_async() as b:
        await trio.to_thread.run_sync(b.get, url)
        await trio.to_thread.run_sync(b.click, "#go")
        assert await trio.to_thread.run_sync(b.wait_for_text, "#out", "after") == "after"

Nothing waits forever: pages load, scripts run and ``wait_for`` waits under
``Browser.timeout`` (15 s), each call to the driver under a minute. A ``wait_for`` that
times out says what it awaited and what the page shows, and leaves a screenshot in
``screenshot_dir()``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import struct
import tempfile
import threading
import warnings
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from tests.ports import own_port
from tools.support.chromium import CHROMEDRIVER, CHROMIUM
from tools.support.chromium import FLAGS as CHROME_FLAGS

try:
    from selenium import webdriver
    from selenium.common.exceptions import (
        StaleElementReferenceException,
        TimeoutException,
        WebDriverException,
    )
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.ui import WebDriverWait
except ModuleNotFoundError:  # chromium_missing() says so, and open_browser fails with it
    pass

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 15.0
# the HTTP client's own limit on one call to chromedriver, over the page and script limits
DRIVER_CALL_TIMEOUT = 60.0

FLAGS = (*CHROME_FLAGS, "--force-device-scale-factor=1", "--lang=en-US")

T = TypeVar("T")


def chromium_missing() -> str:
    """ "" when Chromium, its driver and Selenium are installed, else one line saying what to install."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium")
    if not missing:
        return ""
    return (
        f"the browser tests need {', '.join(missing)}: tools/setup installs them (as root), "
        "or apt-get install chromium chromium-driver and .venv/bin/pip install -e '.[test]'"
    )


def screenshot_dir() -> Path:
    """Where screenshots go: $LLMGW_SCREENSHOTS, else <repo>/.test-screenshots (made if missing)."""
    d = Path(os.environ.get("LLMGW_SCREENSHOTS") or ROOT / ".test-screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def open_browser(
    width: int = 1280, height: int = 800, *, timeout: float = TIMEOUT
) -> Iterator[Browser]:
    """A fresh headless Chromium (own profile in a temporary directory) whose page area is
    width x height CSS pixels. It quits, and its directory goes, however the block ends."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    profile = Path(tempfile.mkdtemp(prefix="llmgw-chromium-"))
    driver_log = profile / "chromedriver.log"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile / 'profile'}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with warnings.catch_warnings():  # deprecated for a ClientConfig that Chrome() cannot take
        warnings.simplefilter("ignore", DeprecationWarning)
        options.ignore_local_proxy_environment_variables()  # $http_proxy: not for chromedriver
    # chromedriver must be told its port: one of this process's own (tests/ports.py)
    service = Service(
        executable_path=str(CHROMEDRIVER), port=own_port(), log_output=str(driver_log)
    )
    driver = None
    try:
        try:
            driver = webdriver.Chrome(options=options, service=service)
        except WebDriverException as e:
            log = driver_log.read_text(errors="replace")[-2000:] if driver_log.exists() else ""
            pytest.fail(f"Chromium did not start: {e.msg}\nchromedriver's log ends:\n{log}")
        driver.command_executor.client_config.timeout = DRIVER_CALL_TIMEOUT
        driver.set_page_load_timeout(timeout)
        driver.set_script_timeout(timeout)
        browser = Browser(driver, timeout)
        browser.resize(width, height)
        yield browser
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.quit()  # also stops chromedriver
        shutil.rmtree(profile, ignore_errors=True)


@contextlib.asynccontextmanager
async def open_browser_async(
    width: int = 1280, height: int = 800, *, timeout: float = TIMEOUT
) -> AsyncIterator[Browser]:
    """open_browser for trio tests: Chromium starts and quits in a worker thread. Call the
    Browser's methods with ``await trio.to_thread.run_sync(browser.method, *args)``."""
    cm = open_browser(width, height, timeout=timeout)
    browser = await trio.to_thread.run_sync(cm.__enter__)
    try:
        yield browser
    except BaseException as e:
        with trio.CancelScope(shield=True):
            if not await trio.to_thread.run_sync(cm.__exit__, type(e), e, e.__traceback__):
                raise
    else:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(cm.__exit__, None, None, None)


class Browser:
    """One Chromium window. CSS selectors name elements; the element calls wait (up to
    ``timeout``) for a displayed element first, as a user would."""

    def __init__(self, driver: webdriver.Chrome, timeout: float) -> None:
        self.driver = driver
        self.timeout = timeout
        self._log: list[dict[str, Any]] = []
        self._errors_seen = 0

    # navigation and scripts

    def get(self, url: str) -> None:
        """Load url and wait for its load event (not for what its scripts fetch later)."""
        self.driver.get(url)

    @property
    def url(self) -> str:
        return str(self.driver.current_url)

    def js(self, script: str, *args: Any) -> Any:
        """Run script (a function body: ``return`` a value; arguments in ``arguments[i]``)."""
        return self.driver.execute_script(script, *args)

    def now_ms(self) -> float:
        """The page's clock: milliseconds since the epoch (Chromium gives 0.1 ms steps)."""
        return float(self.js("return performance.timeOrigin + performance.now();"))

    def page_text(self) -> str:
        """What the page shows as text (document.body.innerText)."""
        return str(self.js("return document.body ? document.body.innerText : '';"))

    def resize(self, width: int, height: int) -> None:
        """Make the page area (window.innerWidth x innerHeight) width x height CSS pixels."""
        inner_w, inner_h = self.js("return [window.innerWidth, window.innerHeight];")
        size = self.driver.get_window_size()
        self.driver.set_window_size(
            size["width"] + width - inner_w, size["height"] + height - inner_h
        )

    # elements

    def wait_for(self, what: str | Callable[[Browser], T], timeout: float | None = None) -> Any:
        """Wait for a CSS selector to match a displayed element (returns the element), or
        for predicate(browser) to return something truthy (returns that). On timeout,
        fails saying what it awaited and what the page showed, with a screenshot."""
        if isinstance(what, str):
            css = what
            awaited = f"an element {css!r} on display"

            def found(_: Any) -> Any:
                return self.shown(css) or False
        else:
            predicate = what
            awaited = getattr(what, "__name__", repr(what))

            def found(_: Any) -> Any:
                return predicate(self)

        limit = self.timeout if timeout is None else timeout
        ignored = (StaleElementReferenceException,)  # the page replaced it meanwhile: look again
        wait = WebDriverWait(self.driver, limit, poll_frequency=0.05, ignored_exceptions=ignored)
        try:
            return wait.until(found)
        except TimeoutException:
            raise AssertionError(f"waited {limit:g} s for {awaited}; {self.describe()}") from None

    def wait_for_text(self, css: str, expected: str, timeout: float | None = None) -> str:
        """Wait until a displayed element's text contains expected; returns its whole text."""

        def text_contains(b: Browser) -> str | None:
            element = b.shown(css)
            text = element.text if element is not None else ""
            return text if expected in text else None

        text_contains.__name__ = f"{css!r} to contain {expected!r}"
        return str(self.wait_for(text_contains, timeout))

    def shown(self, css: str) -> WebElement | None:
        """The first displayed element that matches css now, or None (no wait)."""
        for element in self.driver.find_elements(By.CSS_SELECTOR, css):
            if element.is_displayed():
                return element
        return None

    def element(self, css: str, timeout: float | None = None) -> WebElement:
        """The first displayed element that matches css, waited for."""
        return self.wait_for(css, timeout)

    def text(self, css: str, timeout: float | None = None) -> str:
        """The element's visible text, once it is on display."""
        return str(self.element(css, timeout).text)

    def texts(self, css: str) -> list[str]:
        """The visible text of every displayed element that matches css, now (no wait)."""
        return [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, css) if e.is_displayed()]

    def click(self, css: str, timeout: float | None = None) -> None:
        self.element(css, timeout).click()

    def fill(self, css: str, value: str, timeout: float | None = None) -> None:
        """Replace an input's (or textarea's) value by typing value, as a user would."""
        element = self.element(css, timeout)
        element.clear()
        element.send_keys(value)

    # the console

    def console_messages(self) -> list[str]:
        """Every console message (all levels, as 'LEVEL message') since the page opened."""
        self._log.extend(self.driver.get_log("browser"))
        return [f"{e['level']} {e['message']}" for e in self._log]

    def console_errors(self) -> list[str]:
        """The SEVERE console entries (console.error, uncaught exceptions, failed loads)
        since the last call."""
        self.console_messages()
        errors = [e["message"] for e in self._log if e["level"] == "SEVERE"]
        new, self._errors_seen = errors[self._errors_seen :], len(errors)
        return new

    def assert_no_console_errors(self) -> None:
        errors = self.console_errors()
        assert not errors, f"the console logged {len(errors)} error(s):\n" + "\n".join(errors)

    # screenshots

    def screenshot(self, path: Path | str) -> Path:
        """Save the page area as a PNG at path (a relative path is under screenshot_dir())."""
        path = screenshot_dir() / path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.driver.get_screenshot_as_png())
        return path

    def describe(self) -> str:
        """The page's address and the start of its text, for failure messages; also saves a
        screenshot named after the running test."""
        try:
            text = " ".join(self.page_text().split())
            snippet = text[:500] + (" ..." if len(text) > 500 else "")
            test = os.environ.get("PYTEST_CURRENT_TEST", "page").split(" ")[0]
            shot = self.screenshot(re.sub(r"[^A-Za-z0-9_.-]+", "_", test)[-120:] + ".png")
            errors = [m for m in self.console_messages() if m.startswith("SEVERE ")]
            logged = "".join(f"\n  {m}" for m in errors) or " none"
            return f"page {self.url} shows: {snippet!r}; console errors:{logged}; screenshot {shot}"
        except WebDriverException as e:
            return f"the page could not be read: {e.msg}"


# PNG, decoded with the standard library: 8-bit RGB or RGBA, not interlaced (Chromium's)


def png_pixels(path: Path) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes per pixel, rows) of an 8-bit RGB/RGBA non-interlaced PNG."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, header, idat = 8, b"", []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(
            f"{path}: depth {depth}, colour type {colour}, interlace {interlace}: not 8-bit RGB/RGBA"
        )
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        prev = _unfilter(raw[start], raw[start + 1 : start + 1 + stride], prev, bpp)
        rows.append(prev)
    return width, height, bpp, rows


def colour_counts(path: Path) -> Counter[bytes]:
    """How many pixels of each colour (RGB or RGBA bytes) the PNG has."""
    width, _, bpp, rows = png_pixels(path)
    counts: Counter[bytes] = Counter()
    for row in rows:
        if row == row[:bpp] * width:
            counts[row[:bpp]] += width
        else:
            counts.update(row[i : i + bpp] for i in range(0, len(row), bpp))
    return counts


def distinct_colours(path: Path) -> int:
    return len(colour_counts(path))


def png_is_blank(path: Path, tolerance: float = 1e-4) -> bool:
    """Whether one colour covers the whole image but at most a tolerance share of its pixels
    (1e-4: about 100 pixels of 1280x800, less than a word of text)."""
    counts = colour_counts(path)
    return counts.most_common(1)[0][1] >= (1 - tolerance) * counts.total()


_MASKS: dict[int, tuple[int, int]] = {}


def _unfilter(kind: int, line: bytes, prev: bytes, bpp: int) -> bytes:
    if kind == 0:
        return line
    if kind == 2:  # Up, the common case: bytewise add without carries, on one big integer
        n = len(line)
        if n not in _MASKS:
            _MASKS[n] = (int.from_bytes(b"\x7f" * n, "big"), int.from_bytes(b"\x80" * n, "big"))
        low, high = _MASKS[n]
        a, b = int.from_bytes(line, "big"), int.from_bytes(prev, "big")
        return (((a & low) + (b & low)) ^ ((a ^ b) & high)).to_bytes(n, "big")
    out = bytearray(line)
    if kind == 1:  # Sub
        for i in range(bpp, len(out)):
            out[i] = (out[i] + out[i - bpp]) & 0xFF
    elif kind == 3:  # Average
        for i in range(bpp):
            out[i] = (out[i] + (prev[i] >> 1)) & 0xFF
        for i in range(bpp, len(out)):
            out[i] = (out[i] + ((out[i - bpp] + prev[i]) >> 1)) & 0xFF
    elif kind == 4:  # Paeth
        for i in range(bpp):
            out[i] = (out[i] + prev[i]) & 0xFF
        for i in range(bpp, len(out)):
            a, b, c = out[i - bpp], prev[i], prev[i - bpp]
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            out[i] = (out[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    else:
        raise ValueError(f"PNG filter type {kind}")
    return bytes(out)


@contextlib.contextmanager
def serve_pages(pages: dict[str, str]) -> Iterator[str]:
    """A plain HTTP site on 127.0.0.1 (a thread) serving ``pages`` (path -> HTML; any
    other path is a 404), for the length of the block; yields its base URL."""

    class Pages(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path.split("?")[0], "").encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)

"""Debian's Chromium, headless, as the console's browser tests and its benchmark start it."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

FLAGS = (
    "--headless=new",
    "--no-sandbox",  # as root, and in containers without user namespaces
    "--disable-gpu",
    "--disable-dev-shm-usage",  # a small /dev/shm (containers) crashes tabs; /tmp instead
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    # this machine reaches no site but loopback: what Chromium fetches of its own accord
    # is refused, many times over, and slows its start
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--no-proxy-server",  # pages are on loopback; a proxy from the environment must not see them
)

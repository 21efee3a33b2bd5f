"""Why a fetch failed, by what the caller does next: each message is one line an
operator can act on, and names the file."""

from __future__ import annotations


class FetchError(Exception):
    """The fetch failed; what a ``.part`` holds is kept, for the next to resume,
    unless the message says otherwise."""


class NoRoom(FetchError):
    """The weights directory has no room for the file: placement looks elsewhere."""


class Corrupt(FetchError):
    """The bytes are not the ones expected (size or sha256); the ``.part`` is gone,
    so the next fetch starts over."""


class Stalled(FetchError):
    """No byte arrived for the fetch's ``stall_s``."""

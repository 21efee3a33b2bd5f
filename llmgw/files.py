"""Writing a file so that a crash or a reader never sees half of it."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically, the file created with ``mode``.

    A temporary sibling is created with ``O_EXCL`` and the final mode, filled,
    fsync-ed and renamed over ``path``, and the directory is fsync-ed: a crash
    leaves the old file or the new one, never half of one, and a secret never
    exists, even briefly, with wider permissions than ``mode``.

    Raises:
        OSError: the file could not be written; no temporary file is left.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class KeptFile:
    """A file saved whole (``write_atomic``) again and again, as its owner changes: a
    save that fails is said once in ``log`` (not at every try, while the reason stays
    the same), and the first that succeeds after, once. ``what``: the file in words
    ("tenants' usage"); ``kept``: what its owner does meanwhile, in words."""

    def __init__(self, path: Path, what: str, kept: str, log: logging.Logger) -> None:
        self.path = path
        self.what = what
        self.kept = kept
        self.log = log
        self.unsaved = ""  # why the last save failed ("" once one succeeds)

    def save(self, data: bytes) -> bool:
        """Write ``data``; False when it could not be (said, the first time)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, data)
        except OSError as exc:
            why = f"{exc.strerror or exc}"
            if why != self.unsaved:
                self.log.error("%s not saved to %s: %s; %s", self.what, self.path, why, self.kept)
            self.unsaved = why
            return False
        if self.unsaved:
            self.log.info("%s saved to %s again", self.what, self.path)
        self.unsaved = ""
        return True

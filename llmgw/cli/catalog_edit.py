"""Edits of the catalog file by ``ctl``: the one place that rewrites it.

The catalog is a file the operator writes and keeps (comments, order, layout);
the server only reads it (``controlplane.catalog``). An edit here keeps what
it does not change: the text is parsed with tomlkit, which round-trips it, one
table is changed, and the text is written back whole. Every write goes through
``edit``:

- the change is a function of the text, so it is tried (and refused, in words)
  before anything is written, and a change that changes nothing writes nothing;
- the file is replaced atomically with its own mode (``files.write_atomic``): a
  server reloading it meanwhile reads the old catalog or the new, never half;
- what changed is returned as a unified diff, for the operator to review before
  ``llmgw ctl reload`` applies it.
"""

from __future__ import annotations

import datetime
import difflib
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmgw.bench.results import Recommendation
from llmgw.cli.admin_client import CtlError
from llmgw.config import ServerConfig, load_config
from llmgw.config.loader import read_text
from llmgw.config.schema import resolve
from llmgw.files import write_atomic

if TYPE_CHECKING:
    from tomlkit import TOMLDocument

# tomlkit is imported where a catalog is edited: every `llmgw` command (the daemons
# too) imports this module through the CLI, and only `ctl bench --write` needs it


def of_server(config: Path) -> Path:
    """The catalog the server's config ``config`` names.

    Raises:
        CtlError: it names none.
        ConfigError: the config cannot be read.
    """
    cfg, base = load_config(ServerConfig, config)
    if not cfg.catalog:
        raise CtlError(f"{config} names no catalog")
    return resolve(base, cfg.catalog)


def read(path: Path) -> str:
    """The catalog's text (``ConfigError`` where it cannot be read)."""
    return read_text(path, "catalog")


def edit(path: Path, change: Callable[[str], str], after: str) -> str:
    """Rewrite the catalog at ``path`` as ``change`` makes its text; the unified diff
    (its new side labelled ``after``), or "" where nothing changes and nothing is
    written.

    Raises:
        CtlError: ``change`` refuses the text, or the file cannot be written.
        ConfigError: the file cannot be read.
    """
    before = read(path)
    text = change(before)
    if text == before:
        return ""
    diff = "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            text.splitlines(keepends=True),
            f"{path} (before)",
            f"{path} ({after})",
        )
    )
    try:
        write_atomic(path, text.encode(), stat.S_IMODE(path.stat().st_mode))
    except OSError as exc:
        raise CtlError(f"cannot write {path}: {exc.strerror or exc}") from None
    return diff


def check_profile(text: str, model: str, profile: str, where: str) -> None:
    """Whether the catalog ``text`` (read from ``where``) has ``profile`` of ``model``,
    as an edit of it would need (``CtlError`` where not)."""
    _profile(_parse(text, where), model, profile, where)


def with_routing(text: str, model: str, profile: str, rec: Recommendation, where: str) -> str:
    """The catalog's text with the profile's ``routing`` set to the recommendation; its
    comments and the rest of its layout kept."""
    import tomlkit

    doc = _parse(text, where)
    entry = _profile(doc, model, profile, where)
    routing = tomlkit.table()
    routing.add("weight", rec.weight)
    routing.add("target_waiting", rec.target_waiting)
    if rec.kv_ceiling is not None:
        routing.add("kv_ceiling", rec.kv_ceiling)
    routing.comment(f"from llmgw ctl bench, {datetime.date.today().isoformat()}")
    entry["routing"] = routing
    return tomlkit.dumps(doc)


def _parse(text: str, where: str) -> TOMLDocument:
    import tomlkit
    import tomlkit.exceptions

    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise CtlError(f"{where} is not TOML: {exc}") from None


def _profile(doc: TOMLDocument, model: str, profile: str, where: str) -> Any:
    """The ``[[models.MODEL.profiles]]`` table named ``profile``."""
    try:
        profiles = doc["models"][model]["profiles"]
        return next(p for p in profiles if p.get("name") == profile)
    except (KeyError, StopIteration, TypeError):
        raise CtlError(f"{where} has no profile {profile!r} of model {model!r}") from None

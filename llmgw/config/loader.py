"""Load a TOML file into a typed config, apply ``KEY=VALUE`` overrides, validate.

Overrides are applied to the raw mapping *before* it is typed, so a value given
on the command line is checked by exactly the same rules as one in the file.
Unknown keys are refused (a typo in a config file must not silently fall back
to a default). Relative paths are resolved against the config file's folder,
so a config works from any working directory.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from llmgw.config.errors import ConfigError

T = TypeVar("T", bound=msgspec.Struct)

_AT = re.compile(r"\s*-\s*at\s*`\$(?P<path>[^`]*)`\s*$")


def load_config(
    kind: type[T], path: str | Path | None, overrides: Sequence[str] = ()
) -> tuple[T, Path]:
    """Return the validated config and the folder relative paths are resolved against.

    Raises:
        ConfigError: naming the file (or "command line"), the key and the problem.
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    base = Path.cwd()
    if path is not None:
        p = Path(path)
        source = str(p)
        base = p.resolve().parent
        raw = parse_toml(read_text(p), source)
    for item in overrides:
        _apply_override(raw, item)
    try:
        config = msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        key, problem = _split_validation(str(exc))
        if key and _key_from_override(key, overrides):
            source = f"{source} (overridden on the command line)"
        raise ConfigError(source, key, problem) from None
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            if exc.key and _key_from_override(exc.key, overrides):
                source = f"{source} (overridden on the command line)"
            raise ConfigError(source, exc.key, exc.problem) from None
    return config, base


def read_text(path: Path, key: str = "", *, max_bytes: int | None = None) -> str:
    """A config-like file's text (a config, a catalog, a token), as UTF-8; with
    ``max_bytes``, a larger file is refused before it is read.

    Raises:
        ConfigError: one line naming the file (and the key that named it) and why
            it cannot be used: missing, unreadable, a folder, too large, not UTF-8.
            No bad file is a traceback.
    """
    try:
        with open(path, "rb") as f:
            if max_bytes is None:
                data = f.read()
            else:
                size = os.fstat(f.fileno()).st_size
                # read one byte more than allowed: a file growing meanwhile is caught too
                data = b"" if size > max_bytes else f.read(max_bytes + 1)
                if size > max_bytes or len(data) > max_bytes:
                    raise ConfigError(
                        str(path),
                        key,
                        f"{_mib(max(size, len(data)))} MiB, over the {_mib(max_bytes)} MiB"
                        " this file may be: nothing was read from it (shrink it)",
                    )
    except OSError as exc:
        raise ConfigError(str(path), key, f"cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            str(path),
            key,
            f"not UTF-8 text (byte {data[exc.start]:#04x} on line {line}): save it as UTF-8",
        ) from None


def _mib(n: int) -> str:
    """Bytes as MiB with one decimal, rounded up (a size over a limit never reads as it)."""
    return f"{math.ceil(n * 10 / 2**20) / 10:.1f}".removesuffix(".0")


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML text -> a mapping; a decode error (or a nesting too deep to parse) is a
    ConfigError naming ``source``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(source, "", "not valid TOML: nested too deeply") from None


def parse_hostport(
    value: str, *, key: str = "", default_port: int | None = None
) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, or (with a default port) a bare host -> (host, port)."""
    text = value.strip()
    port_text: str | None
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :] if end >= 0 else "x"
        if end < 0 or (rest and not rest.startswith(":")):
            raise ConfigError("", key, f"{value!r} is not [address]:port")
        host, port_text = text[1:end], (rest[1:] if rest else None)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:  # a name, an IPv4 address or a bare IPv6 literal: no port
        host, port_text = text, None
    if not host:
        raise ConfigError("", key, f"{value!r} has no host")
    if port_text is None:
        if default_port is None:
            raise ConfigError("", key, f"{value!r} has no port (write host:port)")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError("", key, f"{value!r}: port {port_text!r} is not a number in 0-65535")
    return host, int(port_text)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("command line", item, "an override is written KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = text  # a bare word is a string
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError("command line", key, f"{part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _split_validation(message: str) -> tuple[str, str]:
    """msgspec's "Expected `int`, got `str` - at `$.a.b`" -> ("a.b", "expected `int`, got `str`")."""
    m = _AT.search(message)
    path, problem = (
        ("", message) if m is None else (m.group("path").lstrip("."), message[: m.start()])
    )
    unknown = re.match(r"Object contains unknown field `([^`]*)`", problem)
    if unknown:
        field = unknown.group(1)
        return (f"{path}.{field}" if path else field), "unknown key (is it misspelt?)"
    return path, problem.replace("Expected", "expected", 1)


def _key_from_override(key: str, overrides: Sequence[str]) -> bool:
    """Whether an override set this key (or a key inside it, or the section holding it)."""
    for item in overrides:
        given = item.partition("=")[0].strip()
        if given == key or given.startswith(key + ".") or key.startswith(given + "."):
            return True
    return False

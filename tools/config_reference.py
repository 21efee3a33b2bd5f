"""The configuration reference, generated from the schema so that it cannot drift.

Every key of ``server.toml``, ``agent.toml``, ``router.toml`` and the catalog,
with its type, its default and what it does: the words are the comments
beside (or just above) each field in ``llmgw/config/schema.py`` and
``llmgw/controlplane/catalog.py``, the types and defaults are msgspec's.

    python -m tools.config_reference            # print it
    python -m tools.config_reference --write    # write docs/configuration.md
    python -m tools.config_reference --check    # exit 1 if docs/configuration.md is stale

``tests/config/test_reference.py`` runs the check, and fails on a key with no
words.
"""

from __future__ import annotations

import argparse
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from llmgw.config.schema import AgentConfig, ServerConfig, StandaloneRouterConfig
from llmgw.controlplane.catalog import Profile, Routing, _ModelEntry

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"

FILES: list[tuple[str, str, type[msgspec.Struct], str]] = [
    (
        "server.toml",
        "`llmgw server --config server.toml`",
        ServerConfig,
        "packaging/server.example.toml",
    ),
    (
        "agent.toml",
        "`llmgw agent --config agent.toml`",
        AgentConfig,
        "packaging/agent.example.toml",
    ),
    (
        "router.toml",
        "`llmgw router --config router.toml` (a standalone router)",
        StandaloneRouterConfig,
        "packaging/router.example.toml",
    ),
]


class Key(msgspec.Struct, frozen=True):
    key: str  # dotted, as --set takes it; [[x]] tables as x[]
    type: str
    default: str
    words: str


def comments(cls: type) -> dict[str, str]:
    """The words for each field of a struct class: its trailing comment (and those on
    the lines of a value that spans several), after the comment block just above it."""
    source = inspect.getsource(cls)
    words: dict[str, list[str]] = {}
    above: list[str] = []
    current: str | None = None
    depth = 0
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and depth == 0:
            if tok.string == "def":
                break  # methods follow the fields
            if i + 1 < len(tokens) and tokens[i + 1].string == ":":
                current = tok.string
                words[current], above = above, []
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if current is not None:
                words[current].append(text)
            elif tok.line.strip().startswith("#"):
                above.append(text)
        elif tok.type == tokenize.NEWLINE and depth == 0:
            current = None
        elif tok.type == tokenize.NL and not tok.line.strip():
            above = []  # a blank line: the block above was not about the next field
    return {name: " ".join(w).strip() for name, w in words.items()}


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(f'"{a}"' for a in typing.get_args(annotation))
    if origin is list:
        (arg,) = typing.get_args(annotation)
        return f"list of {_type(arg)}"
    if origin is dict:
        k, v = typing.get_args(annotation)
        return f"table of {_type(k)} to {_type(v)}"
    if annotation is type(None):
        return "none"
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return "table"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    value = field.default
    if value is msgspec.NODEFAULT:
        value = field.default_factory()
    if isinstance(value, msgspec.Struct):
        return ""
    if value is None:
        return "unset"
    if value == "" or value == [] or value == {}:
        return f"`{msgspec.json.encode(value).decode()}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{msgspec.json.encode(value).decode()}`"


def _struct_of(annotation: Any) -> type[msgspec.Struct] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, msgspec.Struct):
            return candidate
    return None


def keys(cls: type[msgspec.Struct], prefix: str = "") -> Iterator[Key]:
    words = comments(cls)
    hints = typing.get_type_hints(cls)
    for field in msgspec.structs.fields(cls):
        dotted = f"{prefix}{field.encode_name}"
        annotation = hints[field.name]
        inner = _struct_of(annotation)
        listed = typing.get_origin(annotation) is list
        if inner is not None and inner is not cls:
            table = f"list of tables ([[{dotted}]])" if listed else f"table ([{dotted}])"
            others = [a for a in typing.get_args(annotation) if a not in (inner, type(None))]
            if others and not listed:  # a value or a table (a count, or a range)
                table = " or ".join([*(_type(a) for a in others), table])
            yield Key(
                dotted + ("[]" if listed else ""),
                table,
                _default(field) if others and not listed else "",
                words.get(field.name, "") or (inner.__doc__ or "").strip().split("\n")[0],
            )
            yield from keys(inner, dotted + ("[]." if listed else "."))
            continue
        yield Key(dotted, _type(annotation), _default(field), words.get(field.name, ""))


def catalog_keys() -> Iterator[Key]:
    yield Key("models.NAME", "table ([models.NAME])", "", "one model; NAME is what clients ask for")
    for k in keys(_ModelEntry, "models.NAME."):
        if k.key.startswith("models.NAME.profiles[]") and not k.key.endswith("profiles[]"):
            continue
        if k.key.startswith("models.NAME.routing."):
            continue
        yield k
    yield from keys(Profile, "models.NAME.profiles[].")
    yield from keys(Routing, "models.NAME.routing.")


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m tools.config_reference --write` from the schema",
        "(`llmgw/config/schema.py`, `llmgw/controlplane/catalog.py`); a test fails when",
        "this file and the schema disagree. Every key can also be set on the command",
        "line with `--set section.key=value`. Durations end in `_s` (seconds), sizes in",
        "`_mb` (MiB) or `_gb` (GiB). An unknown key is refused, naming the file and the",
        "key.",
        "",
    ]
    sections = [(name, how, keys(cls), example) for name, how, cls, example in FILES]
    sections.append(
        (
            "catalog.toml",
            "llmgw server, as its `catalog` key names it; `llmgw ctl reload` reads it again",
            catalog_keys(),
            "packaging/catalog.example.toml",
        )
    )
    for name, how, found, example in sections:
        out += [f"## {name}", "", f"Read by {how}. Example: `{example}`.", ""]
        out += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        for k in found:
            words = k.words.replace("|", "\\|")
            out.append(f"| `{k.key}` | {k.type} | {k.default} | {words} |")
        out.append("")
    return "\n".join(out)


def undocumented() -> list[str]:
    """Every key with no words beside it in the schema."""
    found = [k for _, _, cls, _ in FILES for k in keys(cls)] + list(catalog_keys())
    return [k.key for k in found if not k.words]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    group.add_argument("--check", action="store_true", help="exit 1 if that file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
        return 0
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(
                f"{DOC.relative_to(ROOT)} is stale: run python -m tools.config_reference --write",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a request may ask of an engine: inputs the engines choke on, refused before one sees them.

Theory of operation
-------------------
The router reads a routed request's body for its ``model`` and ``stream`` only
and forwards it as it came, so whatever else it holds reaches an engine. Some
of it can kill the engine or hold it for as long as it likes. Measured on
llama.cpp's ``llama-server`` (8 MiB stack, the tiny test model):

- a GBNF ``grammar`` nesting parentheses 20,000 deep: SIGSEGV (15,000 passes);
  a chain of 200,000 rule references: SIGSEGV (30,000 passes);
- a ``response_format`` JSON schema of objects nested 6,000 deep: SIGSEGV;
  arrays 10,000 deep in ``json_schema``: 28 s of the engine's loop; a tool's
  parameters 3,000 objects deep: 8 s;
- any field of the body nesting JSON arrays 300,000 deep: SIGSEGV;
- a schema of 1,500 optional properties (42 KiB): 8.5 s, then refused (580,
  16 KiB: 0.56 s); a grammar of 100,000 alternatives (1 MiB): 22 s.

So, before any engine sees it (``read``), the body's JSON may nest at most
``json_depth`` levels (which bounds every schema, tool and content part in
it), each grammar (llama.cpp's ``grammar``, vLLM's ``guided_grammar``), regex
(``guided_regex``) or choice list may be ``grammar_bytes`` long and nest its
groups ``grammar_depth`` deep, and each schema (``json_schema``,
``response_format``, ``guided_json``, and the parts of vLLM's
``structured_outputs``) ``schema_bytes`` long; a schema sent as a string of
JSON is read and held to the same depth. The refusal is a 400 in OpenAI's
format naming the field (``param``) and the limit's key. A limit of 0 is off.
A field of another type than the engines take is left to the engine to refuse.

The depth costs one count of brackets for most bodies: a body with no more
``[`` and ``{`` than the limit cannot nest deeper. Only a body with more is
decoded whole and walked, container by container, and the path to the point
too deep is found only for a body refused. Measured per body (``read`` against
the decode of ``model`` and ``stream`` alone): a 2 KB chat 2.1 us (0.6), 5 KB
of code in a message 8.6 us (1.4), thirty tools 58 us (4.0). JSON nested deeper than the decoder's own recursion
bound (about a thousand levels) is refused as too deep, never a 500.

Pure: no I/O and no trio.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import attrs
import msgspec

_NONE = msgspec.Raw()


@attrs.frozen
class Limits:
    """The bounds ``read`` holds a body to; 0: no bound."""

    json_depth: int = 128  # router.max_json_depth
    grammar_depth: int = 256  # router.max_grammar_depth
    grammar_bytes: int = 32 * 1024  # router.max_grammar_kb
    schema_bytes: int = 16 * 1024  # router.max_schema_kb


OFF = Limits(0, 0, 0, 0)


@attrs.frozen
class Refusal:
    """Why a body is refused: the metric's label, the client's words, the field."""

    why: (
        str  # llmgw_router_refused{why}: json, json_depth, grammar_depth, grammar_size, schema_size
    )
    message: str
    param: str | None = None
    code: str | None = None


class Body(msgspec.Struct):
    """What the router reads of a routed request's body (the rest is forwarded unread)."""

    model: str = ""
    stream: bool = False
    # what it may generate at most (a tenant's tokens per minute reserve it)
    max_tokens: int | float | None = None
    max_completion_tokens: int | float | None = None

    @property
    def completion_bound(self) -> int | None:
        """The most tokens it asks to generate; None: it sets no bound."""
        bound = self.max_completion_tokens
        if bound is None:
            bound = self.max_tokens
        return None if bound is None else max(0, int(bound))

    # held as their JSON text, checked by ``read``
    grammar: msgspec.Raw = _NONE
    json_schema: msgspec.Raw = _NONE
    response_format: msgspec.Raw = _NONE
    guided_json: msgspec.Raw = _NONE
    guided_grammar: msgspec.Raw = _NONE
    guided_regex: msgspec.Raw = _NONE
    guided_choice: msgspec.Raw = _NONE
    structured_outputs: msgspec.Raw = _NONE


_decoder = msgspec.json.Decoder(Body)
# what each structured field is, for its bounds: grammar (GBNF), regex, choice, schema
_FIELDS = (
    ("grammar", "grammar"),
    ("guided_grammar", "grammar"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("json_schema", "schema"),
    ("response_format", "schema"),
    ("guided_json", "schema"),
)
_STRUCTURED = {  # vLLM's structured_outputs, part by part
    "grammar": "grammar",
    "regex": "regex",
    "choice": "choice",
    "json": "schema",
    "structural_tag": "schema",
}


def read(data: bytes, limits: Limits) -> Body | Refusal:
    """The body, or why it is refused (see the module docstring)."""
    deep = _too_deep(data, limits.json_depth)
    if deep is not None:
        return deep
    try:
        body = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        return Refusal("json", f"the body is not the JSON this endpoint takes: {exc}")
    except RecursionError:  # the depth bound is off
        return Refusal(
            "json_depth",
            "the body's JSON nests too deep for the router to read",
            code="json_too_deep",
        )
    for name, kind in _FIELDS:
        raw = getattr(body, name)
        if raw:
            found = _check(name, kind, bytes(raw), limits)
            if found is not None:
                return found
    if body.structured_outputs:
        found = _check_structured(bytes(body.structured_outputs), limits)
        if found is not None:
            return found
    return body


# ---------------------------------------------------------------------------- depth


def _too_deep(data: bytes, limit: int) -> Refusal | None:
    if limit <= 0 or data.count(b"[") + data.count(b"{") <= limit:
        return None  # fewer openers than the limit: it cannot nest deeper
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None  # not JSON: the decoder says what is wrong
    except RecursionError:  # too deep to decode: found by its bytes
        field = _deep_field(data, limit)
        return _deep_refusal(None if field is None else (field,), limit)
    if not _deeper(doc, limit):
        return None
    return _deep_refusal(deepest(doc, limit), limit)


def _deeper(doc: object, limit: int) -> bool:
    """Whether ``doc`` nests deeper than ``limit``: ``deepest`` without the paths, at
    a third of its cost."""
    if not isinstance(doc, (dict, list)):
        return False
    stack: list[tuple[dict[str, object] | list[object], int]] = [(doc, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return True
        inner = depth + 1
        for value in node.values() if type(node) is dict else node:
            kind = type(value)
            if kind is dict or kind is list:
                push((value, inner))  # type: ignore[arg-type]
    return False


_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _deep_field(data: bytes, limit: int) -> str | None:
    """The top-level field of a JSON object under which it nests deeper than
    ``limit`` (found without decoding it: it is too deep for the decoder)."""
    depth = 0
    key = b""
    field = b""
    for m in _TOKENS.finditer(data):
        token = m.group()
        if token[0] == 0x22:  # a string: at the top level, the key of what follows
            if depth == 1:
                key = token
        elif token in b"[{":
            depth += 1
            if depth == 2:
                field = key
            if depth > limit:
                try:
                    found = msgspec.json.decode(field)
                except msgspec.DecodeError:
                    return None
                return found if isinstance(found, str) else None
        else:
            depth -= 1
    return None


def deepest(doc: object, limit: int) -> tuple[str | int, ...] | None:
    """The path to the first point where ``doc`` nests deeper than ``limit`` (a
    top-level object or array is one level), or None when it does not."""
    stack: list[tuple[object, int, tuple[str | int, ...]]] = [(doc, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            return path
        items: Iterator[tuple[str | int, object]]
        if isinstance(node, dict):
            items = iter(node.items())
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (*path, key)))
    return None


def _deep_refusal(path: tuple[str | int, ...] | None, limit: int, field: str = "") -> Refusal:
    """Too deep: the body (``field`` ""), or the schema a string ``field`` holds."""
    at = f" in {_dotted(path)}" if path else ""
    what = f"the schema in {field}" if field else "the body's JSON"
    param = field or (str(path[0]) if path else None)
    return Refusal(
        "json_depth",
        f"{what} nests deeper than {limit} levels{at} (router.max_json_depth)",
        param,
        "json_too_deep",
    )


def _dotted(path: tuple[str | int, ...], most: int = 6) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:most]]
    text = "".join(parts).lstrip(".")
    return text + ("..." if len(path) > most else "")


# ---------------------------------------------------------------------------- fields


def _check(name: str, kind: str, raw: bytes, limits: Limits) -> Refusal | None:
    """The bounds of one structured field, given as its JSON text."""
    if raw == b"null":
        return None
    if kind == "schema":
        return _check_schema(name, raw, limits)
    if kind == "choice":
        return _size(name, len(raw), limits.grammar_bytes, "grammar_size", "max_grammar_kb")
    try:
        text = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None  # bounded by the body's depth already; the engine refuses it
    if not isinstance(text, str):
        return _size(name, len(raw), limits.grammar_bytes, "grammar_size", "max_grammar_kb")
    size = len(text.encode())
    found = _size(name, size, limits.grammar_bytes, "grammar_size", "max_grammar_kb")
    if found is not None or limits.grammar_depth <= 0:
        return found
    too_deep = gbnf_too_deep if kind == "grammar" else regex_too_deep
    if too_deep(text, limits.grammar_depth):
        return Refusal(
            "grammar_depth",
            f"{name} nests its groups deeper than {limits.grammar_depth} levels "
            "(router.max_grammar_depth)",
            name,
            "grammar_too_deep",
        )
    return None


def _check_schema(name: str, raw: bytes, limits: Limits) -> Refusal | None:
    found = _size(name, len(raw), limits.schema_bytes, "schema_size", "max_schema_kb")
    if found is not None or not raw.startswith(b'"') or limits.json_depth <= 0:
        return found
    # a schema sent as a string of JSON (vLLM's guided_json takes one): its depth too
    try:
        doc = msgspec.json.decode(msgspec.json.decode(raw, type=str))
    except (msgspec.DecodeError, RecursionError) as exc:
        if isinstance(exc, RecursionError):
            return _deep_refusal(None, limits.json_depth, name)
        return None  # not JSON: the engine says so
    path = deepest(doc, limits.json_depth)
    return None if path is None else _deep_refusal(path, limits.json_depth, name)


def _check_structured(raw: bytes, limits: Limits) -> Refusal | None:
    try:
        parts = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):
        return None  # not an object: the engine says what it takes
    for part, value in parts.items():
        kind = _STRUCTURED.get(part)
        if kind is not None and value:
            found = _check(f"structured_outputs.{part}", kind, bytes(value), limits)
            if found is not None:
                return found
    return None


def _size(name: str, size: int, limit: int, why: str, key: str) -> Refusal | None:
    if limit <= 0 or size <= limit:
        return None
    code = "grammar_too_large" if why == "grammar_size" else "schema_too_large"
    return Refusal(
        why,
        f"{name} is {_kib(size)} KiB; the most this endpoint takes is {_kib(limit)} KiB "
        f"(router.{key})",
        name,
        code,
    )


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}".removesuffix(".0")


# ---------------------------------------------------------------------------- nesting

# GBNF (llama.cpp, and vLLM's xgrammar EBNF): a literal, a character class and a
# comment are read whole, so a parenthesis inside one does not count
_GBNF = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[[^\]\\]*(?:\\.[^\]\\]*)*\]|#[^\n]*|[()]', re.DOTALL)
# a regex: an escape and a character class are read whole
_REGEX = re.compile(r"\\.|\[\^?\]?[^\]\\]*(?:\\.[^\]\\]*)*\]|[()]", re.DOTALL)


def gbnf_too_deep(text: str, limit: int) -> bool:
    """Whether a GBNF grammar nests its groups deeper than ``limit``."""
    return _too_deep_groups(_GBNF, text, limit)


def regex_too_deep(text: str, limit: int) -> bool:
    """Whether a regex nests its groups deeper than ``limit``."""
    return _too_deep_groups(_REGEX, text, limit)


def _too_deep_groups(tokens: re.Pattern[str], text: str, limit: int) -> bool:
    if text.count("(") <= limit:
        return False  # it cannot nest deeper than the parentheses it has
    depth = 0
    for m in tokens.finditer(text):
        token = m.group()
        if token == "(":
            depth += 1
            if depth > limit:
                return True
        elif token == ")":
            depth = max(0, depth - 1)
    return False

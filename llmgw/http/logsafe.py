"""Text from clients and engines, made safe to log: one line, and nothing forged.

A percent-decoded path, a ``model`` from a JSON body, a header, an engine's
message: each may hold a newline (a forged log line), a carriage return or
an escape sequence (a rewritten terminal), or a right-to-left override (a
line that reads other than it is). ``printable`` writes every character
Python does not call printable as a ``\\xNN`` / ``\\uNNNN`` escape, and a
backslash as ``\\\\``, so an escape in the log always means an escape. Every
log call in ``llmgw.http`` and ``llmgw.router`` that writes such text passes
it through here.
"""

from __future__ import annotations

__all__ = ["printable"]


def _escape(ch: str, field: bool) -> str:
    if ch == "\\":
        return "\\\\"
    if ch == " ":
        return "\\x20" if field else ch
    if ch.isprintable():
        return ch
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str, *, field: bool = False) -> str:
    """``text`` with control and other non-printable characters escaped.

    ``field``: the text is one ``key=value`` field of a line split on spaces
    (the access log), so a space is escaped too and cannot start a forged field.
    The common case, text with nothing to escape, returns ``text`` itself."""
    if text.isprintable() and "\\" not in text and not (field and " " in text):
        return text
    return "".join([_escape(ch, field) for ch in text])

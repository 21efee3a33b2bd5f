"""How another engine renders a broken stream's request, for ``Resumer.carry_on``.

The new engine tokenizes the original request to its prompt and checks the ids
of the tokens relayed so far by detokenizing them (see ``llmgw.router.resume``),
in the calls its adapter's ``tokens.render`` makes (``llmgw.engines.tokens``);
``ask`` is the shell's call to the engine, so this module does no I/O itself.
"""

from __future__ import annotations

import contextlib

import msgspec

from llmgw.engines.tokens import Ask, Tokens
from llmgw.router.resume import Transcript


def said(data: bytes, limit: int = 320) -> str:
    """What an engine's error answer says, for one line: its ``error.message`` (or the
    body), whitespace folded; a long one keeps its start and its end, where engines
    put the cause (llama.cpp ends a template's failure with the exception it raised)."""
    text = data.decode("utf-8", "replace")
    with contextlib.suppress(msgspec.DecodeError):
        found = msgspec.json.decode(data)
        error = found.get("error") if isinstance(found, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            text = message
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return f"{text[: limit // 3]} ... {text[-(limit - limit // 3) :]}"


class Refused(Exception):
    """An engine answered a step of rendering a continuation with other than 200."""


async def render(ask: Ask, t: Transcript, tokens: Tokens) -> tuple[list[int], list[int]]:
    """The request's prompt as the new engine tokenizes it, and the ids relayed (those
    the first engine sent, if the new one reads them as the text relayed; else the
    text relayed, tokenized), as the new engine's family renders them (``tokens``).
    ``t`` is read, not changed: ``Transcript.continuation`` takes both."""
    return await tokens.render(ask, t.body, t.chat, list(t.ids), t.relayed())

"""How another engine renders a broken stream's request, for ``Resumer.carry_on``.

The new engine tokenizes the original request to its prompt (llama.cpp
``/apply-template`` and ``/tokenize``; vLLM ``/tokenize``) and checks the ids of
the tokens relayed so far by detokenizing them (see ``llmgw.router.resume``);
``ask`` is the shell's call to the engine, so this module does no I/O itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import msgspec

from llmgw.router import resume
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


Ask = Callable[[str, dict[str, object]], Awaitable[dict[str, object]]]
# what of a chat request shapes its prompt on vLLM's /tokenize
_VLLM_CHAT = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
)


async def render(ask: Ask, t: Transcript) -> tuple[list[int], list[int]]:
    """The request's prompt as the new engine tokenizes it, and the ids relayed (those
    the first engine sent, if the new one reads them as the text relayed; else the
    text relayed, tokenized). ``t`` is read, not changed: ``Transcript.continuation``
    takes both."""
    body = t.body
    relayed = t.relayed()
    ids = list(t.ids)
    prompt_in = body.get("prompt")
    if t.family == resume.LLAMA_CPP:
        if t.chat:
            prompt_in = (await ask("/apply-template", dict(body)))["prompt"]
        if not isinstance(prompt_in, list):
            found = await ask(
                "/tokenize", {"content": prompt_in, "add_special": True, "parse_special": True}
            )
            prompt_in = found["tokens"]
        text = (await ask("/detokenize", {"tokens": ids}))["content"] if ids else ""
        if text != relayed:
            found = await ask(
                "/tokenize", {"content": relayed, "add_special": False, "parse_special": False}
            )
            ids = _ints(found["tokens"])
    else:
        model = body.get("model")
        if t.chat:
            shaping = {k: body[k] for k in _VLLM_CHAT if k in body}
            prompt_in = (await ask("/tokenize", {"model": model, **shaping}))["tokens"]
        elif not isinstance(prompt_in, list):
            found = await ask("/tokenize", {"model": model, "prompt": prompt_in})
            prompt_in = found["tokens"]
        text = (await ask("/detokenize", {"model": model, "tokens": ids}))["prompt"] if ids else ""
        if text != relayed:
            found = await ask(
                "/tokenize", {"model": model, "prompt": relayed, "add_special_tokens": False}
            )
            ids = _ints(found["tokens"])
    return _ints(prompt_in), ids


def _ints(found: object) -> list[int]:
    if not isinstance(found, list) or not all(isinstance(i, int) for i in found):
        raise TypeError(f"not a list of token ids: {str(found)[:100]}")
    return found

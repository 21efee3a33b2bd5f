"""What a stream has said so far, and how another replica carries it on.

Theory of operation
-------------------
A streamed chat or completion that can be carried on (``plan``: one choice, no
tools, no forced format or grammar, no log-probabilities asked for) asks its engine for
the ids of the tokens it generates, as the engine's adapter says (its ``tokens``,
``llmgw.engines.tokens``: llama.cpp gives them with each token's probability,
vLLM in ``token_ids``). Each event is passed on with those fields taken out
again, and the ``Transcript`` keeps what a continuation needs: the response's
id, created time, model and choice index, and the ids and text of the tokens
relayed.

When the stream breaks after its first event, the router (``Resumer.carry_on``,
in ``llmgw.router.resumer``) picks another replica of the same engine family,
has it render the original request to prompt tokens (its adapter's
``tokens.render``), and asks its ``/v1/completions`` for the rest of
``max_tokens`` from the prompt plus the tokens already relayed, with the
request's own sampling settings (``continuation``). Its events are rewritten
into the original's shape (``translate``): chat deltas or completion text,
under the original id, created time, model and index, so the client reads one
unbroken stream. Under greedy decoding the text is exactly an unbroken run's.

The ids are checked before they are trusted: the new engine detokenizes them,
and only when that gives back the text relayed are they used. llama.cpp sends
no event for a token whose text it holds back (half of a UTF-8 character, the
start of a stop string) and releases that text with the next one; then the
text relayed is tokenized instead, which carries it on without a seam but may
split it into other tokens than were generated.

A stream that cannot be carried on ends with an error event in OpenAI's
format that says why (``Transcript.refused`` for the request itself; the
resumer's reasons for the fleet).

Pure: no I/O and no trio. A ``Transcript`` changes only through its own methods;
the relay, the resumer and ``render`` read it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import msgspec

from llmgw import engines
from llmgw.engines.tokens import Tokens
from llmgw.router import usage

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_END = b"\n\n"  # after each event

# What shapes sampling and ending, sent on with a continuation as the client set it:
# OpenAI's names, then the engines' own (``engines.carried_fields``); an engine ignores
# what it does not know. What constrains a reply's whole text is named by the engines
# alone (``engines.constraint_fields``), and not carried on.
_CARRIED = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream_options",
)


@attrs.frozen
class NotResumed:
    """Why a stream cannot go on from another replica: the metric's label, and words."""

    label: str
    words: str


def family(engine: str) -> str:
    """Whose token ids an engine speaks (its adapter's ``tokens.family``: "llama.cpp",
    "vllm" for vLLM over Ray too), or "" for one that gives none."""
    found = engines.tokens(engine)
    return found.family if found is not None else ""


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = body.get(name)
        if isinstance(value, int) and value >= 0:
            return value
    return None


class Transcript:
    """A resumable stream: its request, and what has been relayed of its reply.

    It changes only through its own methods, as the stream goes: ``request`` (the
    engine family it is sent to), ``observe`` and ``translate`` (each event relayed),
    ``opening`` and ``ending`` (the events it makes itself), ``done`` (the last event
    relayed) and ``continuation`` (a new replica's reading of the tokens relayed).
    The rest of the router reads it."""

    __slots__ = (
        "_body",
        "_chat",
        "_created",
        "_fingerprint",
        "_finished",
        "_id",
        "_ids",
        "_index",
        "_keep",
        "_last",
        "_model",
        "_prompt_tokens",
        "_reasoning",
        "_text",
        "_tokens",
        "_usage_asked",
    )

    def __init__(self, body: dict[str, Any], chat: bool) -> None:
        self._body = body
        self._chat = chat
        self._tokens: Tokens | None = None  # its engine family's, once one is asked
        self._keep = bool(body.get("return_token_ids"))  # the client asked for token ids
        self._usage_asked = usage.asked(body)  # else the engine is asked, the client not told
        self._last = usage.Last()  # where not: the choice's last event, held for its extras
        self._id: Any = None
        self._created: Any = None
        self._model: Any = None
        self._fingerprint: Any = None
        self._index: Any = 0
        self._ids: list[int] = []  # of the tokens relayed
        self._text: list[str] = []  # relayed, piece by piece
        self._finished = False  # an event with a finish reason was relayed
        self._reasoning = False  # reasoning was relayed apart from the content
        self._prompt_tokens = 0  # as the last engine to render the request counted them

    @property
    def body(self) -> Mapping[str, Any]:
        """The client's request, decoded."""
        return self._body

    @property
    def chat(self) -> bool:
        """A chat (else a completion)."""
        return self._chat

    @property
    def family(self) -> str:
        """Whose token ids it holds (``family``); "" until an engine has been asked."""
        return self._tokens.family if self._tokens is not None else ""

    @property
    def id(self) -> str | None:
        """The stream's id, once its first event is relayed (or its ``opening`` made)."""
        return None if self._id is None else str(self._id)

    @property
    def finished(self) -> bool:
        """Its last token, or its last event, was relayed: nothing more to carry on."""
        return self._finished

    @property
    def ids(self) -> Sequence[int]:
        """The ids of the tokens relayed, as the last engine read them."""
        return self._ids

    @property
    def tokens(self) -> int:
        """How many tokens were relayed (the ids', else the text's pieces)."""
        return len(self._ids) or len(self._text)

    def request(self, engine: str) -> bytes | None:
        """The body to send to a replica of ``engine``: the client's, asking for token
        ids; None: that engine gives none (the stream cannot be carried on)."""
        found = engines.tokens(engine)
        if found is None:
            return None
        self._tokens = found
        body = {**self._body, **found.asking}
        if not self._usage_asked:  # what it used, for its tenant
            usage.ask_of(body)
        return _encode(body)

    def observe(self, event: bytes) -> bytes | None:
        """An event of the stream's first replica, as the client gets it now (None:
        nothing now). Where the client did not ask for usage, the usage event is
        dropped, and the choice's last event held until the next (``held``) for what
        that carried (``usage.Last``): what the client gets may then be two events."""
        if not event.startswith(b"data: {"):
            return event
        obj = _decode(event[6:])
        if not self._usage_asked and (extra := usage.unasked(obj)) is not None:
            self._last.next(b"", extra)
            return None
        if self._id is None:
            self._id = obj.get("id")
            self._created = obj.get("created")
            self._model = obj.get("model")
            self._fingerprint = obj.get("system_fingerprint")
        elif "created" in obj:
            # OpenAI: every chunk of a stream has the same created time; llama.cpp
            # stamps each with the second it was sent
            obj["created"] = self._created
        if not self._keep:
            obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or ():
            self._index = choice.get("index", 0)
            if not self._keep:
                choice.pop("prompt_token_ids", None)  # vLLM's completions put them here
            if self._chat:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self._reasoning = True
            else:
                piece = choice.get("text")
            self._took(choice, piece)
        shown = b"data: " + _encode(obj)
        if self._usage_asked:
            return shown
        now = self._last.next(shown + _END)
        return now[: -len(_END)] or None

    @property
    def holding(self) -> bool:
        """A choice's last event is held (``observe``): relayed, as far as time goes."""
        return bool(self._last.event)

    def held(self) -> bytes:
        """The event held, its blank line included, when nothing more comes (its
        ``[DONE]`` follows)."""
        return self._last.flush()

    def done(self) -> None:
        """The stream's last event (``data: [DONE]``) was relayed."""
        self._finished = True

    def refused(self) -> NotResumed | None:
        """Why what was relayed cannot be carried on, if it cannot."""
        if self._reasoning:
            return NotResumed("reasoning", "its reasoning was streamed apart from its content")
        return None

    def opening(self) -> bytes | None:
        """For a stream that broke before its first event: the identity its
        continuation goes under, and a chat's opening event (its role)."""
        if self._id is not None:
            return None
        self._id = f"{'chatcmpl' if self._chat else 'cmpl'}-{secrets.token_hex(12)}"
        self._created = int(time.time())
        self._model = self._body.get("model")
        if not self._chat:
            return None
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return b"data: " + _encode(self._shell([role]))

    def remaining(self) -> int | None:
        """How many more tokens the client asked for (None: no limit)."""
        limit = _max_tokens(self._body)
        return None if limit is None else max(0, limit - len(self._ids))

    def relayed(self) -> str:
        return "".join(self._text)

    def continuation(self, prompt: list[int], ids: list[int]) -> bytes:
        """The ``/v1/completions`` body that carries the stream on from ``ids``: the
        tokens relayed as the new engine reads them (``llmgw.router.render``), which
        the transcript holds from now on, after its ``prompt``."""
        self._prompt_tokens = len(prompt)
        self._ids = list(ids)
        body: dict[str, Any] = {
            "model": self._body.get("model"),
            "prompt": prompt + self._ids,
            "stream": True,
            **{k: self._body[k] for k in _CARRIED if k in self._body},
            **{k: self._body[k] for k in engines.carried_fields() if k in self._body},
            **(self._tokens.asking if self._tokens is not None else {}),
        }
        left = self.remaining()
        if left is not None:
            body["max_tokens"] = left
        return _encode(body)

    def translate(self, event: bytes) -> bytes | None:
        """An event of a continuation, in the shape of the client's stream (None: an
        event the client's stream has no place for)."""
        if not event.startswith(b"data: {"):
            return event
        obj = _decode(event[6:])
        choices = []
        for choice in obj.get("choices") or ():
            piece = choice.get("text") or ""
            finish = choice.get("finish_reason")
            ids = self._took(choice, piece)
            if not piece and finish is None and not ids:
                continue
            shown: dict[str, Any] = (
                {"index": self._index, "delta": {"content": piece} if piece else {}}
                if self._chat
                else {"text": piece, "index": self._index}
            )
            shown["logprobs"] = None
            shown["finish_reason"] = finish
            if self._keep:
                shown["token_ids"] = ids
            choices.append(shown)
        shown_choices = b"data: " + _encode(self._shell(choices)) if choices else b""
        if not (obj.get("usage") and self._usage_asked):
            return shown_choices or None  # usage the client did not ask for is not shown
        # as OpenAI streams it: an event of its own, with no choices
        n = len(self._ids)
        counts = {"prompt_tokens": self._prompt_tokens, "completion_tokens": n}
        usage = {**self._shell([]), "usage": {**counts, "total_tokens": sum(counts.values())}}
        shown_usage = b"data: " + _encode(usage)
        return shown_choices + _END + shown_usage if shown_choices else shown_usage

    def ending(self) -> bytes:
        """The last event of a stream that reached ``max_tokens`` just as it broke."""
        self._finished = True
        shape: dict[str, Any] = (
            {"index": self._index, "delta": {}, "logprobs": None, "finish_reason": "length"}
            if self._chat
            else {"text": "", "index": self._index, "logprobs": None, "finish_reason": "length"}
        )
        return b"data: " + _encode(self._shell([shape]))

    def _shell(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """An event of the client's stream around ``choices``."""
        out: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
        }
        if self._fingerprint is not None:
            out["system_fingerprint"] = self._fingerprint
        out["choices"] = choices
        return out

    def _took(self, choice: dict[str, Any], piece: Any) -> list[int]:
        """Note the token ids (returned) and text of a choice relayed, the ids taken out
        of it as its engine family says."""
        tokens = self._tokens
        ids = tokens.took(choice, self._keep, self._chat) if tokens is not None else []
        self._ids += ids
        if isinstance(piece, str) and piece:
            self._text.append(piece)
        if choice.get("finish_reason") is not None:
            self._finished = True
        return ids


def plan(raw: bytes, chat: bool) -> Transcript | NotResumed:
    """A streamed request's transcript, or why it cannot be carried on."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError:
        return NotResumed("request", "its body is not JSON")
    if not isinstance(body, dict):
        return NotResumed("request", "its body is not a JSON object")
    n = body.get("n")
    if n not in (None, 1):
        return NotResumed("n", f"it asked for n={n} choices")
    if body.get("tools") or body.get("functions"):
        return NotResumed("tools", "it offered tools, whose calls are parsed by the engine")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return NotResumed("response_format", "it asked for a response format")
    # a continuation would lose the constraint (its state is the whole output's)
    constrained = next((k for k in engines.constraint_fields() if body.get(k) is not None), None)
    if constrained is not None:
        return NotResumed("response_format", f"it constrained its output ({constrained})")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("n_probs"):
        return NotResumed("logprobs", "it asked for log-probabilities")
    if not chat:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        ):
            return NotResumed("prompt", "its prompt is not one text or one list of token ids")
        if body.get("echo") or body.get("suffix"):
            return NotResumed("request", "it asked for echo or a suffix")
    return Transcript(body, chat)

"""What a stream has said so far, and how another replica carries it on.

Theory of operation
-------------------
A streamed chat or completion that can be carried on (``plan``: one choice, no
tools, no forced format or grammar, no log-probabilities asked for) asks its engine for
the ids of the tokens it generates: llama.cpp gives them with each token's
probability (``n_probs`` 1, read after sampling, so the engine does no extra
pass over the vocabulary), vLLM in ``token_ids`` (``return_token_ids``). Each
event is passed on with those fields taken out again, and the ``Transcript``
keeps what a continuation needs: the response's id, created time, model and
choice index, and the ids and text of the tokens relayed.

When the stream breaks after its first event, the router (``Proxy.carry_on``)
picks another replica of the same engine, has it render the original request
to prompt tokens (llama.cpp ``/apply-template`` and ``/tokenize``; vLLM
``/tokenize``), and asks its ``/v1/completions`` for the rest of
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
proxy's reasons for the fleet).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import attrs
import msgspec

LLAMA_CPP = "llama.cpp"
VLLM = "vllm"

_decode = msgspec.json.decode
_encode = msgspec.json.encode

# What shapes sampling and ending, sent on with a continuation as the client set it
# (OpenAI's names and the engines' own; an engine ignores what it does not know).
_CARRIED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "xtc_probability",
    "xtc_threshold",
    "top_n_sigma",
    "samplers",
    "skip_special_tokens",
    "stream_options",
)


# what constrains a reply's whole text (llama.cpp's and vLLM's names): not carried on
_CONSTRAINTS = (
    "grammar",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


@attrs.frozen
class NotResumed:
    """Why a stream cannot go on from another replica: the metric's label, and words."""

    label: str
    words: str


def family(engine: str) -> str:
    """Whose token ids an engine speaks: ``LLAMA_CPP``, ``VLLM`` (Ray's too), or ""."""
    if engine == LLAMA_CPP:
        return LLAMA_CPP
    if engine.startswith(VLLM):
        return VLLM
    return ""


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = body.get(name)
        if isinstance(value, int) and value >= 0:
            return value
    return None


class Transcript:
    """A resumable stream: its request, and what has been relayed of its reply."""

    __slots__ = (
        "body",
        "chat",
        "created",
        "family",
        "fingerprint",
        "finished",
        "id",
        "ids",
        "index",
        "keep",
        "model",
        "prompt_tokens",
        "reasoning",
        "text",
    )

    def __init__(self, body: dict[str, Any], chat: bool) -> None:
        self.body = body
        self.chat = chat
        self.family = ""  # the engines it may be carried on by, once one has answered
        self.keep = bool(body.get("return_token_ids"))  # the client asked for token ids
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.fingerprint: Any = None
        self.index: Any = 0
        self.ids: list[int] = []  # of the tokens relayed
        self.text: list[str] = []  # relayed, piece by piece
        self.finished = False  # an event with a finish reason was relayed
        self.reasoning = False  # reasoning was relayed apart from the content
        self.prompt_tokens = 0  # as the last engine to render the request counted them

    def request(self, engine: str) -> bytes | None:
        """The body to send to a replica of ``engine``: the client's, asking for token
        ids; None: that engine gives none (the stream cannot be carried on)."""
        kind = family(engine)
        if not kind:
            return None
        self.family = kind
        return _encode({**self.body, **_asking(kind)})

    def observe(self, event: bytes) -> bytes:
        """An event of the stream's first replica, as the client gets it."""
        if not event.startswith(b"data: {"):
            return event
        obj = _decode(event[6:])
        if self.id is None:
            self.id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
            self.fingerprint = obj.get("system_fingerprint")
        elif "created" in obj:
            # OpenAI: every chunk of a stream has the same created time; llama.cpp
            # stamps each with the second it was sent
            obj["created"] = self.created
        if not self.keep:
            obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or ():
            self.index = choice.get("index", 0)
            if not self.keep:
                choice.pop("prompt_token_ids", None)  # vLLM's completions put them here
            if self.chat:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.reasoning = True
            else:
                piece = choice.get("text")
            self._took(choice, piece)
            if self.family == LLAMA_CPP:
                if self.chat:
                    choice.pop("logprobs", None)
                else:
                    choice["logprobs"] = None
        return b"data: " + _encode(obj)

    def refused(self) -> NotResumed | None:
        """Why what was relayed cannot be carried on, if it cannot."""
        if self.reasoning:
            return NotResumed("reasoning", "its reasoning was streamed apart from its content")
        return None

    def opening(self) -> bytes | None:
        """For a stream that broke before its first event: the identity its
        continuation goes under, and a chat's opening event (its role)."""
        if self.id is not None:
            return None
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = self.body.get("model")
        if not self.chat:
            return None
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return b"data: " + _encode(self._shell([role]))

    def remaining(self) -> int | None:
        """How many more tokens the client asked for (None: no limit)."""
        limit = _max_tokens(self.body)
        return None if limit is None else max(0, limit - len(self.ids))

    def relayed(self) -> str:
        return "".join(self.text)

    def continuation(self, prompt: list[int], ids: list[int]) -> bytes:
        """The ``/v1/completions`` body that carries the stream on from ``ids``."""
        body: dict[str, Any] = {
            "model": self.body.get("model"),
            "prompt": prompt + ids,
            "stream": True,
            **{k: self.body[k] for k in _CARRIED if k in self.body},
            **_asking(self.family),
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
                {"index": self.index, "delta": {"content": piece} if piece else {}}
                if self.chat
                else {"text": piece, "index": self.index}
            )
            shown["logprobs"] = None
            shown["finish_reason"] = finish
            if self.keep:
                shown["token_ids"] = ids
            choices.append(shown)
        out = self._shell(choices)
        if obj.get("usage"):
            n = len(self.ids)
            out["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
            }
        elif not choices:
            return None
        return b"data: " + _encode(out)

    def ending(self) -> bytes:
        """The last event of a stream that reached ``max_tokens`` just as it broke."""
        self.finished = True
        shape: dict[str, Any] = (
            {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": "length"}
            if self.chat
            else {"text": "", "index": self.index, "logprobs": None, "finish_reason": "length"}
        )
        return b"data: " + _encode(self._shell([shape]))

    def _shell(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """An event of the client's stream around ``choices``."""
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        out["choices"] = choices
        return out

    def _took(self, choice: dict[str, Any], piece: Any) -> list[int]:
        """Note the token ids (returned) and text of a choice relayed."""
        ids: list[int] = []
        if self.family == LLAMA_CPP:
            probs = choice.get("logprobs")
            if isinstance(probs, dict):
                ids = [e["id"] for e in probs.get("content") or ()]
        else:
            ids = (choice.get("token_ids") if self.keep else choice.pop("token_ids", None)) or []
        self.ids += ids
        if isinstance(piece, str) and piece:
            self.text.append(piece)
        if choice.get("finish_reason") is not None:
            self.finished = True
        return ids


def _asking(kind: str) -> dict[str, Any]:
    """What asks an engine of this family for the ids of the tokens it generates."""
    if kind == LLAMA_CPP:
        return {"n_probs": 1, "post_sampling_probs": True}
    return {"return_token_ids": True}


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
    constrained = next((k for k in _CONSTRAINTS if body.get(k) is not None), None)
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

"""What of a request's prompt a replica may already hold: block chains and a bounded index.

Theory of operation
-------------------
Engines keep the KV of prompts they computed (llama-server in its slots and its
host-memory prompt cache, ``--cache-ram``; vLLM in its prefix cache) and reuse the
longest leading run of tokens a new prompt shares with one they hold. The router
works before any tokenizer, on what the client sent, and asks the same question
of text:

- ``prompt_key`` reads the chat messages (or the completion prompt) into one byte
  string, each message its role and its content with separators that no text
  holds, so that a system prompt and a conversation's earlier turns give the same
  leading bytes in every request that carries them, whichever client serialised
  the JSON. The string is cut into blocks of ``BLOCK_BYTES``; each full block gets
  the CRC of everything up to its end (one C call per block, chained), so two
  prompts share their first k block keys exactly when they share their first
  k blocks.
- The *anchor* is what every router, every worker and the in-process router hash
  the same way to agree on a replica without talking (rendezvous hashing, in
  ``affinity``): the prompt's leading bytes up to the end of its first turn (the
  leading system messages and the first message after them), at most
  ``ANCHOR_BYTES``. A conversation's turns share it; so do the users behind one
  system prompt that fills it (a prefix worth keeping in one place; a shorter one
  is cheap to compute again wherever it lands); requests with neither spread.
  The *spill* key, the whole first turn, orders the other replicas for a request
  whose first choice is over its load bound, so that a conversation spilled once
  spills to the same place next turn. A session hint (OpenAI's ``user``, or an
  ``x-session-id`` header) replaces both.
- ``PrefixIndex`` is one replica's learned picture: the block keys of the prompts
  this router sent there, least recently used evicted first, bounded by what the
  replica can hold. ``held`` is how many of a prompt's leading blocks it holds.
  A prompt's deeper blocks are refreshed before its shallower ones, so eviction
  takes a prompt's tail before its head and what is held stays a prefix.
- The engine says what it really reused (``observe``): a reply that reused much
  less than the index expected means the replica evicted what this router thought
  it held (other routers' traffic, a smaller cache than assumed), and the index
  shrinks to what the replica evidently keeps; a reply that bears the estimate out
  lets it grow back.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import zlib
from collections import OrderedDict
from typing import Literal

import attrs
import msgspec

Mode = Literal["off", "prefix", "session"]
MODES: tuple[Mode, ...] = ("off", "prefix", "session")

BLOCK_BYTES = 512  # about 128 tokens of English: the estimate's grain
MAX_BYTES = 256 * 1024  # a prompt is read this far (an estimate needs no more)
ANCHOR_BYTES = 1024  # the anchor's longest reach, about 250 tokens of English
# what one index entry costs (an int key in an OrderedDict, measured on CPython 3.11)
ENTRY_BYTES = 120
MAX_BLOCKS = 1 << 16  # one replica's index at most (32 MiB of prompt text, 7.5 MiB)
ROUTER_BLOCKS = 1 << 19  # every replica's index together, at most (60 MiB)
MIN_BLOCKS = 64  # nor shrunk below this by engine readings
BYTES_PER_TOKEN = 4  # to size an index from what a replica holds in tokens
SHRINK = 0.75  # an index found to overestimate keeps this share
# an engine reading below the estimate by more than this share of the prompt: missed
MISS_MARGIN = 0.25
KEPT_WEIGHT = 0.25  # of the newest reading in ``PrefixIndex.kept``


class _Message(msgspec.Struct):
    role: str = ""
    # a string, or parts ({"type": "text", ...}, images): parts are taken as sent
    content: str | list[msgspec.Raw] | None = None
    tool_calls: msgspec.Raw = msgspec.Raw(b"")  # empty: none


class _Request(msgspec.Struct):
    messages: list[_Message] | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"")  # a string, strings, or token ids; empty: none
    user: str | None = None


_decoder = msgspec.json.Decoder(_Request)
_STAMPS = itertools.count(1)  # one clock for every index of this process
_SYSTEM = frozenset({"system", "developer"})
_REPLIES = frozenset({"assistant", "tool", "function"})


@attrs.frozen
class PromptKey:
    """What the router reads of one request's prompt (see the module docstring)."""

    blocks: tuple[int, ...]  # one key per full block, each of the prompt up to its end
    size: int  # bytes of prompt read (at most MAX_BYTES)
    anchor: bytes  # rendezvous key of the first choice
    spill: bytes  # rendezvous key of the order past it
    # the first turn's full blocks: a replica holding as many of this prompt's blocks
    # has seen this conversation (not merely a system prompt it shares)
    turn_blocks: int
    session: bool = False  # the anchor is a client's session hint
    # a later turn of a conversation (an assistant or tool message in it): what its
    # earlier turns left in some replica's cache, every router can tell from the request
    later: bool = False


def prompt_key(body: bytes, mode: Mode, session: str | None = None) -> PromptKey | None:
    """The request's key, or None when affinity has nothing to go on (mode off, a body
    without messages or prompt, or "session" without a hint). ``session``: the
    ``x-session-id`` header's value, which wins over the body's ``user``."""
    if mode == "off":
        return None
    try:
        request = _decoder.decode(body)
    except msgspec.DecodeError:
        return None
    hint = session or request.user or None
    if mode == "session":
        if hint is None:
            return None
        anchor = _digest(b"session\0" + hint.encode(errors="replace"))
        return PromptKey(
            blocks=(), size=0, anchor=anchor, spill=anchor, turn_blocks=0, session=True
        )
    text, turn = _text(request)
    if not text:
        return None
    if hint is not None:
        anchor = spill = _digest(b"session\0" + hint.encode(errors="replace"))
    else:
        view = memoryview(text)
        anchor = _digest(view[: min(turn, ANCHOR_BYTES)])
        spill = anchor if turn <= ANCHOR_BYTES else _digest(view[:turn])
    messages = request.messages or ()
    return PromptKey(
        blocks=chain(text),
        size=len(text),
        anchor=anchor,
        spill=spill,
        turn_blocks=turn // BLOCK_BYTES,
        session=hint is not None,
        later=any(m.role in _REPLIES for m in messages),
    )


def _text(request: _Request) -> tuple[bytes, int]:
    """The prompt as one byte string (at most MAX_BYTES), and where its first turn ends."""
    if request.messages:
        parts: list[bytes] = []
        turn = 0
        size = 0
        for message in request.messages:
            one = _message(message)
            parts.append(one)
            size += len(one)
            if not turn and message.role not in _SYSTEM:
                turn = size
            if size >= MAX_BYTES:
                break
        text = b"".join(parts)[:MAX_BYTES]
        return text, min(turn or len(text), len(text))
    data = bytes(request.prompt)
    if not data:
        return b"", 0
    if data[:1] == b'"':
        try:
            data = msgspec.json.decode(data, type=str).encode()
        except msgspec.DecodeError:
            return b"", 0
    data = data[:MAX_BYTES]
    # no turns to tell: its anchor is its whole blocks, up to ANCHOR_BYTES, so that a
    # prompt that grows (a completion carried on) keeps it while its last block fills
    if len(data) < BLOCK_BYTES:
        return data, len(data)
    return data, min(len(data), ANCHOR_BYTES) // BLOCK_BYTES * BLOCK_BYTES


def _message(message: _Message) -> bytes:
    content = message.content
    if content is None:
        body = b""
    elif isinstance(content, str):
        body = content.encode(errors="replace")
    else:
        body = b"\x1d".join(bytes(part) for part in content)
    tools = b"\x1c" + bytes(message.tool_calls) if message.tool_calls else b""
    return b"\x1e" + message.role.encode(errors="replace") + b"\x1f" + body + tools


def chain(text: bytes) -> tuple[int, ...]:
    """One key per full block of ``text``: the CRC of the text up to the block's end,
    with the block's position above it (a CRC alone is 32 bits)."""
    view = memoryview(text)
    crc = 0
    keys: list[int] = []
    for i, end in enumerate(range(BLOCK_BYTES, len(text) + 1, BLOCK_BYTES)):
        crc = zlib.crc32(view[end - BLOCK_BYTES : end], crc)
        keys.append(crc | (i << 32))
    return tuple(keys)


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def rendezvous(key: bytes, replica: str, weight: float = 1.0) -> float:
    """The replica's rendezvous score for ``key`` (highest wins), the same in every
    process: ``-weight / ln(u)``, with ``u`` in (0, 1) hashed from both, so that a
    replica of weight 2 is first for twice the keys."""
    h = hashlib.blake2b(key + replica.encode(errors="replace"), digest_size=8).digest()
    u = (int.from_bytes(h, "big") + 0.5) / 2.0**64
    return -weight / math.log(u)


@attrs.define
class Reading:
    """What the engine said it reused of one prompt: ``cached`` of ``prompt`` tokens."""

    cached: int
    prompt: int


@attrs.define(eq=False)
class PrefixIndex:
    """One replica's prompts as this router sent them (see the module docstring)."""

    limit: int = MAX_BLOCKS  # what the replica can hold, in blocks
    capacity: int = MAX_BLOCKS  # what it evidently keeps, learned from its readings
    # what this router saw of it: requests that preferred it, and of those, how many
    # went elsewhere as it was past its load bound; prompt tokens of its replies that
    # said what they reused, what they reused, what this index estimated they would,
    # and how many reused much less than estimated
    preferred: int = 0
    overruled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    estimated_tokens: int = 0
    evicted: int = 0
    # new conversations this router placed here, decayed as its model's others are
    # placed (``affinity.placed``): about the share of the recent ones it keeps
    placed: float = 0.0
    # what the replica's readings bore out of the index's estimates: a moving average of
    # the share of the estimated tokens each reply said it reused (1: all of them)
    kept: float = 1.0
    # block key -> when it was last sent there (``_STAMPS``), least recently first
    _keys: OrderedDict[int, int] = attrs.field(factory=OrderedDict, init=False)

    def __len__(self) -> int:
        return len(self._keys)

    def held(self, blocks: tuple[int, ...]) -> int:
        """How many of ``blocks``' leading blocks this replica holds, as far as known."""
        keys = self._keys
        n = 0
        for key in blocks:
            if key not in keys:
                break
            n += 1
        return n

    def last_sent(self, blocks: tuple[int, ...], held: int) -> int:
        """When the deepest of the ``held`` leading blocks was last sent here (0: never):
        of two replicas that hold as much of a prompt, the one its conversation's
        latest turn went to (and the reply to it, which no index sees) is the later."""
        return self._keys.get(blocks[held - 1], 0) if held else 0

    def record(self, blocks: tuple[int, ...]) -> None:
        """The replica was sent a prompt of these blocks: it holds them now."""
        keys = self._keys
        stamp = next(_STAMPS)
        for key in reversed(blocks):  # the head last: the most recently used
            keys[key] = stamp
            keys.move_to_end(key)
        self._evict()

    def resize(self, limit: int) -> None:
        """What the replica can hold changed (its profile, or the router's budget)."""
        self.limit = max(1, limit)
        self.capacity = min(self.capacity, self.limit) if self._keys else self.limit
        self._evict()

    def observe(self, estimated: int, blocks: int, reading: Reading, size: int) -> int:
        """Learn from what the engine reused; ``estimated``: the blocks this index said
        the replica held of a prompt of ``blocks`` blocks and ``size`` bytes. Returns the
        tokens this index estimated it would reuse; ``evicted`` counts one more when the
        engine reused much less than that (it had evicted it)."""
        if reading.prompt <= 0 or size <= 0:
            return 0
        expected = min(1.0, estimated * BLOCK_BYTES / size)
        actual = reading.cached / reading.prompt
        self.prompt_tokens += reading.prompt
        self.cached_tokens += reading.cached
        tokens = round(expected * reading.prompt)
        self.estimated_tokens += tokens
        if tokens:
            self.kept += KEPT_WEIGHT * (min(1.0, reading.cached / tokens) - self.kept)
        if expected - actual > MISS_MARGIN:
            self.evicted += 1
            self.capacity = max(MIN_BLOCKS, int(len(self._keys) * SHRINK))
            self._evict()
        elif estimated:
            self.capacity = min(self.limit, self.capacity + blocks)
        return tokens

    @property
    def bytes(self) -> int:
        """About what the index takes of the router's memory."""
        return len(self._keys) * ENTRY_BYTES

    def _evict(self) -> None:
        keys = self._keys
        bound = min(self.limit, self.capacity)
        while len(keys) > bound:
            keys.popitem(last=False)


def blocks_for(tokens: int | None) -> int:
    """An index's bound for a replica that holds ``tokens`` of KV and prompt cache
    (None: not known), within the router's bounds."""
    if tokens is None or tokens <= 0:
        return MAX_BLOCKS // 4
    return max(MIN_BLOCKS, min(MAX_BLOCKS, tokens * BYTES_PER_TOKEN // BLOCK_BYTES))

"""The prompts a bench sends: what the hardware serves, not what a cache remembers.

Unique by default. Every prompt starts with a random header (16 hex digits),
so no two requests share a prefix and the engine's prompt cache answers none of the prefill: one
repeated prompt would measure the cache rather than the hardware.

``shared_prefix`` asks the other question on purpose: the first N words of
every prompt are byte-identical (the same words, in the same order, from a
fixed seed), then the random header, then the rest. An earlier version of
this tool dropped the header and still drew the words at random, so nothing
was shared and the flag measured the very thing it exists to avoid.

Lengths are counted in words, drawn from common English words that most
tokenizers take as one token each; the engine's own count (``usage``) is what
the results report.
"""

from __future__ import annotations

import random
import re
import secrets

import attrs

# common words that are one token each in the usual BPE vocabularies
_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an "
    "each which she do how their if will up other about out many then them these so some "
    "her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come "
    "made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such"
)
WORDS = tuple(_TEXT.split())

_DIST = re.compile(r"^(?:(fixed|uniform|normal):)?([0-9.]+)(?:,([0-9.]+))?$")


class DistError(ValueError):
    pass


@attrs.frozen
class Dist:
    """A length: ``N`` (fixed), ``uniform:LO,HI`` or ``normal:MEAN,SD`` (at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, what: str) -> Dist:
        m = _DIST.match(text.strip())
        if m is None:
            raise DistError(
                f"{what} {text!r}: give N, uniform:LO,HI or normal:MEAN,SD (e.g. normal:256,64)"
            )
        kind, a, b = m.group(1) or "fixed", float(m.group(2)), m.group(3)
        if kind == "fixed":
            if b is not None:
                raise DistError(f"{what} {text!r}: a fixed length is one number")
            return cls("fixed", a)
        if b is None:
            raise DistError(f"{what} {text!r}: {kind} takes two numbers, {kind}:A,B")
        if kind == "uniform" and float(b) < a:
            raise DistError(f"{what} {text!r}: uniform:LO,HI needs LO <= HI")
        return cls(kind, a, float(b))

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = self.a
        return max(1, round(value))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


@attrs.frozen
class PromptMaker:
    """Makes each request's prompt and output length."""

    input_words: Dist
    output_tokens: Dist
    shared_prefix: int = 0  # words every prompt starts with, byte for byte
    seed: int | None = None  # lengths and words; the header stays random unless seeded
    _rng: random.Random = attrs.field(init=False)
    _prefix: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_rng", random.Random(self.seed))
        fixed = random.Random(0x11A6)  # the same prefix in every run, on every machine
        object.__setattr__(
            self, "_prefix", " ".join(fixed.choice(WORDS) for _ in range(self.shared_prefix))
        )

    @property
    def prefix(self) -> str:
        return self._prefix

    def header(self) -> str:
        """Random from its first byte: two prompts share no prefix (but by chance)."""
        return secrets.token_hex(8) if self.seed is None else f"{self._rng.getrandbits(64):016x}"

    def next(self) -> tuple[str, int]:
        """One prompt and its max_tokens."""
        rest = max(0, self.input_words.draw(self._rng) - self.shared_prefix)
        body = " ".join(self._rng.choice(WORDS) for _ in range(rest))
        parts = [self._prefix] if self._prefix else []
        parts += [self.header(), body]
        return " ".join(p for p in parts if p), self.output_tokens.draw(self._rng)

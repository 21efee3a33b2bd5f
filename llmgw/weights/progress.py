"""A fetch's progress in words, as the agent reports it and ``ctl`` shows it."""

from __future__ import annotations

from llmgw.weights.part import human


def progress_words(done: int, total: int | None, rate_bps: float, peer: str = "") -> str:
    """``43 % of 2.1 GiB, 120.0 MiB/s from n1, 40 s left``; "" before the size is
    known."""
    if not total:
        return ""
    words = f"{100 * done / total:.0f} % of {human(total)}"
    source = f" from {peer}" if peer else ""
    if rate_bps > 0:
        left = (total - done) / rate_bps
        return words + f", {human(int(rate_bps))}/s{source}, {left:.0f} s left"
    return words + source


def fetching_words(
    source: str, done: int, total: int | None, rate_bps: float, peer: str = ""
) -> str:
    """``fetching hf://org/repo/m.gguf: 43 % of 2.1 GiB, 120.0 MiB/s, 40 s left``."""
    how = progress_words(done, total, rate_bps, peer)
    return f"fetching {source}" + (f": {how}" if how else "")

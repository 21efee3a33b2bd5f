"""A fetch's progress in words, as ``ctl`` shows it and the agent reports it."""

from __future__ import annotations

from llmgw.weights.progress import fetching_words, progress_words

MIB = 1 << 20


def test_progress_says_how_far_how_fast_from_whom_and_how_long() -> None:
    assert progress_words(43 * MIB, 100 * MIB, 10 * MIB, "n1") == (
        "43 % of 100.0 MiB, 10.0 MiB/s from n1, 6 s left"
    )
    assert progress_words(43 * MIB, 100 * MIB, 0.0) == "43 % of 100.0 MiB"
    assert progress_words(0, None, 0.0) == ""  # the source not asked yet
    assert fetching_words("hf://acme/m/m.gguf", 0, None, 0.0) == "fetching hf://acme/m/m.gguf"
    assert fetching_words("hf://acme/m/m.gguf", MIB, 2 * MIB, 0.0, "n2") == (
        "fetching hf://acme/m/m.gguf: 50 % of 2.0 MiB from n2"
    )

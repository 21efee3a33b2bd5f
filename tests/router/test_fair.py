"""Who goes first in a full model (``llmgw.router.fair``): tenants by their recent tokens
over their weight, counted from the moment a request is sent."""

from __future__ import annotations

import math

from llmgw.router.fair import HALF_LIFE_S, Shares


def test_the_tenant_that_used_less_goes_first_and_a_weight_buys_a_larger_share() -> None:
    shares = Shares()
    shares.charge("a", 1000, 0.0)
    shares.charge("b", 500, 0.0)
    assert shares.value("new") == -math.inf
    assert shares.value("new") < shares.value("b") < shares.value("a")
    assert shares.value("a", weight=4) < shares.value("b")  # 1000 / 4 < 500


def test_tokens_fade_with_time_and_a_settled_estimate_never_counts_below_nothing() -> None:
    shares = Shares()
    shares.charge("a", 1000, 0.0)
    shares.charge("b", 600, 2 * HALF_LIFE_S)  # a's 1000 are worth 250 by now
    assert shares.value("a") < shares.value("b")
    shares.charge("a", 10_000, 2 * HALF_LIFE_S)
    assert shares.value("b") < shares.value("a")
    # a request counted 30 tokens when sent used 10: the 20 too many are taken back
    shares.charge("c", 30, 0.0)
    shares.charge("c", -20, 0.0)
    shares.charge("d", 11, 0.0)
    assert shares.value("c") < shares.value("d")
    shares.charge("c", -500, 0.0)  # more taken back than counted: nothing, not less
    assert shares.value("c") == -math.inf

"""Who goes first in a full model (``llmgw.router.fair``): tenants by their recent tokens
over their weight, each tenant's own requests in the order they came."""

from __future__ import annotations

from llmgw.router.fair import HALF_LIFE_S, Shares


def test_the_tenant_that_used_less_goes_first_and_a_weight_buys_a_larger_share() -> None:
    shares = Shares()
    shares.spent("a", 1000, 0.0)
    shares.spent("b", 500, 0.0)
    assert shares.rank("new") < shares.rank("b") < shares.rank("a")
    assert shares.rank("a", weight=4) < shares.rank("b")  # 1000 / 4 < 500


def test_tokens_fade_with_time_and_a_tenants_own_requests_keep_their_order() -> None:
    shares = Shares()
    shares.spent("a", 1000, 0.0)
    shares.spent("b", 600, 2 * HALF_LIFE_S)  # a's 1000 are worth 250 by now
    assert shares.rank("a") < shares.rank("b")
    first, second = shares.rank("a"), shares.rank("a")  # no spending between
    assert first < second
    shares.spent("a", 10_000, 2 * HALF_LIFE_S)
    assert shares.rank("b") < shares.rank("a")

"""A router's own counters per model (``ModelCounters``), read from its metrics.

The same reading serves the in-process router (the console's traffic reads it each
step) and a standalone router (its reports carry it to the control plane), so every
router's requests, errors, tokens and time to first token are counted one way.
"""

from __future__ import annotations

import math

from llmgw.router.metrics import RouterMetrics
from llmgw.routing import ModelCounters


def model_counters(metrics: RouterMetrics) -> dict[str, ModelCounters]:
    """Each model's counts since the router started."""
    out: dict[str, ModelCounters] = {}

    def of(model: str) -> ModelCounters:
        found = out.get(model)
        if found is None:
            found = out[model] = ModelCounters()
        return found

    for family in metrics.requests.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            c = of(sample.labels["model"])
            n = int(sample.value)
            c.requests += n
            if sample.labels["status"].startswith("5"):
                c.errors += n
    for family in metrics.tokens.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                of(sample.labels["model"]).tokens += int(sample.value)
    for family in metrics.ttft.collect():
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            c = of(sample.labels["model"])
            le = float(sample.labels["le"])
            if math.isinf(le):
                continue
            c.ttft_le.append(le)
            c.ttft_counts.append(int(sample.value))
    return out

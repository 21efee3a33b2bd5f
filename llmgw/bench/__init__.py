"""``llmgw ctl bench``: measure what a replica can serve, and say what admission should use.

- ``prompts``: the requests (unique by default, or with a byte-identical shared prefix);
- ``ladder``: the concurrency ladder, run until the SLO breaks, with the engine's own
  signals read while it runs;
- ``results``: a run as a value (kept as JSON), its table, its plot, the comparison of
  two runs, and the routing settings it recommends.
"""

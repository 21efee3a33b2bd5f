"""The router: picks which Ready replica serves a request, and copes when one fails.

Pure decision code lives here with an explicit ``now`` and no I/O, so every
rule (who may take traffic, who is saturated, when a replica is taken out and
let back in, when a request may be retried) is tested without a network:

- ``balancer``: ``choose`` picks the least-loaded admissible replica for a
  model, or says why none (shed with 429, or no replica at all → 503), and
  ``RetryBudget`` bounds retries per request and across the router.
- ``breaker``: a circuit breaker per replica that counts upstream faults only,
  never errors the request itself caused (``classify`` says which an
  engine's answer is).
- ``verdict``: what one attempt on a replica comes to: the breaker's outcome,
  whether another replica may be tried, and the client's status.

The shell around them: ``app`` (the endpoint: keys, models, one ``record``
per request for the metrics and the access log), ``proxy`` (attempts and
retries), ``relay`` (a response body passed on as it arrives).
"""

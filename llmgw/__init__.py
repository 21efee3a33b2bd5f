"""llmgw: a fleet manager and OpenAI-compatible gateway for self-hosted LLM engines.

Layout, following the architecture:

- ``protocol``: the agent stream's wire types and session state machine (sans-I/O).
- ``tls``: the private CA and the TLS contexts of the agent stream.
- ``http``: the lean HTTP/1.1 server shared by the admin API and (later) the router.
- ``controlplane``: node table, liveness, the agent stream listener and dispatcher.
- ``agent``: the node agent: inventory, the outbound stream, reconnect policy.
- ``admin``: the management API served on the admin listener.
- ``cli``: ``llmgw server``, ``llmgw agent`` and ``llmgw ctl``.
"""

__version__ = "0.1.0"

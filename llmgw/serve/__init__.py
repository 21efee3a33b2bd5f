"""Composition roots: each daemon wired from its parts, and nothing imports these.

``server`` (``llmgw server``: control plane, admin API, in-process router),
``agent`` (``llmgw agent``) and ``router`` (``llmgw router``, standalone).
They sit at the top of the layers: they import the domain packages, and no
domain package imports them.
"""

"""Engine adapters: llama.cpp's llama-server, vLLM, and multi-node vLLM over Ray.

The registry here is where everyone finds them and asks what an engine needs,
so that nothing outside this package names an engine: the catalog checks a
profile against its adapter's ``requires``, placement looks for its programs on
a node, the agent finds those programs and launches and health-checks the
engine, the control plane reckons its memory, the router reads its load gauges
and carries its broken streams on with its ``tokens``.

The built-in adapters are registered on first use; ``register`` adds another
(an engine of a plugin, or of a test), which every process that is to run, place
or route it must have registered before it starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from llmgw.engines.base import EngineAdapter, Program
from llmgw.engines.sizing import Sizing
from llmgw.engines.tokens import Tokens

_ADAPTERS: dict[str, EngineAdapter] = {}
_VIEW = MappingProxyType(_ADAPTERS)
# what every registered dialect names, in registration order (``tokens``' docstring)
_carried: tuple[str, ...] = ()
_constraints: tuple[str, ...] = ()


def _builtins() -> None:
    if _ADAPTERS:
        return
    from llmgw.engines.llamacpp import LLAMA_CPP
    from llmgw.engines.vllm import VLLM, VLLM_RAY

    for a in (LLAMA_CPP, VLLM, VLLM_RAY):
        _ADAPTERS[a.name] = a
    _index()


def _index() -> None:
    global _carried, _constraints
    dialects = [a.tokens for a in _ADAPTERS.values() if a.tokens is not None]
    _carried = tuple(dict.fromkeys(f for t in dialects for f in t.carried))
    _constraints = tuple(dict.fromkeys(f for t in dialects for f in t.constraints))


def adapters() -> Mapping[str, EngineAdapter]:
    """Every engine adapter, by the name a profile's ``engine`` gives, in the order
    they were registered (the built-in ones first)."""
    _builtins()
    return _VIEW


def adapter(engine: str) -> EngineAdapter | None:
    """The adapter of ``engine`` (a profile's ``engine``); None for one not known."""
    _builtins()
    return _ADAPTERS.get(engine)


def register(new: EngineAdapter) -> None:
    """Add an adapter. Raises ValueError when another one has its name already."""
    _builtins()
    held = _ADAPTERS.get(new.name)
    if held is not None and held is not new:
        raise ValueError(f"an engine adapter named {new.name!r} is registered already")
    _ADAPTERS[new.name] = new
    _index()


def programs() -> list[Program]:
    """Everything some engine needs installed, each once (by its inventory name), in
    the order the adapters declare them: what the agent looks for on its node."""
    found: dict[str, Program] = {}
    for a in adapters().values():
        for p in a.requires.programs:
            found.setdefault(p.name, p)
    return list(found.values())


def installed(engine: str) -> tuple[str, ...]:
    """The inventory names of what a node needs installed to run ``engine`` (an
    engine not known: its own name, which no node reports)."""
    found = adapter(engine)
    return tuple(p.name for p in found.requires.programs) if found is not None else (engine,)


def sizing(engine: str) -> Sizing | None:
    """How ``engine`` reckons a shard's memory; None: it does not (or is not known)."""
    found = adapter(engine)
    return found.sizing if found is not None else None


def tokens(engine: str) -> Tokens | None:
    """How ``engine`` gives its token ids; None: it gives none (or is not known)."""
    found = adapter(engine)
    return found.tokens if found is not None else None


def carried_fields() -> tuple[str, ...]:
    """Every registered engine's own request fields that shape sampling and ending."""
    _builtins()
    return _carried


def constraint_fields() -> tuple[str, ...]:
    """Every registered engine's own request fields that constrain a reply's text."""
    _builtins()
    return _constraints

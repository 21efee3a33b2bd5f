"""How an engine's token ids are asked for and read, for carrying a broken stream on.

The router's resume (``llmgw.router.resume``) keeps a stream's token ids so that
another replica can go on from them (see its theory of operation). What differs
from engine to engine is declared here, by each adapter's ``tokens``:

- ``family``: whose ids they are. Engines of one family read each other's ids
  (vLLM and vLLM over Ray are one), so a stream is carried on only within it.
- ``asking``: what a request adds to be given the id of each token it streams.
- ``took``: the ids a streamed choice carries, taken out of what the client sees
  (unless the client asked for ids itself).
- ``render``: the original request rendered to prompt token ids by a new replica,
  and the ids relayed checked against the text relayed, through ``ask`` (the
  router's call to that replica, so an adapter does no I/O itself).
- ``carried`` and ``constraints``: the engine's own names for what shapes sampling
  and ending (sent on with a continuation) and for what constrains a reply's whole
  text (a stream constrained so is not carried on: the constraint's state is the
  whole output's).

Pure: no I/O and no trio.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

# the router's call to a replica: POST a JSON body to a path, the JSON object answered
Ask = Callable[[str, dict[str, object]], Awaitable[dict[str, object]]]


class Tokens(Protocol):
    family: str
    asking: Mapping[str, object]
    carried: tuple[str, ...]
    constraints: tuple[str, ...]

    def took(self, choice: dict[str, Any], keep: bool, chat: bool) -> list[int]:
        """The ids of the tokens one streamed ``choice`` carries; what was asked for is
        taken out of ``choice`` unless the client asked for ids (``keep``)."""
        ...

    async def render(
        self, ask: Ask, body: Mapping[str, Any], chat: bool, ids: list[int], relayed: str
    ) -> tuple[list[int], list[int]]:
        """The request's prompt as this engine tokenizes it, and the ids relayed: ``ids``
        if it reads them as the text ``relayed``, else that text tokenized."""
        ...


def token_ids(found: object) -> list[int]:
    """``found`` as a list of token ids. Raises TypeError for anything else."""
    if not isinstance(found, list) or not all(isinstance(i, int) for i in found):
        raise TypeError(f"not a list of token ids: {str(found)[:100]}")
    return found

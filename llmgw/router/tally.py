"""What tenants' keys used through this router: requests, tokens, refusals, per model.

Counts since the router started, that only grow: a standalone router reports
them whole with every report (``routing.RouterReport.usage``) and the control
plane adds what grew since the last (``llmgw.controlplane.usage``); the
router inside ``llmgw server`` is read in process. Bounded by the tenants and
models there are (a key of no tenant is not counted here).

Pure: no I/O.
"""

from __future__ import annotations

import msgspec

from llmgw.routing import UsageRow


class Tally:
    __slots__ = ("_rows", "changes")

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], UsageRow] = {}
        self.changes = 0  # grows with every count: whether there is news since a report

    def _row(self, tenant: str, model: str) -> UsageRow:
        row = self._rows.get((tenant, model))
        if row is None:
            row = self._rows[tenant, model] = UsageRow(tenant=tenant, model=model, refused={})
        return row

    def answered(self, tenant: str, model: str, prompt: int, completion: int) -> None:
        """A request of the tenant's reached an engine and ended."""
        row = self._row(tenant, model)
        row.requests += 1
        row.prompt_tokens += prompt
        row.completion_tokens += completion
        self.changes += 1

    def refused(self, tenant: str, model: str, limit: str) -> None:
        """A request of the tenant's was refused at ``limit``."""
        row = self._row(tenant, model)
        row.refused[limit] = row.refused.get(limit, 0) + 1
        self.changes += 1

    def rows(self) -> list[UsageRow]:
        """Every count so far (copies: the caller may keep them)."""
        return [msgspec.structs.replace(r, refused=dict(r.refused)) for r in self._rows.values()]

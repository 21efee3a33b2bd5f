"""Reloading what a running server can change: the catalog and the API keys.

``ctl reload`` (``POST /v1/catalog/reload``) and SIGHUP both call a ``Reloader``.
It reads the config file first and the catalog next; either one bad changes
nothing and says why in one line (``NotReloaded``). The keys are replaced last,
in the ring the in-process router reads. Then it checks what the new catalog
asks for (a setting no adapter reads, a model no node can hold) and says so as
warnings, in the reply and in the one log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from llmgw.config import ConfigError, ServerConfig
from llmgw.config.errors import one_line
from llmgw.controlplane.catalog import Catalog
from llmgw.controlplane.fleet import FleetManager
from llmgw.controlplane.routing import RoutingPublisher
from llmgw.engines import adapters
from llmgw.router.keys import KeyRing, api_keys, changes, followed, published

log = logging.getLogger("llmgw.server")


@attrs.frozen
class Reloaded:
    """What a reload changed, in one line, and what the operator should look at now."""

    message: str
    warnings: list[str] = attrs.Factory(list)


class NotReloaded(Exception):
    """A reload that changed nothing; the message says what was wrong, in one line."""


def unknown_settings(catalog: Catalog) -> list[str]:
    """A line for each profile setting its engine's adapter does not read (the
    adapter would refuse the shard on the node, at launch)."""
    engines = adapters()
    lines: list[str] = []
    for name in sorted(catalog.models):
        for p in catalog.models[name].profiles:
            adapter = engines.get(p.engine)
            if adapter is None:  # the catalog refuses an unknown engine; nothing to say
                continue
            known = adapter.known_settings
            lines.extend(
                f"model {name}, profile {p.name}: {p.engine} does not know the setting"
                f" {key!r} (it knows {', '.join(sorted(known))})"
                for key in sorted(set(p.settings) - known)
            )
    return lines


def unplaceable(fleet: FleetManager) -> list[str]:
    """A line for each catalog model below its count whose next replica fits on no
    node now, with placement's reason."""
    if not fleet.control.nodes.nodes:
        return [
            "no node has registered yet: whether the catalog's models can be placed is not known"
        ]
    lines = []
    below = fleet.below_count()
    # each is a placement over every node, on the event loop: a few, not thousands
    for name in below[:MAX_PLACEMENT_CHECKS]:
        decision = fleet.explain(name)
        if decision is not None and decision.profile is None:
            lines.append(f"cannot place {name} now: {decision.summary}")
    if len(below) > MAX_PLACEMENT_CHECKS:
        rest = len(below) - MAX_PLACEMENT_CHECKS
        lines.append(f"{rest} more models below their count were not checked (ctl models)")
    return lines


MAX_PLACEMENT_CHECKS = 20  # models a reload asks placement about, for its warnings
MAX_WARNINGS = 20  # warnings a reload says; the rest are counted


@attrs.define
class Reloader:
    """What ``ctl reload`` and SIGHUP do: read the catalog and the API keys again.

    The config file is read first and the catalog next; either one bad changes
    nothing (the old keys and catalog stay) and says why. The keys are
    replaced last, in the ring the in-process router reads (the next request
    is checked against them) and in the routing every standalone router
    follows (they take them within moments). Other changes to the config need
    a restart.
    """

    fleet: FleetManager | None
    keys: KeyRing | None  # the in-process router's, if it runs
    reread: Callable[[], ServerConfig] | None  # the config file, read again
    routing: RoutingPublisher | None = None  # what standalone routers follow
    # one reload at a time: files are read off the event loop, and two reloads
    # overlapping could swap in the older file last
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    async def __call__(self) -> Reloaded:
        async with self._lock:
            return await self._reload()

    async def _reload(self) -> Reloaded:
        config = None
        if (self.keys is not None or self.routing is not None) and self.reread is not None:
            try:
                config = await trio.to_thread.run_sync(self.reread, abandon_on_cancel=True)
            except ConfigError as exc:
                raise NotReloaded(f"config not reloaded, nothing changed: {exc}") from None
        parts = []
        if self.fleet is not None:
            try:
                parts.append(await self.fleet.reload())
            except ConfigError as exc:
                raise NotReloaded(f"catalog not reloaded, nothing changed: {exc}") from None
        if config is not None:
            keys = api_keys(config.router)
            before = followed(self.routing.keys) if self.routing is not None else []
            said = self.keys.replace(keys) if self.keys is not None else changes(before, keys)
            if self.routing is not None:
                self.routing.set_keys(published(keys))
            if self.keys is not None or keys or before:  # no keys, no endpoint: no word
                parts.append("keys reloaded: " + said)
        what = "; ".join(parts) or "nothing to reload"
        warnings = []
        if self.fleet is not None:
            try:
                warnings = unknown_settings(self.fleet.catalog) + unplaceable(self.fleet)
            except Exception as exc:  # what is reloaded stays reloaded: say so, not a 500
                log.debug("the reload's checks failed here", exc_info=True)
                warnings = [f"the reload's checks failed: {one_line(exc)}"]
        if len(warnings) > MAX_WARNINGS:
            rest = len(warnings) - MAX_WARNINGS
            warnings = [*warnings[:MAX_WARNINGS], f"and {rest} more warnings"]
        if warnings:
            log.warning("%s; warnings: %s", what, "; ".join(warnings))
        else:
            log.info("%s", what)
        return Reloaded(what, warnings)

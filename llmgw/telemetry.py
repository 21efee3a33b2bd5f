"""What every daemon's metrics start with: the process, the Python, the build.

``daemon_registry`` is the registry a composition root hands its metrics:
``process_*`` (CPU, memory, open files, start time), ``python_info``, and
``llmgw_build_info{version,build,role}``. The ``_created`` series that
prometheus_client adds to every counter and histogram are turned off for the
whole process: a scrape carries only what Prometheus uses.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from llmgw.version import VERSION, build


def daemon_registry(role: str) -> CollectorRegistry:
    """A registry for one daemon (``role``: server, agent or router)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Info("llmgw_build", "The llmgw version and build this daemon runs", registry=registry).info(
        {"version": VERSION, "build": build(), "role": role}
    )
    return registry

"""Where ``ctl`` finds the server's config when it is not told.

``llmgw init`` writes ``/etc/llmgw/server.toml``, and what the install prints
(INSTALL.txt's last step, init's next commands) is a plain ``llmgw ctl nodes``
on that host: ``--config`` wins, then ``LLMGW_SERVER_CONFIG``, then that file
when it exists. The rule is here once, for every ctl command that reads the
server's config (the admin API's address and token, onboarding's CA, bench's
router and catalog).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

DEFAULT_SERVER_CONFIG = Path("/etc/llmgw/server.toml")
ENV_SERVER_CONFIG = "LLMGW_SERVER_CONFIG"


def server_config(
    flag: Path | None, env: Mapping[str, str], default: Path = DEFAULT_SERVER_CONFIG
) -> tuple[Path | None, bool]:
    """The server config to read, and whether it is only the default.

    ``--config`` first, then ``LLMGW_SERVER_CONFIG``, then ``default`` if it
    exists; ``(None, False)`` when none of them names a file.
    """
    if flag is not None:
        return flag, False
    named = env.get(ENV_SERVER_CONFIG)
    if named:
        return Path(named), False
    if default.exists():
        return default, True
    return None, False


def not_found(default: Path = DEFAULT_SERVER_CONFIG) -> str:
    """What ctl looked for, and how to point it elsewhere, in words."""
    return (
        f"no {default} here (where llmgw init writes it): pass --config SERVER.toml"
        f" or set {ENV_SERVER_CONFIG}=SERVER.toml"
    )

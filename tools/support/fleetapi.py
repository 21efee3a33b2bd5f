"""What a running fleet says, asked as an operator would: the control plane's admin API
(``/healthz``, ``/v1/nodes``, ``/v1/replicas``, ...) with the admin token, and the router's
``/v1/models`` with an API key. Blocking calls with short timeouts, for the commands
(``tools/fleet``, the lab) and the checks that poll them; rows are the API's JSON."""

from __future__ import annotations

from typing import Any

import httpx


def up(admin_url: str) -> bool:
    """Whether the control plane's admin API answers ``/healthz``."""
    try:
        return httpx.get(admin_url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def admin_get(admin_url: str, token: str, path: str, timeout: float = 2) -> Any:
    """``GET path`` of the admin API, its JSON; httpx.HTTPError when it is not a 2xx."""
    r = httpx.get(admin_url + path, headers={"authorization": f"Bearer {token}"}, timeout=timeout)
    r.raise_for_status()
    return r.json()


def nodes(admin_url: str, token: str) -> list[dict[str, Any]]:
    """The control plane's view of the nodes (``/v1/nodes``)."""
    found: list[dict[str, Any]] = admin_get(admin_url, token, "/v1/nodes")["nodes"]
    return found


def replicas(admin_url: str, token: str) -> list[dict[str, Any]]:
    """The control plane's view of the replicas (``/v1/replicas``)."""
    found: list[dict[str, Any]] = admin_get(admin_url, token, "/v1/replicas")["replicas"]
    return found


def ready_nodes(admin_url: str, token: str) -> int:
    """How many nodes are Ready; 0 while the admin API does not answer."""
    try:
        return sum(n["state"] == "Ready" for n in nodes(admin_url, token))
    except (httpx.HTTPError, OSError):
        return 0


def served(base_url: str, key: str, model: str = "tiny") -> bool:
    """Whether the router at ``base_url`` (``.../v1``) lists ``model`` to ``key``."""
    try:
        r = httpx.get(base_url + "/models", headers={"authorization": f"Bearer {key}"}, timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and any(m["id"] == model for m in r.json()["data"])

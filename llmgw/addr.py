"""Host and port as people and URLs write them: an IPv6 address in brackets; and
which address of a listener bound to every address to tell others."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def is_wildcard(host: str) -> bool:
    """Whether a listen host means every address (``0.0.0.0``, ``::``, ``[::]``)."""
    return host.strip("[]") in WILDCARD_HOSTS


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def advertised_host(candidates: Iterable[str]) -> str:
    """The address to tell others for a listener bound to every address: the first
    candidate that is neither a wildcard nor loopback, else the first that is not a
    wildcard (a loopback one still reaches it from this host); "" when none is.
    Candidates in order of trust: what the caller knows others dial, then names it
    holds, then what the routing table says."""
    usable = [c for c in candidates if c and not is_wildcard(c) and "*" not in c]
    return next((c for c in usable if not _loopback(c)), usable[0] if usable else "")


def join_hostport(host: str, port: int) -> str:
    """``host:port``, or ``[host]:port`` for an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_host(host: str) -> str:
    """Where a local client reaches a server bound to ``host``, URL-ready."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host

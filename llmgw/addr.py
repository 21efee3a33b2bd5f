"""Host and port as people and URLs write them: an IPv6 address in brackets."""

from __future__ import annotations


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

"""The node's address: the local one on the route to the control plane."""

from __future__ import annotations

import socket


def route_address(host: str, port: int) -> str:
    """The source address the kernel picks to reach host:port.

    A UDP connect chooses a route and a source address without sending a
    packet. Empty when the control plane's name does not resolve yet.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return ""
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return ""

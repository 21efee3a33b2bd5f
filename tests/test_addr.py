"""Which address a listener bound to every address tells others."""

from __future__ import annotations

from pathlib import Path

from llmgw.addr import advertised_host, is_wildcard
from llmgw.serve.server import advertised_metrics
from llmgw.tls import init_ca, issue_server, load_ca


def test_wildcards_are_known_in_every_spelling() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", ""))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "::1", "cp.example.net"))


def test_the_first_reachable_looking_candidate_wins_and_loopback_is_the_last_resort() -> None:
    assert advertised_host(["0.0.0.0", "127.0.0.1", "cp.example.net", "10.0.0.5"]) == (
        "cp.example.net"
    )
    assert advertised_host(["localhost", "::1", "*.example.net", "10.0.0.5"]) == "10.0.0.5"
    assert advertised_host(["0.0.0.0", "localhost", "127.0.0.1", ""]) == "localhost"
    assert advertised_host(["::", ""]) == ""


def test_a_wildcard_metrics_listener_is_named_by_what_agents_dial(tmp_path: Path) -> None:
    init_ca(tmp_path)
    cert, _ = issue_server(load_ca(tmp_path), ["localhost", "cp.example.net"], tmp_path)
    # a specific listener is its own address
    assert advertised_metrics("10.1.1.1:9465", "0.0.0.0", cert) == "10.1.1.1:9465"
    # the agent stream's own address first, when it names one
    assert advertised_metrics("0.0.0.0:9465", "10.2.2.2", cert) == "10.2.2.2:9465"
    # else the certificate's names agents dial (its loopback ones only as a last resort)
    assert advertised_metrics("[::]:9465", "::", cert) == "cp.example.net:9465"

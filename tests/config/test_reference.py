"""The configuration reference cannot drift from the schema, and the examples hold
what a first install needs."""

from __future__ import annotations

import tomllib
from pathlib import Path

from llmgw.config import AgentConfig, ServerConfig, load_config
from llmgw.config.schema import StandaloneRouterConfig
from llmgw.controlplane.catalog import load_catalog
from tools import config_reference

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"


def test_the_reference_is_what_the_schema_says() -> None:
    assert config_reference.DOC.exists(), "run python -m tools.config_reference --write"
    assert config_reference.DOC.read_text() == config_reference.render(), (
        "docs/configuration.md is stale: run python -m tools.config_reference --write"
    )


def test_every_key_says_what_it_does() -> None:
    assert config_reference.undocumented() == []


def test_the_reference_names_every_key_of_every_file() -> None:
    text = config_reference.DOC.read_text()
    for key in ("agent_stream.listen", "engines.port_range", "router.max_body_mb", "workers"):
        assert f"| `{key}` |" in text
    assert "| `models.NAME.profiles[].engine` | string | required |" in text


def test_the_examples_load_and_hold_what_a_first_install_needs() -> None:
    server, _ = load_config(ServerConfig, PACKAGING / "server.example.toml")
    assert server.catalog and server.router.keys and not server.router.listen
    agent, _ = load_config(AgentConfig, PACKAGING / "agent.example.toml")
    assert agent.weights.dirs and agent.metrics.listen and agent.control_plane
    raw = tomllib.loads((PACKAGING / "agent.example.toml").read_text())
    assert "port_range" in raw["engines"]
    router, _ = load_config(StandaloneRouterConfig, PACKAGING / "router.example.toml")
    assert router.router.listen and router.admin_url
    assert load_catalog(PACKAGING / "catalog.example.toml").models

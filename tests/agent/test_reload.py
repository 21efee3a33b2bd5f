"""What a reload of agent.toml takes now and what waits for a restart (pure)."""

from __future__ import annotations

import msgspec

from llmgw.agent.reload import plan
from llmgw.config import AgentConfig
from llmgw.config.schema import EnginesConfig, InventoryOverrides, WeightsConfig

BASE = AgentConfig(control_plane=["cp:7443"])


def test_nothing_changed_says_so() -> None:
    change = plan(BASE, BASE)
    assert change.line("agent.toml") == "reloaded agent.toml: nothing changed"
    assert change.running == BASE


def test_what_is_read_as_it_goes_is_taken_and_the_rest_is_named() -> None:
    read = msgspec.structs.replace(
        BASE,
        control_plane=["cp:7443", "cp2:7443"],
        log_level="debug",
        inventory=InventoryOverrides(labels={"role": "coding"}, fabric="ib-b"),
        weights=WeightsConfig(dirs=["/models"]),
        engines=EnginesConfig(llama_server="/opt/x/llama-server", port_range=[21000, 21099]),
    )
    change = plan(BASE, read)
    assert change.line("/etc/llmgw/agent.toml") == (
        "reloaded /etc/llmgw/agent.toml: log_level changed (debug), fabric changed (ib-b),"
        " labels changed (role=coding), weights.dirs changed, engines.llama_server changed;"
        " control_plane, engines.port_range changes need a restart"
    )
    r = change.running
    assert r.inventory.labels == {"role": "coding"} and r.log_level == "debug"
    assert r.engines.llama_server == "/opt/x/llama-server"
    assert r.control_plane == ["cp:7443"] and r.engines.port_range == [20000, 20999]
    # read again, unchanged: what still waits is said again, nothing is taken twice
    again = plan(r, read)
    assert again.taken == [] and again.restart == ["control_plane", "engines.port_range"]
    assert again.line("a.toml") == (
        "reloaded a.toml: nothing to take now; control_plane, engines.port_range changes"
        " need a restart"
    )

"""Which grace a stop gets (pure), and the profile's bound in the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.supervisor import SupervisorSettings, stop_grace
from llmgw.config import ConfigError
from llmgw.controlplane.catalog import parse_catalog
from llmgw.protocol.messages import ShardSpec

SPEC = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", engine="llama.cpp")
AGENT = SupervisorSettings(state_dir=Path("/nonexistent"), stop_grace_s=7)


def test_asked_then_the_profiles_then_the_agents() -> None:
    assert stop_grace(SPEC, AGENT, 2.0) == 2.0  # a stop that names one (an older plane)
    assert stop_grace(SPEC, AGENT) == 7  # the agent's [engines] stop_grace_s
    profiled = ShardSpec(**{**_fields(SPEC), "stop_grace_s": 30.0})
    assert stop_grace(profiled, AGENT) == 30.0


def _fields(spec: ShardSpec) -> dict[str, object]:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


@pytest.mark.parametrize("grace", ["0", "-1", "3601", "nan"])
def test_a_profile_grace_out_of_bounds_is_refused_naming_its_key(grace: str) -> None:
    text = f"""
[models.m]
[[models.m.profiles]]
name = "cpu"
engine = "llama.cpp"
model_path = "/m.gguf"
stop_grace_s = {grace}
"""
    with pytest.raises(ConfigError) as info:
        parse_catalog(text, "catalog.toml")
    assert "models.m.profiles[cpu].stop_grace_s: must be greater than 0 and at most 3600" in str(
        info.value
    )

"""Where ctl finds the server's config when it is not told (llmgw/cli/defaults.py)."""

from __future__ import annotations

from pathlib import Path

from llmgw.cli.defaults import DEFAULT_SERVER_CONFIG, server_config


def test_the_flag_wins_then_the_environment_then_the_default_if_it_exists(
    tmp_path: Path,
) -> None:
    default = tmp_path / "server.toml"
    flag, env = Path("flag.toml"), {"LLMGW_SERVER_CONFIG": "env.toml"}
    assert server_config(flag, env, default) == (flag, False)
    assert server_config(None, env, default) == (Path("env.toml"), False)
    assert server_config(None, {}, default) == (None, False)  # no such file: nothing
    assert server_config(None, {"LLMGW_SERVER_CONFIG": ""}, default) == (None, False)
    default.write_text("")
    assert server_config(None, {}, default) == (default, True)
    assert server_config(None, env, default) == (Path("env.toml"), False)


def test_the_default_is_where_init_writes() -> None:
    assert Path("/etc/llmgw/server.toml") == DEFAULT_SERVER_CONFIG

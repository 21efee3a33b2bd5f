"""Config files: typed, bounded, overridable, and every error names file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import AgentConfig, ConfigError, ServerConfig, load_config, parse_hostport


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def error(kind: type, path: Path | None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(kind, path, overrides or [])
    return str(info.value)


def test_defaults_are_valid_and_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    cfg, base = load_config(ServerConfig, write(tmp_path, ""))
    assert base == tmp_path
    assert cfg.liveness.unreachable_after_s == 15
    assert cfg.admin.listen.startswith("127.0.0.1:")  # admin is loopback by default


def test_integers_are_accepted_where_seconds_are_floats(tmp_path: Path) -> None:
    cfg, _ = load_config(ServerConfig, write(tmp_path, "[liveness]\nlost_after_s = 90\n"))
    assert cfg.liveness.lost_after_s == 90.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[liveness]\nlost_after_s = "x"', "liveness.lost_after_s: expected `float`, got `str`"),
        ("[admin]\nlisten_on = 1", "admin.listen_on: unknown key (is it misspelt?)"),
        ("typo = 1", "typo: unknown key (is it misspelt?)"),
        ("[liveness]\nlost_after_s = 10", "liveness.lost_after_s: must be longer than"),
        (
            "[liveness]\nunreachable_after_s = 2",
            "unreachable_after_s: must be longer than liveness.heartbeat",
        ),
        ("[liveness]\nlost_after_s = 1e9", "liveness.lost_after_s: must be at most 604800"),
        ("[liveness]\nheartbeat_interval_s = 0", "heartbeat_interval_s: must be greater than 0"),
        ('[admin]\nlisten = "nowhere"', "admin.listen: 'nowhere' has no port"),
        ('[agent_stream]\nlisten = "h:99999"', "agent_stream.listen: 'h:99999': port '99999'"),
        ('log_level = "chatty"', "log_level: 'chatty' is not one of"),
        ("[liveness\n", "not valid TOML"),
    ],
)
def test_server_config_errors_name_the_file_and_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    message = error(ServerConfig, path)
    assert message.startswith(f"{path}: ")
    assert expected in message


def test_missing_file_is_named(tmp_path: Path) -> None:
    assert error(ServerConfig, tmp_path / "nope.toml") == (
        f"{tmp_path / 'nope.toml'}: cannot read: No such file or directory"
    )


def test_a_file_that_cannot_be_used_is_one_error_naming_it(tmp_path: Path) -> None:
    """Not UTF-8, a folder, nested past what the parser can follow: each is a
    ConfigError (one line, exit 2 at start), never a traceback."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'state_dir = "st"\nlog_level = "caf\xe9"\n')
    assert error(ServerConfig, bad) == (
        f"{bad}: not UTF-8 text (byte 0xe9 on line 2): save it as UTF-8"
    )
    assert error(ServerConfig, tmp_path) == f"{tmp_path}: cannot read: Is a directory"
    deep = write(tmp_path, "a = " + "[" * 100_000)
    assert error(ServerConfig, deep) == f"{deep}: not valid TOML: nested too deeply"


def test_catalog_files_that_cannot_be_used_are_one_error_naming_them(tmp_path: Path) -> None:
    from llmgw.controlplane.catalog import load_catalog

    bad = tmp_path / "catalog.toml"
    bad.write_bytes(b'[models.m]\nstatic_endpoints = ["http://h\xff:1"]\n')
    with pytest.raises(ConfigError) as info:
        load_catalog(bad)
    assert str(info.value) == f"{bad}: not UTF-8 text (byte 0xff on line 2): save it as UTF-8"
    bad.write_text("[models.m]\nx = " + "{y = " * 100_000)
    with pytest.raises(ConfigError) as info:
        load_catalog(bad)
    assert str(info.value) == f"{bad}: not valid TOML: nested too deeply"


@pytest.mark.parametrize("listen", ["127.0.0.1:7444", "127.9.9.9:1", "localhost:1", "[::1]:1"])
def test_admin_on_loopback_needs_no_opt_in(tmp_path: Path, listen: str) -> None:
    cfg, _ = load_config(ServerConfig, write(tmp_path, f'[admin]\nlisten = "{listen}"\n'))
    assert cfg.admin.listen == listen


@pytest.mark.parametrize("listen", ["0.0.0.0:7444", "10.0.0.1:7444", "[::]:1", "cp.example:1"])
def test_admin_beyond_loopback_is_refused_unless_opted_in(tmp_path: Path, listen: str) -> None:
    path = write(tmp_path, f'[admin]\nlisten = "{listen}"\n')
    assert error(ServerConfig, path).startswith(
        f"{path}: admin.listen: {listen!r} is not loopback, and the admin API is plain HTTP"
    )
    cfg, _ = load_config(ServerConfig, path, ["admin.insecure_listen=true"])
    assert cfg.admin.insecure_listen


def test_overrides_win_and_are_checked_by_the_same_rules(tmp_path: Path) -> None:
    path = write(tmp_path, "[liveness]\nlost_after_s = 90\n")
    cfg, _ = load_config(ServerConfig, path, ["liveness.lost_after_s=120", "admin.listen=[::1]:9"])
    assert cfg.liveness.lost_after_s == 120
    assert cfg.admin.listen == "[::1]:9"
    message = error(ServerConfig, path, ["liveness.lost_after_s=1"])
    assert "(overridden on the command line): liveness.lost_after_s: must be longer" in message
    assert "an override is written KEY=VALUE" in error(ServerConfig, path, ["justakey"])


def test_agent_needs_a_control_plane(tmp_path: Path) -> None:
    assert "control_plane: no control plane address given" in error(
        AgentConfig, write(tmp_path, "")
    )
    cfg, _ = load_config(
        AgentConfig, write(tmp_path, 'control_plane = ["cp:7443", "[fd00::1]:7443"]')
    )
    assert cfg.control_plane == ["cp:7443", "[fd00::1]:7443"]
    assert "control_plane[1]" in error(
        AgentConfig, write(tmp_path, 'control_plane = ["cp:7443", "cp"]')
    )


def test_agent_inventory_overrides_are_bounded(tmp_path: Path) -> None:
    text = 'control_plane = ["cp:1"]\n[inventory]\nmemory_gb = -4\n'
    assert "inventory.memory_gb: must be greater than 0" in error(
        AgentConfig, write(tmp_path, text)
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:7443", ("127.0.0.1", 7443)),
        ("[::1]:7443", ("::1", 7443)),
        ("cp.example.net:1", ("cp.example.net", 1)),
    ],
)
def test_parse_hostport(value: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(value) == expected


def test_parse_hostport_defaults_and_errors() -> None:
    assert parse_hostport("fd00::1", default_port=7) == ("fd00::1", 7)
    for bad in ("[::1", "[::1]x", ":80", "h:port"):
        with pytest.raises(ConfigError):
            parse_hostport(bad)


def test_admin_token_files_that_cannot_be_used_are_one_error_naming_them(tmp_path: Path) -> None:
    from llmgw.serve.server import admin_token

    token = tmp_path / "token"
    cfg, base = load_config(ServerConfig, write(tmp_path, '[admin]\ntoken_file = "token"\n'))
    token.write_bytes(b"caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        admin_token(cfg, base)
    assert str(info.value) == (
        f"{token}: admin.token_file: not UTF-8 text (byte 0xe9 on line 1): save it as UTF-8"
    )
    token.write_text("\n")
    with pytest.raises(ConfigError) as info:
        admin_token(cfg, base)
    assert str(info.value) == f"{token}: admin.token_file: is empty: write the token in it"
    cfg, base = load_config(ServerConfig, write(tmp_path, 'state_dir = "st"\n'))
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "admin-token").write_bytes(b"\xff")
    with pytest.raises(ConfigError) as info:
        admin_token(cfg, base)
    assert "not UTF-8 text" in str(info.value)

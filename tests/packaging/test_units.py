"""The systemd units in packaging/: what they promise, checked by systemd-analyze."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw.cli.onboard import agent_toml
from llmgw.config import AgentConfig, load_config
from llmgw.config.schema import resolve

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
UNITS = sorted(PACKAGING.glob("llmgw-*.service"))


def service(unit: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read(unit)
    return dict(parser["Service"])


def test_every_unit_is_there() -> None:
    assert [u.name for u in UNITS] == [
        "llmgw-agent.service",
        "llmgw-router.service",
        "llmgw-server.service",
    ]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verify_finds_nothing_wrong(unit: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed: install systemd to check the units")
    # verify reads the unit where it lies; a copy keeps packaging/ free of side effects
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text())
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    # an unknown key or a bad value is only a warning to systemd: it must not be there
    assert done.stderr.strip() == "", done.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_each_unit_runs_the_single_file_as_its_own_user_and_reloads_on_sighup(
    unit: Path,
) -> None:
    s = service(unit)
    role = unit.stem.removeprefix("llmgw-")
    assert s["ExecStart"].startswith(f"/usr/bin/python3 /opt/llmgw/llmgw.pyz {role} --config")
    assert s["User"] == "llmgw" and "llmgw" in s["StateDirectory"].split()
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["RestartPreventExitStatus"] == "2"  # a config error does not restart for ever
    assert s["NoNewPrivileges"] == "yes"
    # where the single file unpacks: a directory the unit's user may write
    assert "PEX_ROOT=/var/lib/llmgw/" in s["Environment"]


def test_the_agent_leaves_engines_running_and_can_reach_the_gpus() -> None:
    s = service(PACKAGING / "llmgw-agent.service")
    assert s["KillMode"] == "process"  # engines outlive an agent restart
    assert "PrivateDevices" not in s and "DevicePolicy" not in s  # /dev/nvidia*


def test_the_units_user_is_created_by_sysusers() -> None:
    lines = [
        line.split()
        for line in (PACKAGING / "llmgw.sysusers.conf").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0][:2] == ["u", "llmgw"]


def test_the_onboarded_agent_file_and_the_unit_agree_on_the_state_dir(tmp_path: Path) -> None:
    """The unit's agent and one run by hand (``llmgw agent --config
    /etc/llmgw/agent.toml``) with the file ``ctl onboard`` wrote resolve the same
    state dir, and it is the unit's StateDirectory."""
    s = service(PACKAGING / "llmgw-agent.service")
    argv = shlex.split(s["ExecStart"])
    config = Path(argv[argv.index("--config") + 1])
    unit_sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    # the bundle as it lies in /etc/llmgw on the node (relative paths resolve there)
    etc = tmp_path / config.parent.relative_to("/")
    etc.mkdir(parents=True)
    (etc / config.name).write_text(agent_toml("n1", ["cp.example.net:7443"], None, {}))
    by_unit, base = load_config(AgentConfig, etc / config.name, unit_sets)
    by_hand, hand_base = load_config(AgentConfig, etc / config.name)
    state_directory = Path("/var/lib") / s["StateDirectory"].split()[0]
    assert resolve(base, by_unit.state_dir) == state_directory
    assert resolve(hand_base, by_hand.state_dir) == state_directory
    assert s["WorkingDirectory"] == str(state_directory)

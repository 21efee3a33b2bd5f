"""``llmgw ctl cert`` end to end: real processes, real exit codes, real files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Literal

import cyclopts
import pytest
from cryptography import x509

from llmgw.cli.cert import cert_app

REPO = Path(__file__).resolve().parents[2]
PREFIX = "llmgw ctl cert: "


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LLMGW_PKI_DIR"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ.update(env or {})
    return subprocess.run(
        # runpy warns when llmgw.cli's __init__ already imported this module; harmless here.
        [sys.executable, "-W", "ignore::RuntimeWarning:runpy", "-m", "llmgw.cli.cert", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(PREFIX), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_server_agent_show(tmp_path: Path) -> None:
    init = run("init", "--dir", "pki", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    assert init.stdout.splitlines() == ["wrote pki/ca-key.pem (0600)", "wrote pki/ca.pem (0644)"]
    assert mode(tmp_path / "pki" / "ca-key.pem") == 0o600

    server = run("server", "cp.example.com", "127.0.0.1", "[::1]", "--dir", "pki", cwd=tmp_path)
    assert server.returncode == 0, server.stderr
    assert server.stdout.splitlines() == [
        "wrote pki/server-key.pem (0600)",
        "wrote pki/server.pem (0644)",
        "subjectAltName: DNS:cp.example.com, IP:127.0.0.1, IP:::1",
    ]
    cert = x509.load_pem_x509_certificate((tmp_path / "pki" / "server.pem").read_bytes())
    cert.verify_directly_issued_by(
        x509.load_pem_x509_certificate((tmp_path / "pki" / "ca.pem").read_bytes())
    )

    agent = run("agent", "gpu-node-01", "--dir", "pki", "--out", "nodes", cwd=tmp_path)
    assert agent.returncode == 0, agent.stderr
    assert agent.stdout.splitlines() == [
        "wrote nodes/gpu-node-01-key.pem (0600)",
        "wrote nodes/gpu-node-01.pem (0644)",
    ]
    assert mode(tmp_path / "nodes" / "gpu-node-01-key.pem") == 0o600

    show = run("show", "nodes/gpu-node-01.pem", cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    fields = dict(line.split(":", 1) for line in show.stdout.splitlines())
    assert fields["subject CN"].strip() == "gpu-node-01"
    assert fields["issuer CN"].strip() == "llmgw CA"
    assert fields["usage"].strip() == "clientAuth"
    assert fields["SANs"].strip() == "DNS:gpu-node-01"
    assert "EXPIRED" not in fields["not after"]


def test_pki_dir_from_environment(tmp_path: Path) -> None:
    env = {"LLMGW_PKI_DIR": str(tmp_path / "from-env")}
    assert run("init", cwd=tmp_path, env=env).returncode == 0
    assert (tmp_path / "from-env" / "ca-key.pem").exists()
    proc = run("agent", "n1", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "from-env" / "n1.pem").exists()
    assert not (tmp_path / "pki").exists()


def test_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    no_ca = run("agent", "n1", "--dir", "pki", cwd=tmp_path)
    assert_one_line_error(no_ca, "pki/ca.pem", "llmgw ctl cert init")
    assert not (tmp_path / "pki").exists()

    assert run("init", "--dir", "pki", cwd=tmp_path).returncode == 0
    before = (tmp_path / "pki" / "ca-key.pem").read_bytes()
    again = run("init", "--dir", "pki", cwd=tmp_path)
    assert_one_line_error(again, "pki/ca-key.pem already exists", "--force")
    assert (tmp_path / "pki" / "ca-key.pem").read_bytes() == before

    assert_one_line_error(run("server", "--dir", "pki", cwd=tmp_path), "no hosts given")
    assert_one_line_error(
        run("server", "cp:8443", "--dir", "pki", cwd=tmp_path), "'cp:8443'", "neither"
    )
    assert_one_line_error(run("agent", "rack/3", "--dir", "pki", cwd=tmp_path), "slashes")
    assert_one_line_error(run("show", "missing.pem", cwd=tmp_path), "missing.pem")


def test_force_replaces_the_ca(tmp_path: Path) -> None:
    assert run("init", "--dir", "pki", cwd=tmp_path).returncode == 0
    before = (tmp_path / "pki" / "ca.pem").read_bytes()
    proc = run("init", "--dir", "pki", "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "pki" / "ca.pem").read_bytes() != before


# --------------------------------------------------------------------------- in process


def test_in_process_return_value_and_exit_code(tmp_path: Path) -> None:
    assert cert_app(["init", "--dir", str(tmp_path)], result_action="return_value") is None
    with pytest.raises(SystemExit) as info:
        cert_app(["init", "--dir", str(tmp_path)], result_action="return_value")
    assert info.value.code == 2


@pytest.mark.parametrize("result_action", [None, "return_value"])
def test_exit_code_survives_mounting(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    result_action: Literal["return_value"] | None,
) -> None:
    """Mounted under ``llmgw ctl`` the error still exits 2, whatever the parent does."""
    root = cyclopts.App(name="llmgw")
    ctl = cyclopts.App(name="ctl")
    root.command(ctl)
    ctl.command(cert_app)
    with pytest.raises(SystemExit) as info:
        root(
            ["ctl", "cert", "agent", "n1", "--dir", str(tmp_path / "none")],
            result_action=result_action,
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX)
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("command", "phrase"),
    [
        ("init", "0600"),
        ("server", "subjectAltNames"),
        ("agent", "CN = NODE"),
        ("show", "fingerprint"),
    ],
)
def test_help_explains_each_command(
    capsys: pytest.CaptureFixture[str], command: str, phrase: str
) -> None:
    cert_app([command, "--help"], result_action="return_value")
    out = " ".join(capsys.readouterr().out.split())
    assert phrase in out

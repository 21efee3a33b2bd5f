"""The README's first command, run as a new user would: ``tools/fleet --check``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ports import own_port
from tests.realparts import needs_server

ROOT = Path(__file__).resolve().parents[2]


@needs_server
def test_the_fleet_command_serves_the_tiny_model_to_the_openai_client(tmp_path: Path) -> None:
    """A CA, a control plane, an agent, a real llama-server with the generated
    model, and the router: ``--check`` asks through the openai SDK and stops."""
    ports = [own_port() for _ in range(4)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.fleet",
            "--check",
            "--dir",
            str(tmp_path / "fleet"),
            "--stream-port",
            str(ports[0]),
            "--admin-port",
            str(ports[1]),
            "--router-port",
            str(ports[2]),
            "--console-port",
            str(ports[3]),
            # not the default 20000: the agent kills what it does not know on its
            # engine ports, and a developer's own tools/fleet may be running there
            "--engine-ports",
            str(24000 + (os.getpid() % 80) * 100),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert f"base URL: http://127.0.0.1:{ports[2]}/v1" in text
    assert "API key:  llmgw-" in text
    assert "check: the model answered" in text
    assert f"web console: http://127.0.0.1:{ports[3]}/ (viewer token in" in text

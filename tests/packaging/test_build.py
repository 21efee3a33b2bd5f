"""tools/build's single file, run as a node runs it: a bare python3, no pip, no deps.

The default run builds the file for this host's python (about 10-20 s, once a session
for the tests that run it, twice more to compare the bytes) and once for every node
(x86_64 and aarch64, CPython 3.11 to 3.13, about 40 s) to check its wheels;
LLMGW_SLOW=1 also builds the file for every node twice and compares the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.cli.onboard import install_txt
from llmgw.version import describe
from tests.builds import build, built
from tests.ports import own_port
from tests.privateroot import needs_root, run_private

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built(tmp_path_factory)  # once a session, shared with the upgrade test


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A venv without pip made from the test interpreter's base: nothing installed."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python3"
    probe = subprocess.run(
        [str(python), "-I", "-c", "import msgspec"], capture_output=True, text=True, check=False
    )
    assert probe.returncode != 0, "the bare venv can import msgspec: the test would prove nothing"
    return [str(python), "-I"]


class Node:
    """Runs the file from a clean directory, as a node would."""

    def __init__(self, python: list[str], pyz: Path, workdir: Path) -> None:
        self.argv = [*python, str(pyz)]
        self.workdir = workdir
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(workdir),
            # beside the file: unpacked once a session, as on a node
            "PEX_ROOT": str(pyz.parent / "pex-root"),
            "PYTHONUNBUFFERED": "1",
        }

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.argv, *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"llmgw.pyz {args} failed ({result.returncode}):\n{result.stderr}")
        return result

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*self.argv, *args],
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return proc, log


async def wait_log(proc: subprocess.Popen[bytes], log: Path, pattern: str) -> re.Match[str]:
    with trio.move_on_after(30):
        while proc.poll() is None:
            found = re.search(pattern, log.read_text(errors="replace"))
            if found:
                return found
            await trio.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {log.name} (exit {proc.poll()}):\n{log.read_text()}")


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_the_file_says_its_version_and_the_commit_it_was_built_from(
    pyz: Path, bare_python: list[str], tmp_path: Path
) -> None:
    node = Node(bare_python, pyz, tmp_path)
    out = node.run("--version").stdout.strip()
    # the build is the checkout's commit, from _build.txt inside the file, not from git
    assert out == describe(), out
    assert not (ROOT / "llmgw" / "_build.txt").exists(), "a _build.txt was left in the checkout"
    with zipfile.ZipFile(pyz) as z:
        assert z.read("llmgw/_build.txt").decode().strip() in out
    # the node's own python3, when it is new enough, runs it too
    system = Path("/usr/bin/python3")
    if system.exists():
        version = subprocess.run(
            [str(system), "-c", "import sys; print(sys.version_info >= (3, 11))"],
            capture_output=True,
            text=True,
            check=False,
        )
        if version.stdout.strip() == "True":
            system_node = Node([str(system), "-I"], pyz, tmp_path)
            assert system_node.run("--version").stdout.strip() == out


async def test_a_server_and_an_agent_from_the_file_register_over_mutual_tls(
    pyz: Path, bare_python: list[str], tmp_path: Path
) -> None:
    node = Node(bare_python, pyz, tmp_path)
    node.run("ctl", "cert", "init", "--dir", "pki")
    node.run("ctl", "cert", "server", "127.0.0.1", "--dir", "pki")
    node.run("ctl", "cert", "agent", "n1", "--dir", "pki")
    assert {p.name for p in (tmp_path / "pki").iterdir()} >= {
        "ca.pem",
        "ca-key.pem",
        "server.pem",
        "server-key.pem",
        "n1.pem",
        "n1-key.pem",
    }
    (tmp_path / "server.toml").write_text(
        'state_dir = "state"\n'
        "[agent_stream]\n"
        'listen = "127.0.0.1:0"\n'
        'ca = "pki/ca.pem"\ncert = "pki/server.pem"\nkey = "pki/server-key.pem"\n'
        "[liveness]\nheartbeat_interval_s = 0.2\n"
        '[admin]\nlisten = "127.0.0.1:0"\n'
        '[console]\nlisten = "127.0.0.1:0"\n'
    )
    server, server_log = node.start("server", "server", "--config", "server.toml")
    agent = None
    try:
        m = await wait_log(server, server_log, r"agent stream listening on 127\.0\.0\.1:(\d+)")
        port = int(m.group(1))
        admin = (await wait_log(server, server_log, r"admin API listening on (http://\S+)"))[1]
        # the web console's page comes out of the file itself
        console = (await wait_log(server, server_log, r"web console on (http://\S+)/ "))[1]
        async with httpx.AsyncClient(base_url=console, timeout=10) as client:
            for path, name in (("/", "index.html"), ("/static/console.js", "console.js")):
                page = await client.get(path)
                assert page.status_code == 200, (path, page.text)
                assert page.content == (ROOT / "llmgw/console/static" / name).read_bytes()
        (tmp_path / "agent.toml").write_text(
            f'control_plane = ["127.0.0.1:{port}"]\nnode_id = "n1"\n'
            'ca = "pki/ca.pem"\ncert = "pki/n1.pem"\nkey = "pki/n1-key.pem"\n'
            'state_dir = "agent-state"\n'
            "[backoff]\ninitial_s = 0.1\nmax_s = 0.5\n"
            "[inventory]\nmemory_gb = 16\n"
        )
        agent, agent_log = node.start("agent", "agent", "--config", "agent.toml")
        ctl = ("ctl", "nodes", "--json", "--admin-url", admin, "--token-file", "state/admin-token")
        nodes: dict[str, object] = {}
        with trio.move_on_after(30):
            while nodes.get("n1") != "Ready":
                assert agent.poll() is None, agent_log.read_text()
                listed = json.loads(node.run(*ctl).stdout)["nodes"]
                nodes = {n["node_id"]: n["state"] for n in listed}
                await trio.sleep(0.1)
        assert nodes.get("n1") == "Ready", f"{nodes}\n{server_log.read_text()}"
        # the agent reports the build the file carries
        shown = json.loads(node.run(*ctl).stdout)["nodes"][0]
        assert describe().split(" (build ")[1].rstrip(")") in json.dumps(shown)
    finally:
        stop(*(p for p in (agent, server) if p is not None))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def differing(a: Path, b: Path) -> list[str]:
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        ea = {i.filename: (i.CRC, i.date_time, i.external_attr) for i in za.infolist()}
        eb = {i.filename: (i.CRC, i.date_time, i.external_attr) for i in zb.infolist()}
    return sorted(n for n in ea.keys() | eb.keys() if ea.get(n) != eb.get(n))


def snapshot(tmp_path: Path) -> Path:
    """A copy of the commit with a fixed author and date, so that nothing changes the
    inputs between two builds (not other work in the checkout, not the clock)."""
    src = tmp_path / "src"
    src.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    (src / ".venv").symlink_to(ROOT / ".venv")
    when = "2026-01-01T00:00:00Z"
    git_env = dict(
        os.environ,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
        GIT_AUTHOR_DATE=when,
        GIT_COMMITTER_DATE=when,
    )
    for git in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(["git", *git], cwd=src, env=git_env, check=True, capture_output=True)
    return src


def test_the_same_inputs_build_the_same_bytes(tmp_path: Path) -> None:
    """Two builds of one commit for this host are the same file, byte for byte."""
    src = snapshot(tmp_path)
    first = build(tmp_path / "a" / "llmgw.pyz", host=True, root=src)
    second = build(tmp_path / "b" / "llmgw.pyz", host=True, root=src)
    assert sha256(first) == sha256(second), f"two builds differ in: {differing(first, second)}"


def test_the_file_for_every_node_holds_each_platforms_wheels(tmp_path: Path) -> None:
    """The file every node runs: x86_64 and aarch64, CPython 3.11 to 3.13."""
    check_wheels(build(tmp_path / "llmgw.pyz", host=False, root=snapshot(tmp_path)))


def check_wheels(pyz: Path) -> None:
    with zipfile.ZipFile(pyz) as z:
        wheels = {n.split("/")[1] for n in z.namelist() if n.startswith(".deps/") and "/" in n[6:]}
    for arch in ("x86_64", "aarch64"):
        for mod in ("msgspec", "httptools", "cffi"):
            for minor in (11, 12, 13):
                assert any(
                    w.startswith(f"{mod}-") and f"-cp3{minor}-" in w and arch in w for w in wheels
                ), f"no {mod} wheel for cp3{minor} {arch}: {sorted(wheels)}"
        assert any(w.startswith("cryptography-") and arch in w for w in wheels)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("LLMGW_SLOW"), reason="opt-in: LLMGW_SLOW=1 (two full builds, ~80 s)"
)
def test_the_file_for_every_node_builds_the_same_twice(tmp_path: Path) -> None:
    src = snapshot(tmp_path)
    first = build(tmp_path / "a" / "llmgw.pyz", host=False, root=src)
    second = build(tmp_path / "b" / "llmgw.pyz", host=False, root=src)
    assert sha256(first) == sha256(second), f"two builds differ in: {differing(first, second)}"
    check_wheels(first)


@needs_root
async def test_installed_as_install_txt_says_llmgw_is_on_path_and_ctl_finds_the_server(
    pyz: Path, bare_python: list[str], tmp_path: Path
) -> None:
    """The install steps INSTALL.txt prints, run in a private /etc, /opt and /usr/local
    (tests/privateroot.py): ``llmgw`` is on PATH, a link to the file, and a plain
    ``llmgw ctl nodes`` (step 5) reads /etc/llmgw/server.toml and reaches the server."""
    system = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print(sys.version_info >= (3, 11))"],
        capture_output=True,
        text=True,
        check=False,
    )
    if system.stdout.strip() != "True":
        pytest.skip("/usr/bin/python3 is older than 3.11: the file's #! would not run it")
    steps = [
        line.strip().removeprefix("sudo ")
        for line in install_txt("n1", "n1.tar", tar=True).splitlines()
        if "/usr/local/bin/llmgw" in line or "install -D" in line or "llmgw ctl nodes" in line
    ]
    assert steps == [
        "install -D -m 0755 llmgw.pyz /opt/llmgw/llmgw.pyz",
        "ln -sf /opt/llmgw/llmgw.pyz /usr/local/bin/llmgw",
        "llmgw ctl nodes",
    ], steps
    node = Node(bare_python, pyz, tmp_path)
    node.run("ctl", "cert", "init", "--dir", "pki")
    node.run("ctl", "cert", "server", "127.0.0.1", "--dir", "pki")
    pki = tmp_path / "pki"
    (tmp_path / "server.toml").write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        "[agent_stream]\n"
        'listen = "127.0.0.1:0"\n'
        f'ca = "{pki / "ca.pem"}"\ncert = "{pki / "server.pem"}"\n'
        f'key = "{pki / "server-key.pem"}"\n'
        f'[admin]\nlisten = "127.0.0.1:{own_port()}"\n'
    )
    server, server_log = node.start("server", "server", "--config", "server.toml")
    try:
        await wait_log(server, server_log, r"admin API listening on")
        install, link, ctl = steps
        dist = tmp_path / "dist"  # where the file lies under the name INSTALL.txt gives it
        dist.mkdir()
        shutil.copy(pyz, dist / "llmgw.pyz")
        script = f"""
cd {shlex.quote(str(dist))}
{install} && {link} || exit 9
mkdir -p /etc/llmgw && cp {shlex.quote(str(tmp_path / "server.toml"))} /etc/llmgw/ || exit 9
cd /
command -v llmgw
{ctl} --json
"""
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            **{k: node.env[k] for k in ("HOME", "PEX_ROOT")},
        }
        result = run_private(tmp_path, script, dirs=("/etc", "/opt", "/usr/local"), env=env)
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
        where, listed = result.stdout.split("\n", 1)
        assert where == "/usr/local/bin/llmgw"
        assert json.loads(listed)["nodes"] == []
    finally:
        stop(server)

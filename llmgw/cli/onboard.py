"""``llmgw ctl onboard NODE``: a node's certificate and agent file, in one bundle.

The bundle (a directory, or a tar file when ``--out`` ends in ``.tar``) holds
what goes into ``/etc/llmgw`` on the node: ``agent.toml`` with only the
overrides given here (the node id, the control plane's address, a fabric,
labels) and the unit's state dir, so the agent file is otherwise the same on
every node and an agent run by hand with it uses the unit's state dir; ``pki/`` with
the CA's certificate and the node's certificate and key (0600), where the
agent looks for them by default; and ``INSTALL.txt``. It refuses to overwrite
a bundle that exists.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Annotated, NoReturn

from cyclopts import Parameter

from llmgw.addr import join_hostport
from llmgw.cli.defaults import server_config
from llmgw.config import AgentConfig, ConfigError, ServerConfig, load_config, parse_hostport
from llmgw.config.schema import resolve
from llmgw.files import write_atomic
from llmgw.tls.ca import CA, CA_CERT_NAME, CAError, describe_certificate, issue_agent, load_ca

__all__ = ["onboard"]

PROG = "llmgw ctl onboard"
UNIT_STATE_DIR = "/var/lib/llmgw"  # packaging/llmgw-agent.service's StateDirectory


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _q(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value, ensure_ascii=False)


def agent_toml(node: str, servers: list[str], fabric: str | None, labels: dict[str, str]) -> str:
    lines = [
        f"# llmgw agent on node {node}, written by llmgw ctl onboard: only what was given;",
        "# everything else is discovered or a default (packaging/agent.example.toml).",
        f"# The TLS files are the defaults beside this file: pki/ca.pem, pki/{node}.pem,",
        f"# pki/{node}-key.pem.",
        "",
        "control_plane = [" + ", ".join(_q(s) for s in servers) + "]",
        f"node_id = {_q(node)}",
        "# the unit's (llmgw-agent.service: StateDirectory=llmgw), so that an agent run by",
        "# hand with this file reads the same shard records",
        f"state_dir = {_q(UNIT_STATE_DIR)}",
    ]
    if fabric or labels:
        lines += ["", "[inventory]"]
        if fabric:
            lines.append(f"fabric = {_q(fabric)}")
        if labels:
            inline = ", ".join(f"{_q(k)} = {_q(v)}" for k, v in labels.items())
            lines.append(f"labels = {{ {inline} }}")
    return "\n".join(lines) + "\n"


def install_txt(node: str, bundle: str, tar: bool) -> str:
    copy = (
        f"     scp {bundle} {node}:/tmp/\n"
        f"     ssh {node} sudo install -d -m 0755 /etc/llmgw\n"
        f"     ssh {node} sudo tar -xpf /tmp/{bundle} -C /etc/llmgw\n"
        if tar
        else f"     scp -r {bundle} {node}:/tmp/\n"
        f"     ssh {node} sudo install -d -m 0755 /etc/llmgw\n"
        f"     ssh {node} sudo cp -rp /tmp/{bundle}/. /etc/llmgw/\n"
    )
    return f"""\
Installing the llmgw agent on node {node}

1. Put this bundle in /etc/llmgw on the node (it holds agent.toml, pki/ and this file):
{copy}
   pki/{node}-key.pem is the node's secret: keep it 0600, give it to the user the
   agent runs as (llmgw, from the project's packaging/llmgw.sysusers.conf:
   sudo cp llmgw.sysusers.conf /usr/lib/sysusers.d/llmgw.conf && sudo systemd-sysusers),
   and delete the copy in /tmp:
     ssh {node} sudo chown llmgw:llmgw /etc/llmgw/pki/{node}-key.pem

2. Install the program, one file that needs only python3 >= 3.11, and put it on PATH
   (the file runs itself: its first line is #!/usr/bin/env python3):
     sudo install -D -m 0755 llmgw.pyz /opt/llmgw/llmgw.pyz
     sudo ln -sf /opt/llmgw/llmgw.pyz /usr/local/bin/llmgw
   and the unit, from the project's packaging/:
     sudo cp llmgw-agent.service /etc/systemd/system/ && sudo systemctl daemon-reload
   and an engine for it to run: llama.cpp's llama-server, unpacked from a release
   (https://github.com/ggml-org/llama.cpp/releases) so that
   /opt/llama.cpp/bin/llama-server exists, or anywhere with
     llama_server = "/path/to/llama-server"
   under [engines] in /etc/llmgw/agent.toml; or vLLM, with vllm on the unit's PATH
   (/usr/local/bin, /usr/bin)

3. Check before starting (it starts no engine and disturbs no running agent; it
   fails when it finds no engine):
     sudo llmgw agent --check --config /etc/llmgw/agent.toml

4. Start it, now and at every boot:
     sudo systemctl enable --now llmgw-agent

5. On the control plane, the node reads Ready (ctl reads /etc/llmgw/server.toml, which
   is root's and the server's; --config FILE or LLMGW_SERVER_CONFIG for another):
     sudo llmgw ctl nodes
"""


def _labels(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            _fail(f"--label {pair!r} is not KEY=VALUE (e.g. --label role=coding)")
        out[key.strip()] = value.strip()
    return out


def _from_server(config: Path | None) -> tuple[Path | None, str | None]:
    """The CA's folder and the address agents dial, read from the server's config."""
    path, _ = server_config(config, os.environ)
    if path is None:
        return None, None
    try:
        cfg, base = load_config(ServerConfig, path)
    except ConfigError as exc:
        _fail(str(exc))
    sc = cfg.agent_stream
    pki = resolve(base, sc.ca).parent
    try:
        _, port = parse_hostport(sc.listen, key="agent_stream.listen")
        sans = describe_certificate(resolve(base, sc.cert))["sans"]
    except (ConfigError, CAError):
        return pki, None
    first = next((s.split(":", 1)[1] for s in sans), None)
    return pki, join_hostport(first, port) if first else None


def onboard(
    node: str,
    /,
    *,
    fabric: str | None = None,
    label: Annotated[list[str] | None, Parameter(name="--label", negative="")] = None,
    server: Annotated[list[str] | None, Parameter(name="--server", negative="")] = None,
    out: Path | None = None,
    config: Annotated[Path | None, Parameter(name=["--config", "-c"])] = None,
    pki_dir: Annotated[Path | None, Parameter(name="--dir", env_var="LLMGW_PKI_DIR")] = None,
    days: int = 825,
) -> None:
    """Issue NODE's client certificate and write its install bundle: agent.toml with
    only the overrides given, the certificates and key, and INSTALL.txt.

    Parameters
    ----------
    node
        The node id (its hostname, as a rule); the certificate's common name.
    fabric
        The node's InfiniBand fabric (cannot be discovered).
    label
        A node label KEY=VALUE for profile selectors (repeatable).
    server
        HOST:PORT agents dial (repeatable); default: the server certificate's first
        name and agent_stream.listen's port, from --config.
    out
        The bundle: a directory, or a tar file when it ends in .tar
        (default: NODE-bundle).
    config
        The server's config (from llmgw init): where the CA is and what agents dial.
        [env: LLMGW_SERVER_CONFIG; default /etc/llmgw/server.toml if it exists]
    pki_dir
        The CA's folder (ca.pem, ca-key.pem); default: the one --config names.
    days
        Validity of the node's certificate in days.
    """
    labels = _labels(label or [])
    pki_from_config, dial = _from_server(config)
    pki = pki_dir or pki_from_config or Path("pki")
    servers = list(server or ([dial] if dial else []))
    if not servers:
        _fail(
            "no control plane address: give --server HOST:PORT (what the node dials),"
            " or --config SERVER.toml to read it from"
        )
    for s in servers:
        try:
            parse_hostport(s, key=f"--server {s}")
        except ConfigError as exc:
            _fail(f"--server {s!r}: {exc.problem}")
    bundle = out or Path(f"{node}-bundle")
    tar = bundle.name.endswith(".tar")
    if bundle.exists() or bundle.is_symlink():
        _fail(
            f"{bundle} already exists; refusing to overwrite a bundle (remove it or choose another --out)"
        )

    try:
        ca = load_ca(pki)
    except CAError as exc:
        _fail(str(exc))
    parent = bundle.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{bundle.name}.", dir=parent))
    except OSError as exc:
        _fail(f"cannot write in {parent}: {exc.strerror or exc}")
    try:
        _fill(work, ca.cert_path, node, servers, fabric, labels, bundle.name, tar, days, ca)
        if tar:
            _write_tar(work, bundle)
        else:
            os.chmod(work, 0o755)
            os.rename(work, bundle)  # the finished bundle appears at once, or not at all
    except OSError as exc:
        _fail(f"cannot write {bundle}: {exc.strerror or exc}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"wrote {bundle} ({'a tar file, 0600' if tar else 'a directory'}): agent.toml,"
        f" pki/{CA_CERT_NAME}, pki/{node}.pem, pki/{node}-key.pem (0600), INSTALL.txt"
    )
    print(f"node {node} dials {', '.join(servers)}; copy the bundle there and follow INSTALL.txt")


def _fill(
    work: Path,
    ca_cert: Path,
    node: str,
    servers: list[str],
    fabric: str | None,
    labels: dict[str, str],
    name: str,
    tar: bool,
    days: int,
    ca: CA,
) -> None:
    pki = work / "pki"
    pki.mkdir(mode=0o755)
    try:
        issue_agent(ca, node, pki, days=days)
    except CAError as exc:
        _fail(str(exc))
    write_atomic(pki / CA_CERT_NAME, ca_cert.read_bytes(), 0o644)
    text = agent_toml(node, servers, fabric, labels)
    write_atomic(work / "agent.toml", text.encode(), 0o644)
    try:  # what the node will read must load: a bad label or address is caught here
        load_config(AgentConfig, work / "agent.toml")
    except ConfigError as exc:
        _fail(str(exc))
    write_atomic(work / "INSTALL.txt", install_txt(node, name, tar).encode(), 0o644)


def _write_tar(work: Path, bundle: Path) -> None:
    """The bundle's files at the tar's top level, owned by root, modes kept."""

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path in sorted(work.rglob("*")):
            tf.add(path, arcname=str(path.relative_to(work)), recursive=False, filter=owned_by_root)
    # created 0600 (it holds the node's key), and never over a file that appeared meanwhile
    fd = os.open(bundle, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.getvalue())

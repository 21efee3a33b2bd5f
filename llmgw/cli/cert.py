"""``llmgw ctl cert``: run the project's private CA from the command line.

Mounted by the main CLI as ``llmgw ctl cert``; also runnable on its own as
``python -m llmgw.cli.cert``.  Every command prints one line per file written
(with the mode it really has on disk) and, on error, one line
``llmgw ctl cert: <message>`` on stderr with exit status 2, regardless of
how the enclosing app handles return values.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import cyclopts
from cyclopts import Parameter

from llmgw.tls.ca import CAError, describe_certificate, init_ca, issue_agent, issue_server, load_ca

__all__ = ["cert_app"]

PROG = "llmgw ctl cert"

cert_app = cyclopts.App(
    name="cert",
    help=(
        "Run the private CA that authenticates agents and the control plane.\n\n"
        "Typical flow: `init` once, `server` with every name and IP agents dial, "
        "then `agent NODE` per node; copy ca.pem, NODE.pem and NODE-key.pem to the node."
    ),
)

PkiDir = Annotated[
    Path,
    Parameter(
        name="--dir",
        env_var="LLMGW_PKI_DIR",
        help="Directory holding ca.pem and ca-key.pem.",
    ),
]
OutDir = Annotated[
    Path | None,
    Parameter(name="--out", help="Where to write the new files (default: the --dir)."),
]


def _fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2 (the same status cyclopts uses for usage errors)."""
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _wrote(*paths: Path) -> None:
    for path in paths:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        print(f"wrote {path} ({mode:04o})")


@cert_app.command
def init(
    *,
    pki_dir: PkiDir = Path("pki"),
    name: str = "llmgw CA",
    days: int = 3650,
    force: Annotated[bool, Parameter(negative="")] = False,
) -> None:
    """Create the CA (ca.pem for every node, ca-key.pem kept secret, mode 0600).

    Parameters
    ----------
    pki_dir
        Directory to create the CA in.
    name
        Common name of the CA certificate.
    days
        Validity of the CA in days.
    force
        Replace an existing CA. Every certificate it issued stops being trusted.
    """
    try:
        files = init_ca(pki_dir, name=name, days=days, force=force)
    except CAError as exc:
        _fail(str(exc))
    _wrote(files.key, files.cert)


@cert_app.command
def server(
    *hosts: str,
    pki_dir: PkiDir = Path("pki"),
    name: str = "server",
    days: int = 825,
    out: OutDir = None,
) -> None:
    """Issue the control plane's certificate for every HOST agents dial.

    Agents check the address they dial against the certificate's
    subjectAltNames and ignore its common name, so list every DNS name and
    every IP address (IPv6 as ::1 or [::1]) that appears in agents' config.

    Parameters
    ----------
    hosts
        DNS names and IP addresses agents dial.
    pki_dir
        Directory holding the CA.
    name
        File stem: writes NAME.pem and NAME-key.pem.
    days
        Validity in days.
    out
        Where to write the files (default: the --dir).
    """
    try:
        ca = load_ca(pki_dir)
        cert, key = issue_server(ca, list(hosts), out or pki_dir, name=name, days=days)
        info = describe_certificate(cert)
    except CAError as exc:
        _fail(str(exc))
    _wrote(key, cert)
    print(f"subjectAltName: {', '.join(info['sans'])}")


@cert_app.command
def agent(
    node: str,
    /,
    *,
    pki_dir: PkiDir = Path("pki"),
    days: int = 825,
    out: OutDir = None,
) -> None:
    """Issue NODE's client certificate (CN = NODE, clientAuth only).

    The control plane accepts an agent only if the certificate's CN equals
    the node id it registers with.

    Parameters
    ----------
    node
        The node id, exactly as the agent registers it.
    pki_dir
        Directory holding the CA.
    days
        Validity in days.
    out
        Where to write NODE.pem and NODE-key.pem (default: the --dir).
    """
    try:
        ca = load_ca(pki_dir)
        cert, key = issue_agent(ca, node, out or pki_dir, days=days)
    except CAError as exc:
        _fail(str(exc))
    _wrote(key, cert)


@cert_app.command
def show(path: Path, /) -> None:
    """Print a certificate's names, usages, validity and fingerprint.

    Parameters
    ----------
    path
        A PEM certificate file.
    """
    try:
        info = describe_certificate(path)
    except CAError as exc:
        _fail(str(exc))
    print(f"path:        {info['path']}")
    print(f"subject CN:  {info['subject_cn'] or '-'}")
    print(f"issuer CN:   {info['issuer_cn'] or '-'}")
    print(f"SANs:        {', '.join(info['sans']) or '-'}")
    print(f"usage:       {', '.join(info['eku']) or '-'}{' (CA)' if info['is_ca'] else ''}")
    print(f"not before:  {info['not_before']}")
    print(f"not after:   {info['not_after']}{' (EXPIRED)' if info['expired'] else ''}")
    print(f"serial:      {info['serial']}")
    print(f"sha256:      {info['fingerprint_sha256']}")


if __name__ == "__main__":
    cert_app()

"""Rules of this suite (keep them true; they are why it can run anywhere):

- Network traffic goes to loopback only (127.0.0.1 / ::1), or to network
  namespaces a test made itself and removes (the lab, ``tools/lab``, as root),
  on port 0 or on a port a server of ours bound first; a process that must be told its port
  before it starts (an engine, a stand-in, ``tools/fleet``) takes one from
  ``tests/ports.py``, never a port bound to 0 and closed again. Request loops
  are bounded.
- Every test that does I/O runs under a deadline (``trio.fail_after`` or the
  helpers' own timeouts), so a regression fails instead of hanging CI.
- Real parts: real TLS with the project's own CA, real processes for anything
  a user would run as a process (``llmgw server``, ``llmgw agent``, ``ctl``).
  Connections are severed through our own proxy, never a helper that might
  silently leave upgraded connections open.
- Time that is only waited on is simulated with trio's ``autojump_clock``;
  time that a real process spends is bounded, never asserted to the millisecond.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import attrs
import pytest

from llmgw.tls import init_ca, issue_agent, issue_server, load_ca

NODES = ("n1", "n2", "n3", "n4")


@attrs.frozen
class Pki:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    other_ca_dir: Path  # a second CA nobody trusts

    def agent(self, node: str) -> tuple[Path, Path]:
        return self.dir / f"{node}.pem", self.dir / f"{node}-key.pem"

    def foreign_agent(self, node: str) -> tuple[Path, Path]:
        return self.other_ca_dir / f"{node}.pem", self.other_ca_dir / f"{node}-key.pem"

    def expired_agent(self, node: str) -> tuple[Path, Path]:
        d = self.dir / "expired"
        return d / f"{node}.pem", d / f"{node}-key.pem"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    init_ca(d)
    ca = load_ca(d)
    cert, key = issue_server(ca, ["127.0.0.1", "::1", "localhost"], d)
    for node in NODES:
        issue_agent(ca, node, d)
    now = dt.datetime.now(dt.UTC)
    (d / "expired").mkdir()
    issue_agent(
        ca,
        "n1",
        d / "expired",
        not_before=now - dt.timedelta(days=10),
        not_after=now - dt.timedelta(days=1),
    )
    other = tmp_path_factory.mktemp("other-pki")
    init_ca(other, name="someone else's CA")
    issue_agent(load_ca(other), "n1", other)
    return Pki(dir=d, ca=d / "ca.pem", server_cert=cert, server_key=key, other_ca_dir=other)

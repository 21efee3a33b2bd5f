"""The node's lock on this host: held for the block, refused to a second holder with
the holder's pid read from the kernel, per fleet, and free again once released."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.hostlock import Holder, NodeBusy, fleet_digest, hold_node, lock_name, probe
from tests.conftest import Pki


def test_a_second_holder_is_refused_naming_the_first_pid_and_how_to_stop_it(pki: Pki) -> None:
    fleet = fleet_digest(pki.ca)
    assert probe("n1", fleet) is None
    with hold_node("n1", fleet):
        holder = probe("n1", fleet)
        assert holder is not None and holder.pid == os.getpid()
        with pytest.raises(NodeBusy) as refused, hold_node("n1", fleet):
            pass
        # pytest is not an llmgw agent: its command is named, to say who holds the lock
        assert str(refused.value) == (
            f"another agent (pid {os.getpid()}, {holder.command}) runs as node n1 on this"
            f" host; stop it first (kill {os.getpid()}): two agents for one node take the"
            " stream from each other and kill each other's engines"
        )
        assert "pytest" in holder.command
        with hold_node("n2", fleet), hold_node("n1", "another-fleet"):
            pass  # another node, or the same name in another fleet
    with hold_node("n1", fleet):  # released with the block
        pass


def test_the_fleet_is_the_ca_certificate_not_its_file(pki: Pki, tmp_path: Path) -> None:
    copy = tmp_path / "ca.pem"
    copy.write_text("# the same CA, written otherwise\n\n" + pki.ca.read_text())
    assert fleet_digest(copy) == fleet_digest(pki.ca)
    assert fleet_digest(pki.other_ca_dir / "ca.pem") != fleet_digest(pki.ca)
    assert fleet_digest(tmp_path / "missing.pem") != fleet_digest(pki.ca)


def test_a_long_node_id_still_fits_an_abstract_socket_name() -> None:
    name = lock_name("n" * 300, "abc")
    assert len(name.encode()) <= 107 and name != lock_name("m" * 300, "abc")
    assert lock_name("gpu-07", "abc") == "llmgw-agent:gpu-07:abc"


def test_a_holder_in_a_unit_is_told_to_stop_with_systemctl() -> None:
    assert Holder(42, unit="llmgw-agent.service").how_to_stop() == "systemctl stop llmgw-agent"
    assert Holder(42).how_to_stop() == "kill 42"
    message = str(
        NodeBusy("n1", Holder(42, "/usr/bin/python3 llmgw.pyz agent", "llmgw-agent.service"))
    )
    assert message.startswith(
        "another agent (pid 42, llmgw-agent.service) runs as node n1 on this host;"
        " stop it first (systemctl stop llmgw-agent)"
    )

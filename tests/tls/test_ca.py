"""The private CA: file modes, refusal to replace, and what goes into certificates."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import stat
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.tls.ca import (
    CA,
    CAError,
    describe_certificate,
    init_ca,
    issue_agent,
    issue_server,
    load_ca,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


T = TypeVar("T", bound=x509.ExtensionType)


def _ext(cert: x509.Certificate, kind: type[T]) -> T:
    return cert.extensions.get_extension_for_class(kind).value


@pytest.fixture
def ca(tmp_path: Path) -> CA:
    init_ca(tmp_path / "pki")
    return load_ca(tmp_path / "pki")


# --------------------------------------------------------------------------- init_ca


def test_init_writes_key_0600_and_readable_cert(tmp_path: Path) -> None:
    files = init_ca(tmp_path / "pki")
    assert files.key == tmp_path / "pki" / "ca-key.pem"
    assert files.cert == tmp_path / "pki" / "ca.pem"
    assert _mode(files.key) == 0o600
    assert _mode(files.cert) == 0o644 & ~_umask()
    assert _mode(files.cert) & 0o444 == 0o444 & ~_umask()
    # Nothing else (temporary files) left behind.
    assert sorted(p.name for p in (tmp_path / "pki").iterdir()) == ["ca-key.pem", "ca.pem"]


def test_init_ca_certificate_shape(tmp_path: Path) -> None:
    files = init_ca(tmp_path, name="fleet CA")
    cert = _cert(files.cert)
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    assert cert.subject == cert.issuer
    assert describe_certificate(files.cert)["subject_cn"] == "fleet CA"
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical
    assert bc.value.ca
    assert bc.value.path_length == 0
    ku = _ext(cert, x509.KeyUsage)
    assert ku.key_cert_sign
    assert ku.crl_sign
    assert not ku.digital_signature
    ski = _ext(cert, x509.SubjectKeyIdentifier)
    assert ski == x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert.verify_directly_issued_by(cert)


def test_key_mode_is_set_at_creation_never_chmod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0600 must be the creation mode: a chmod afterwards leaves a readable window."""
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode)

    def no_chmod(*args: object, **kwargs: object) -> None:
        raise AssertionError("keys must not be chmod-ed after creation")

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(os, "fchmod", no_chmod)
    monkeypatch.setattr(Path, "chmod", no_chmod)
    old = os.umask(0)  # a permissive umask must not widen the key
    try:
        files = init_ca(tmp_path)
        ca = load_ca(tmp_path)
        _, agent_key = issue_agent(ca, "n1", tmp_path)
    finally:
        os.umask(old)
    key_opens = [o for o in opened if "-key.pem" in o[0]]
    assert len(key_opens) == 2
    for _, flags, mode in key_opens:
        assert mode == 0o600
        assert flags & os.O_CREAT
        assert flags & os.O_EXCL
    assert _mode(files.key) == 0o600
    assert _mode(agent_key) == 0o600


def test_init_refuses_to_replace_existing_ca(tmp_path: Path) -> None:
    files = init_ca(tmp_path)
    before = (files.cert.read_bytes(), files.key.read_bytes())
    with pytest.raises(CAError) as info:
        init_ca(tmp_path)
    message = str(info.value)
    assert message == (
        f"{tmp_path / 'ca-key.pem'} already exists; refusing to replace the CA that every "
        "node trusts (pass --force to replace it)"
    )
    assert (files.cert.read_bytes(), files.key.read_bytes()) == before


def test_init_refuses_when_only_the_certificate_exists(tmp_path: Path) -> None:
    files = init_ca(tmp_path)
    files.key.unlink()
    with pytest.raises(CAError, match=r"ca\.pem already exists"):
        init_ca(tmp_path)


def test_init_force_replaces_and_key_stays_0600(tmp_path: Path) -> None:
    files = init_ca(tmp_path)
    old_cert = files.cert.read_bytes()
    files.key.chmod(0o644)  # someone loosened it; the replacement must not inherit that
    init_ca(tmp_path, force=True)
    assert files.cert.read_bytes() != old_cert
    assert _mode(files.key) == 0o600


def test_init_rejects_nonpositive_days(tmp_path: Path) -> None:
    with pytest.raises(CAError, match="at least 1"):
        init_ca(tmp_path, days=0)
    assert not (tmp_path / "ca-key.pem").exists()


# --------------------------------------------------------------------------- load_ca


def test_load_ca_missing_directory_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CAError) as info:
        load_ca(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / "ca.pem") in str(info.value)
    assert "llmgw ctl cert init" in str(info.value)


def test_load_ca_missing_key_names_the_key(tmp_path: Path) -> None:
    files = init_ca(tmp_path)
    files.key.unlink()
    with pytest.raises(CAError) as info:
        load_ca(tmp_path)
    assert str(info.value) == f"cannot read CA key {files.key}: no such file or directory"


def test_load_ca_garbage_certificate(tmp_path: Path) -> None:
    files = init_ca(tmp_path)
    files.cert.write_text("not a certificate\n")
    with pytest.raises(
        CAError, match=re.escape(f"CA certificate {files.cert} is not a PEM certificate")
    ):
        load_ca(tmp_path)


def test_load_ca_key_from_another_ca(tmp_path: Path) -> None:
    files = init_ca(tmp_path / "a")
    other = init_ca(tmp_path / "b")
    files.key.write_bytes(other.key.read_bytes())
    with pytest.raises(CAError) as info:
        load_ca(tmp_path / "a")
    assert str(info.value) == f"CA key {files.key} does not match CA certificate {files.cert}"


def test_load_ca_rejects_a_leaf_as_ca(tmp_path: Path, ca: CA) -> None:
    cert, key = issue_agent(ca, "n1", tmp_path / "fake")
    cert.rename(tmp_path / "fake" / "ca.pem")
    key.rename(tmp_path / "fake" / "ca-key.pem")
    with pytest.raises(CAError, match="is not a CA certificate"):
        load_ca(tmp_path / "fake")


# --------------------------------------------------------------------------- server


def test_server_sans_dns_ipv4_ipv6_bracketed(tmp_path: Path, ca: CA) -> None:
    hosts = ["cp.example.com", "localhost", "10.1.2.3", "::1", "[fd00::7]", "10.1.2.3", "LOCALHOST"]
    cert_path, key_path = issue_server(ca, hosts, tmp_path / "out")
    assert cert_path == tmp_path / "out" / "server.pem"
    assert key_path == tmp_path / "out" / "server-key.pem"
    assert _mode(key_path) == 0o600
    cert = _cert(cert_path)
    san = _ext(cert, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.DNSName) == ["cp.example.com", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("fd00::7"),
    ]
    assert list(_ext(cert, x509.ExtendedKeyUsage)) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not _ext(cert, x509.BasicConstraints).ca
    assert _ext(cert, x509.AuthorityKeyIdentifier).key_identifier == (
        _ext(ca.cert, x509.SubjectKeyIdentifier).digest
    )
    # An independent verifier (cryptography's, RFC 5280 + CABF rules) agrees
    # that the certificate is valid for every host, by name and by IP.
    store = verification.Store([ca.cert])
    for subject in (
        x509.DNSName("cp.example.com"),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("10.1.2.3")),
        x509.IPAddress(ipaddress.ip_address("::1")),
        x509.IPAddress(ipaddress.ip_address("fd00::7")),
    ):
        verifier = verification.PolicyBuilder().store(store).build_server_verifier(subject)
        verifier.verify(cert, [])
    wrong = (
        verification.PolicyBuilder()
        .store(store)
        .build_server_verifier(x509.IPAddress(ipaddress.ip_address("10.1.2.4")))
    )
    with pytest.raises(verification.VerificationError):
        wrong.verify(cert, [])


def test_server_custom_name_and_random_serials(tmp_path: Path, ca: CA) -> None:
    a, _ = issue_server(ca, ["localhost"], tmp_path, name="cp")
    first = _cert(a).serial_number
    b, _ = issue_server(ca, ["localhost"], tmp_path, name="cp")
    assert a == b == tmp_path / "cp.pem"
    assert _cert(b).serial_number != first


def test_server_refuses_empty_host_list(tmp_path: Path, ca: CA) -> None:
    with pytest.raises(CAError, match="no hosts given"):
        issue_server(ca, [], tmp_path)
    with pytest.raises(CAError, match="not one string"):
        issue_server(ca, "localhost", tmp_path)
    assert not (tmp_path / "server.pem").exists()


@pytest.mark.parametrize(
    "host",
    [
        "https://cp.example.com",
        "cp.example.com:8443",
        "127.1",
        "10.0.0",
        "under_score.example",
        "-lead.example",
        "fe80::1%eth0",
        "",
        "a..b",
        "exämple.com",
    ],
)
def test_server_rejects_what_is_not_a_host(tmp_path: Path, ca: CA, host: str) -> None:
    with pytest.raises(CAError) as info:
        issue_server(ca, ["localhost", host], tmp_path)
    assert repr(host) in str(info.value)


def test_server_wildcard_allowed_in_leftmost_label(tmp_path: Path, ca: CA) -> None:
    cert, _ = issue_server(ca, ["*.cp.example.com"], tmp_path)
    sans = _ext(_cert(cert), x509.SubjectAlternativeName).get_values_for_type(x509.DNSName)
    assert sans == ["*.cp.example.com"]


def test_leaf_refuses_to_overwrite_the_ca(tmp_path: Path, ca: CA) -> None:
    before = ca.key_path.read_bytes()
    with pytest.raises(CAError, match="the CA's own file"):
        issue_agent(ca, "ca", ca.cert_path.parent)
    with pytest.raises(CAError, match="the CA's own file"):
        issue_server(ca, ["localhost"], ca.cert_path.parent, name="ca")
    assert ca.key_path.read_bytes() == before


# --------------------------------------------------------------------------- agent


def test_agent_cert_cn_eku_and_dns_san(tmp_path: Path, ca: CA) -> None:
    cert_path, key_path = issue_agent(ca, "gpu-node-01", tmp_path)
    assert cert_path == tmp_path / "gpu-node-01.pem"
    assert key_path == tmp_path / "gpu-node-01-key.pem"
    assert _mode(key_path) == 0o600
    cert = _cert(cert_path)
    assert describe_certificate(cert_path)["subject_cn"] == "gpu-node-01"
    assert list(_ext(cert, x509.ExtendedKeyUsage)) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    san = _ext(cert, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.DNSName) == ["gpu-node-01"]
    cert.verify_directly_issued_by(ca.cert)
    store = verification.Store([ca.cert])
    verified = verification.PolicyBuilder().store(store).build_client_verifier().verify(cert, [])
    assert verified.subjects is not None
    # clientAuth only: the same certificate is useless as a server certificate.
    as_server = (
        verification.PolicyBuilder().store(store).build_server_verifier(x509.DNSName("gpu-node-01"))
    )
    with pytest.raises(verification.VerificationError):
        as_server.verify(cert, [])


def test_agent_without_dns_name_has_no_san(tmp_path: Path, ca: CA) -> None:
    cert_path, _ = issue_agent(ca, "rack 3 gpu_1", tmp_path)
    cert = _cert(cert_path)
    assert describe_certificate(cert_path)["subject_cn"] == "rack 3 gpu_1"
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)


@pytest.mark.parametrize(
    ("node_id", "fragment"),
    [
        ("", "must not be empty"),
        ("rack/3", "slashes"),
        ("..", "slashes"),
        ("x" * 65, "longer than 64"),
        ("tab\there", "printable"),
        (" padded", "printable"),
    ],
)
def test_agent_rejects_bad_node_ids(tmp_path: Path, ca: CA, node_id: str, fragment: str) -> None:
    with pytest.raises(CAError, match=fragment):
        issue_agent(ca, node_id, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_agent_accepts_64_characters(tmp_path: Path, ca: CA) -> None:
    cert, _ = issue_agent(ca, "n" * 64, tmp_path)
    assert describe_certificate(cert)["subject_cn"] == "n" * 64


def test_expired_certificate_via_explicit_validity(tmp_path: Path, ca: CA) -> None:
    now = dt.datetime.now(dt.UTC)
    cert, _ = issue_agent(
        ca,
        "old",
        tmp_path,
        not_before=now - dt.timedelta(days=10),
        not_after=now - dt.timedelta(days=1),
    )
    info = describe_certificate(cert)
    assert info["expired"] is True
    assert _cert(cert).not_valid_after_utc < now
    with pytest.raises(CAError, match="before it starts"):
        issue_agent(ca, "bad", tmp_path, not_before=now, not_after=now - dt.timedelta(days=1))


# --------------------------------------------------------------------------- describe


def test_describe_certificate(tmp_path: Path, ca: CA) -> None:
    cert_path, _ = issue_server(ca, ["cp.example.com", "10.0.0.5"], tmp_path)
    info = describe_certificate(cert_path)
    cert = _cert(cert_path)
    assert info["path"] == str(cert_path)
    assert info["subject_cn"] == "cp.example.com"
    assert info["issuer_cn"] == "llmgw CA"
    assert info["sans"] == ["DNS:cp.example.com", "IP:10.0.0.5"]
    assert info["eku"] == ["serverAuth"]
    assert info["is_ca"] is False
    assert info["expired"] is False
    assert dt.datetime.fromisoformat(info["not_after"]) == cert.not_valid_after_utc
    assert dt.datetime.fromisoformat(info["not_before"]) == cert.not_valid_before_utc
    assert info["serial"] == f"{cert.serial_number:x}"
    assert len(info["fingerprint_sha256"].split(":")) == 32
    ca_info = describe_certificate(ca.cert_path)
    assert ca_info["is_ca"] is True
    assert ca_info["sans"] == []


def test_describe_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(CAError, match=re.escape(f"cannot read certificate {tmp_path / 'x.pem'}")):
        describe_certificate(tmp_path / "x.pem")
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(
        CAError, match=re.escape(f"{tmp_path / 'junk.pem'} is not a PEM certificate")
    ):
        describe_certificate(tmp_path / "junk.pem")

"""Mutual TLS over real loopback sockets between server_context and client_context.

The hostname tests are the ones the project's seed lesson calls out: hostname
verification reads subjectAltNames and ignores the common name, so a server
certificate without the address agents dial (bare IP included) is rejected
whatever its subject says.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
from pathlib import Path

import attrs
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.tls import (
    CA,
    TLSConfigError,
    certificate_names,
    client_context,
    init_ca,
    issue_agent,
    issue_server,
    load_ca,
    peer_common_name,
    server_context,
)
from llmgw.tls.contexts import NOT_FROM_OUR_CA

NODE = "gpu-node-01"
IO_TIMEOUT = 5

# OpenSSL X509_V_ERR_* codes surfaced as SSLCertVerificationError.verify_code
X509_V_ERR_CERT_HAS_EXPIRED = 10
X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY = 20
X509_V_ERR_INVALID_PURPOSE = 26
X509_V_ERR_HOSTNAME_MISMATCH = 62
X509_V_ERR_IP_ADDRESS_MISMATCH = 64


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")


@attrs.frozen
class Pki:
    dir: Path
    ca: CA
    server: tuple[Path, Path]
    agent: tuple[Path, Path]

    @property
    def ca_file(self) -> Path:
        return self.ca.cert_path

    def server_ctx(self, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
        return server_context(self.ca_file, *(cert or self.server))

    def client_ctx(self, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
        return client_context(self.ca_file, *(cert or self.agent))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    init_ca(base)
    ca = load_ca(base)
    server = issue_server(ca, ["localhost", "127.0.0.1", "[::1]"], base)
    agent = issue_agent(ca, NODE, base)
    return Pki(dir=base, ca=ca, server=server, agent=agent)


@attrs.define
class Outcome:
    """What each side saw; every I/O step is bounded, so a hang fails the test."""

    server_error: BaseException | None = None
    client_error: BaseException | None = None
    client_handshake_done: bool = False
    peer_cn_seen_by_server: str | None = None
    peer_cn_seen_by_client: str | None = None
    received: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.server_error is None and self.client_error is None


async def exchange(
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    *,
    bind: str = "127.0.0.1",
    dial: str = "127.0.0.1",
) -> Outcome:
    """One connection: handshake, server greets the client by CN, client reads it."""
    out = Outcome()
    listeners = await trio.open_tcp_listeners(0, host=bind)
    listener = listeners[0]
    port = listener.socket.getsockname()[1]

    async def serve() -> None:
        try:
            with trio.fail_after(IO_TIMEOUT):
                tcp = await listener.accept()
                stream = trio.SSLStream(tcp, server_ctx, server_side=True)
                try:
                    await stream.do_handshake()
                    out.peer_cn_seen_by_server = peer_common_name(stream)
                    await stream.send_all(b"hello " + str(out.peer_cn_seen_by_server).encode())
                except (trio.BrokenResourceError, ssl.SSLError) as exc:
                    out.server_error = exc
                finally:
                    # Closing the transport is what unblocks a client whose
                    # certificate was refused after its own handshake finished.
                    await stream.aclose()
        finally:
            await listener.aclose()

    async def dial_() -> None:
        with trio.fail_after(IO_TIMEOUT):
            try:
                stream = await trio.open_ssl_over_tcp_stream(dial, port, ssl_context=client_ctx)
                async with stream:
                    await stream.do_handshake()
                    out.client_handshake_done = True
                    out.peer_cn_seen_by_client = peer_common_name(stream)
                    # With TLS 1.3 a refused client certificate shows up here,
                    # at the first read, not in the handshake.
                    out.received = bytes(await stream.receive_some())
            except (trio.BrokenResourceError, ssl.SSLError) as exc:
                out.client_error = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        nursery.start_soon(dial_)
    return out


def ssl_cause(exc: BaseException | None) -> ssl.SSLError:
    """The ssl.SSLError behind trio's BrokenResourceError."""
    seen = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    raise AssertionError(f"no ssl.SSLError behind {exc!r}")


def verify_code(exc: BaseException | None) -> int:
    cause = ssl_cause(exc)
    assert isinstance(cause, ssl.SSLCertVerificationError), repr(cause)
    return cause.verify_code


def build_cn_only_server_cert(ca: CA, common_name: str, directory: Path) -> tuple[Path, Path]:
    """A server cert that names the host only in its CN: the classic mistake.

    Otherwise well-formed (serverAuth, AKI, signed by the project CA), so the
    only thing wrong with it is the missing subjectAltName.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
        .sign(ca.key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path = directory / f"cn-only-{common_name}.pem"
    key_path = directory / f"cn-only-{common_name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(params=[ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls12", "tls13"])
def tls_version(request: pytest.FixtureRequest) -> ssl.TLSVersion:
    version: ssl.TLSVersion = request.param
    return version


# --------------------------------------------------------------------------- happy path


async def test_mutual_tls_by_ipv4_and_server_sees_node_id(pki: Pki) -> None:
    out = await exchange(pki.server_ctx(), pki.client_ctx(), dial="127.0.0.1")
    assert out.ok, out
    assert out.peer_cn_seen_by_server == NODE
    assert out.peer_cn_seen_by_client == "localhost"
    assert out.received == f"hello {NODE}".encode()


async def test_mutual_tls_by_name_localhost(pki: Pki) -> None:
    out = await exchange(pki.server_ctx(), pki.client_ctx(), bind="127.0.0.1", dial="localhost")
    assert out.ok, out
    assert out.peer_cn_seen_by_server == NODE


@needs_ipv6
async def test_mutual_tls_by_ipv6_loopback(pki: Pki) -> None:
    out = await exchange(pki.server_ctx(), pki.client_ctx(), bind="::1", dial="::1")
    assert out.ok, out
    assert out.peer_cn_seen_by_server == NODE


async def test_tls12_client_still_works(pki: Pki) -> None:
    client = pki.client_ctx()
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    out = await exchange(pki.server_ctx(), client)
    assert out.ok, out
    assert out.peer_cn_seen_by_server == NODE


# --------------------------------------------------------------------------- hostnames


@pytest.mark.parametrize(
    ("common_name", "dial", "code"),
    [
        ("127.0.0.1", "127.0.0.1", X509_V_ERR_IP_ADDRESS_MISMATCH),
        ("localhost", "localhost", X509_V_ERR_HOSTNAME_MISMATCH),
    ],
)
async def test_name_only_in_common_name_is_rejected(
    pki: Pki, tmp_path: Path, common_name: str, dial: str, code: int
) -> None:
    cert = build_cn_only_server_cert(pki.ca, common_name, tmp_path)
    out = await exchange(pki.server_ctx(cert), pki.client_ctx(), dial=dial)
    assert not out.client_handshake_done
    assert verify_code(out.client_error) == code
    assert "mismatch" in ssl_cause(out.client_error).verify_message  # type: ignore[attr-defined]
    assert out.server_error is not None  # the server saw the client abort
    assert out.peer_cn_seen_by_server is None

    # Control: the very same certificate is accepted once hostname checking is
    # off, so the SAN (not the chain, EKU or dates) is what rejected it above.
    lax = pki.client_ctx()
    lax.check_hostname = False
    control = await exchange(pki.server_ctx(cert), lax, dial=dial)
    assert control.ok, control
    assert control.peer_cn_seen_by_client == common_name


async def test_certificate_without_the_dialed_ip_is_rejected(pki: Pki, tmp_path: Path) -> None:
    """Issued for the DNS name only, dialed by bare IP: the failure everyone hits once."""
    cert = issue_server(pki.ca, ["localhost"], tmp_path, name="dns-only")
    by_ip = await exchange(pki.server_ctx(cert), pki.client_ctx(), dial="127.0.0.1")
    assert verify_code(by_ip.client_error) == X509_V_ERR_IP_ADDRESS_MISMATCH
    assert by_ip.peer_cn_seen_by_server is None

    by_name = await exchange(pki.server_ctx(cert), pki.client_ctx(), dial="localhost")
    assert by_name.ok, by_name


@needs_ipv6
async def test_ipv4_san_does_not_cover_ipv6_loopback(pki: Pki, tmp_path: Path) -> None:
    cert = issue_server(pki.ca, ["localhost", "127.0.0.1"], tmp_path, name="v4-only")
    out = await exchange(pki.server_ctx(cert), pki.client_ctx(), bind="::1", dial="::1")
    assert verify_code(out.client_error) == X509_V_ERR_IP_ADDRESS_MISMATCH


async def test_agent_certificate_cannot_serve(pki: Pki, tmp_path: Path) -> None:
    """EKU clientAuth only: an agent's key cannot impersonate the control plane."""
    impostor = issue_agent(pki.ca, "localhost", tmp_path)  # has DNS SAN "localhost"
    out = await exchange(pki.server_ctx(impostor), pki.client_ctx(), dial="localhost")
    assert verify_code(out.client_error) == X509_V_ERR_INVALID_PURPOSE


# --------------------------------------------------------------------------- client certs


async def test_client_cert_from_another_ca_is_refused(
    pki: Pki, tmp_path: Path, tls_version: ssl.TLSVersion
) -> None:
    init_ca(tmp_path / "rogue", name="rogue CA")
    rogue = issue_agent(load_ca(tmp_path / "rogue"), NODE, tmp_path / "rogue")
    client = pki.client_ctx(rogue)  # trusts the real CA, presents a rogue cert
    client.maximum_version = tls_version
    out = await exchange(pki.server_ctx(), client)
    assert verify_code(out.server_error) == X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    assert out.peer_cn_seen_by_server is None
    assert out.client_error is not None
    assert out.received is None


async def test_expired_client_cert_is_refused(
    pki: Pki, tmp_path: Path, tls_version: ssl.TLSVersion
) -> None:
    now = dt.datetime.now(dt.UTC)
    expired = issue_agent(
        pki.ca,
        NODE,
        tmp_path,
        not_before=now - dt.timedelta(days=30),
        not_after=now - dt.timedelta(days=1),
    )
    client = pki.client_ctx(expired)
    client.maximum_version = tls_version
    out = await exchange(pki.server_ctx(), client)
    assert verify_code(out.server_error) == X509_V_ERR_CERT_HAS_EXPIRED
    assert out.peer_cn_seen_by_server is None
    assert out.client_error is not None
    assert out.received is None


async def test_server_certificate_cannot_be_used_as_client_cert(pki: Pki) -> None:
    client = pki.client_ctx(pki.server)  # serverAuth only
    out = await exchange(pki.server_ctx(), client)
    assert verify_code(out.server_error) == X509_V_ERR_INVALID_PURPOSE
    assert out.client_error is not None


async def test_client_without_certificate_is_refused(pki: Pki, tls_version: ssl.TLSVersion) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(pki.ca_file)  # trusts the server, presents nothing
    bare.maximum_version = tls_version
    out = await exchange(pki.server_ctx(), bare)
    cause = ssl_cause(out.server_error)
    assert cause.reason in {"PEER_DID_NOT_RETURN_A_CERTIFICATE", "NO_CERTIFICATE_RETURNED"}, cause
    assert out.peer_cn_seen_by_server is None
    # The client learns it too: in TLS 1.2 during the handshake, in TLS 1.3 only
    # at its first read (its handshake already "succeeded").
    assert out.client_error is not None
    assert out.received is None
    if tls_version == ssl.TLSVersion.TLSv1_3:
        assert out.client_handshake_done


# --------------------------------------------------------------------------- contexts


def test_context_settings(pki: Pki) -> None:
    server = pki.server_ctx()
    client = pki.client_ctx()
    for ctx in (server, client):
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
        # Only the project CA is trusted: not the system store.
        cas = ctx.get_ca_certs()
        assert len(cas) == 1
        assert ((("commonName", "llmgw CA"),)) in cas[0]["subject"]
    assert client.check_hostname
    # No CN fallback: Python's default would accept a CN-only cert for a DNS name.
    assert not client.hostname_checks_common_name


class _FakePeer:
    def __init__(self, cert: object) -> None:
        self._cert = cert

    def getpeercert(self) -> object:
        return self._cert


def test_peer_common_name_edge_cases() -> None:
    assert peer_common_name(_FakePeer(None)) is None
    assert peer_common_name(_FakePeer({})) is None
    assert peer_common_name(_FakePeer({"subject": ((("organizationName", "x"),),)})) is None
    two = {"subject": ((("commonName", "a"),), (("commonName", "b"),))}
    assert peer_common_name(_FakePeer(two)) is None
    one = {"subject": ((("organizationName", "x"),), (("commonName", "node-7"),))}
    assert peer_common_name(_FakePeer(one)) == "node-7"


# --------------------------------------------------------------------------- errors


def _raises_naming(path: Path, fragment: str, fn: object, *args: object) -> None:
    assert callable(fn)
    with pytest.raises(TLSConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert str(path) in message, message
    assert fragment in message, message


def test_missing_files_are_named(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    cert, key = pki.agent
    for factory in (server_context, client_context):
        _raises_naming(
            missing,
            f"cannot read CA certificate {missing}: no such file",
            factory,
            missing,
            cert,
            key,
        )
        _raises_naming(
            missing,
            f"cannot read certificate {missing}: no such file",
            factory,
            pki.ca_file,
            missing,
            key,
        )
        _raises_naming(
            missing, f"cannot read key {missing}: no such file", factory, pki.ca_file, cert, missing
        )


def test_key_that_does_not_match_certificate(pki: Pki) -> None:
    cert, _ = pki.agent
    _, other_key = pki.server
    with pytest.raises(TLSConfigError) as info:
        client_context(pki.ca_file, cert, other_key)
    assert str(info.value).startswith(f"key {other_key} does not match certificate {cert}: ")
    assert "\n" not in str(info.value)


def test_garbage_and_swapped_files(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.agent
    junk = tmp_path / "junk.pem"
    junk.write_text("this is not PEM\n")
    _raises_naming(junk, "contains no PEM certificate", server_context, junk, cert, key)
    _raises_naming(junk, "contains no PEM certificate", server_context, pki.ca_file, junk, key)
    _raises_naming(junk, "contains no PEM private key", server_context, pki.ca_file, cert, junk)
    # cert and key passed the wrong way round
    _raises_naming(key, "contains no PEM certificate", client_context, pki.ca_file, key, cert)
    # a leaf certificate given as the CA
    _raises_naming(cert, "is not a CA certificate", client_context, cert, cert, key)
    # a corrupt certificate body
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    _raises_naming(
        broken, "is not a valid PEM certificate", client_context, pki.ca_file, broken, key
    )
    # a directory
    _raises_naming(tmp_path, "is a directory", client_context, tmp_path, cert, key)


def test_encrypted_key_is_refused_without_prompting(pki: Pki, tmp_path: Path) -> None:
    cert, key_path = pki.agent
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    encrypted = tmp_path / "enc-key.pem"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    _raises_naming(encrypted, "is encrypted", client_context, pki.ca_file, cert, encrypted)


def test_certificate_names_reads_dns_names_and_addresses_as_people_write_them() -> None:
    cert = {
        "subject": ((("commonName", "server"),),),
        "subjectAltName": (
            ("DNS", "cp.example.net"),
            ("IP Address", "10.0.0.1"),
            ("IP Address", "0:0:0:0:0:0:0:1\n"),  # how ssl spells ::1
            ("email", "ops@example.net"),
        ),
    }
    assert certificate_names(cert) == ["cp.example.net", "10.0.0.1", "::1"]
    assert certificate_names({}) == []
    assert certificate_names(None) == []


async def test_a_context_without_the_name_check_still_checks_the_ca(
    pki: Pki, tmp_path: Path
) -> None:
    """What the agent reads a refused certificate's names with: the name is not
    checked, the chain still is."""
    cert = issue_server(pki.ca, ["cp.example.net"], tmp_path, name="elsewhere")
    names_only = client_context(pki.ca_file, *pki.agent, check_name=False)
    out = await exchange(pki.server_ctx(cert), names_only, dial="127.0.0.1")
    assert out.ok, out
    foreign = init_ca(tmp_path / "foreign")
    lax_foreign = client_context(foreign.cert, *pki.agent, check_name=False)
    out = await exchange(pki.server_ctx(cert), lax_foreign, dial="127.0.0.1")
    assert verify_code(out.client_error) in NOT_FROM_OUR_CA

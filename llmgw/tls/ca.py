"""The project's private certificate authority.

Agents authenticate to the control plane with client certificates, and public
CAs no longer issue ``clientAuth`` certificates, so llmgw runs its own small CA:
one self-signed root that signs the control plane's server certificate and one
client certificate per node.  This module is pure ``cryptography`` (no I/O
framework) so the CLI and tests can use it directly.

Keys are ECDSA P-256: small certificates and cheap handshakes when thousands of
agents reconnect at once.  Private keys are written with mode 0600 *at creation*
(never chmod-ed afterwards, which would leave a window where they are readable).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias, TypedDict

import attrs
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.files import write_atomic

__all__ = [
    "CA",
    "CAError",
    "CAFiles",
    "CertificateInfo",
    "describe_certificate",
    "init_ca",
    "issue_agent",
    "issue_server",
    "load_ca",
    "validate_node_id",
]

CA_CERT_NAME = "ca.pem"
CA_KEY_NAME = "ca-key.pem"

# Certificates start this far in the past so a node whose clock lags the
# machine that issued them does not see "certificate is not yet valid".
_BACKDATE = dt.timedelta(hours=1)

_MAX_NODE_ID = 64
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

_SigningKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CAError(Exception):
    """A CA operation failed; the message is meant for the operator as is."""


@attrs.frozen
class CAFiles:
    """Where ``init_ca`` wrote the CA (the certificate goes to every node)."""

    cert: Path
    key: Path


@attrs.frozen
class CA:
    """A loaded CA: its certificate, signing key and where they came from."""

    cert: x509.Certificate
    key: _SigningKey
    cert_path: Path
    key_path: Path


class CertificateInfo(TypedDict):
    """What ``llmgw ctl cert show`` prints about a certificate."""

    path: str
    subject_cn: str | None
    issuer_cn: str | None
    sans: list[str]
    eku: list[str]
    is_ca: bool
    not_before: str
    not_after: str
    expired: bool
    serial: str
    fingerprint_sha256: str


# --------------------------------------------------------------------------- files


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """``write_atomic``, its failure in the CA's words."""
    try:
        write_atomic(path, data, mode)
    except OSError as exc:
        raise CAError(f"cannot write {path}: {_os_reason(exc)}") from exc


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file or directory"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, IsADirectoryError):
        return "is a directory"
    return exc.strerror.lower() if exc.strerror else str(exc)


def _ensure_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CAError(f"cannot create directory {directory}: {_os_reason(exc)}") from exc


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CAError(f"cannot read {what} {path}: {_os_reason(exc)}") from exc


def _key_pem(key: _SigningKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _spki(public_key: PublicKeyTypes) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# --------------------------------------------------------------------------- validity


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _validity(
    days: int, not_before: dt.datetime | None, not_after: dt.datetime | None
) -> tuple[dt.datetime, dt.datetime]:
    """Resolve the validity window; explicit bounds exist so tests can expire certs."""
    if days < 1:
        raise CAError(f"--days must be at least 1, got {days}")
    start = not_before if not_before is not None else _now() - _BACKDATE
    end = not_after if not_after is not None else _now() + dt.timedelta(days=days)
    if start.tzinfo is None or end.tzinfo is None:
        raise CAError("not_before/not_after must be timezone-aware datetimes")
    if end <= start:
        raise CAError(f"certificate would expire ({end.isoformat()}) before it starts")
    return start, end


# --------------------------------------------------------------------------- the CA


def init_ca(
    directory: Path, *, name: str = "llmgw CA", days: int = 3650, force: bool = False
) -> CAFiles:
    """Create a new self-signed CA in ``directory`` (``ca.pem`` + ``ca-key.pem``).

    Refuses to replace an existing CA unless ``force``: every node trusts the
    current ``ca.pem``, so replacing it silently would cut the whole fleet off.
    """
    directory = Path(directory)
    cert_path = directory / CA_CERT_NAME
    key_path = directory / CA_KEY_NAME
    if not force:
        for existing in (key_path, cert_path):
            if existing.exists():
                raise CAError(
                    f"{existing} already exists; refusing to replace the CA that every "
                    "node trusts (pass --force to replace it)"
                )
    if not name or len(name) > 64:
        raise CAError("the CA name must be 1 to 64 characters")
    start, end = _validity(days, None, None)

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        # path_length=0: this CA signs leaves only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )

    _ensure_dir(directory)
    _write_file(key_path, _key_pem(key), 0o600)
    _write_file(cert_path, _cert_pem(cert), 0o644)
    return CAFiles(cert=cert_path, key=key_path)


def load_ca(directory: Path) -> CA:
    """Load the CA from ``directory``, with errors that name the offending file."""
    directory = Path(directory)
    cert_path = directory / CA_CERT_NAME
    key_path = directory / CA_KEY_NAME
    if not cert_path.exists() and not key_path.exists():
        raise CAError(
            f"no CA in {directory}: {cert_path} does not exist (run `llmgw ctl cert init` first)"
        )
    cert_data = _read(cert_path, "CA certificate")
    key_data = _read(key_path, "CA key")
    try:
        cert = x509.load_pem_x509_certificate(cert_data)
    except ValueError as exc:
        raise CAError(f"CA certificate {cert_path} is not a PEM certificate") from exc
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError as exc:
        raise CAError(f"CA key {key_path} is encrypted; llmgw needs an unencrypted key") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CAError(f"CA key {key_path} is not a PEM private key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise CAError(f"CA key {key_path} is a {type(key).__name__}; expected EC or RSA")
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise CAError(f"CA key {key_path} does not match CA certificate {cert_path}")
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise CAError(f"{cert_path} is not a CA certificate (BasicConstraints CA is not set)")
    return CA(cert=cert, key=key, cert_path=cert_path, key_path=key_path)


# --------------------------------------------------------------------------- hosts


def _dns_name(host: str) -> str | None:
    """``host`` as a DNS name for a SAN, or None if it is not a valid one.

    A name whose last label is all digits (``10.0.0``, ``127.1``) is refused:
    it is a mistyped or abbreviated IP address, not something TLS can match.
    """
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253 or not name.isascii():
        return None
    labels = name.split(".")
    if labels[0] == "*" and len(labels) > 2:
        labels = labels[1:]  # wildcard in the leftmost label only
    if not all(_DNS_LABEL.match(label) for label in labels):
        return None
    if labels[-1].isdigit():
        return None
    return name


def _parse_host(host: str) -> x509.GeneralName:
    """Turn what agents dial into the SAN entry that TLS hostname checks read."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        ip = None
    if ip is not None:
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            raise CAError(f"{host!r}: a certificate cannot carry an IPv6 zone (%{ip.scope_id})")
        return x509.IPAddress(ip)
    name = _dns_name(text)
    if name is None:
        raise CAError(
            f"{host!r} is neither a DNS name nor an IP address (no ports, schemes or paths; "
            "IPv6 may be bracketed like [::1])"
        )
    return x509.DNSName(name)


def _san_key(name: x509.GeneralName) -> str:
    if isinstance(name, x509.DNSName):
        return "DNS:" + name.value.lower()
    return f"IP:{name.value}"


# --------------------------------------------------------------------------- leaves


def _leaf(
    ca: CA,
    *,
    common_name: str,
    sans: Sequence[x509.GeneralName],
    eku: x509.ObjectIdentifier,
    days: int,
    not_before: dt.datetime | None,
    not_after: dt.datetime | None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    start, end = _validity(days, not_before, not_after)
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(aki, critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(ca.key, hashes.SHA256()), key


def _leaf_paths(ca: CA, out_dir: Path, stem: str) -> tuple[Path, Path]:
    """``<stem>.pem``/``<stem>-key.pem``, refusing to clobber the CA's own files."""
    cert_path = out_dir / f"{stem}.pem"
    key_path = out_dir / f"{stem}-key.pem"
    ca_files = {ca.cert_path.resolve(), ca.key_path.resolve()}
    for path in (cert_path, key_path):
        if path.resolve() in ca_files:
            raise CAError(f"refusing to write {path}: that is the CA's own file; pick another name")
    return cert_path, key_path


def _write_leaf(
    cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path, key_path: Path
) -> None:
    _ensure_dir(cert_path.parent)
    _write_file(key_path, _key_pem(key), 0o600)
    _write_file(cert_path, _cert_pem(cert), 0o644)


def issue_server(
    ca: CA,
    hosts: Sequence[str],
    out_dir: Path,
    *,
    name: str = "server",
    days: int = 825,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> tuple[Path, Path]:
    """Issue the control plane's certificate, valid for every host agents dial.

    Each host becomes a subjectAltName (DNS name or IP address): hostname
    verification reads SANs only and ignores the common name, so an address
    missing here is rejected by every agent that dials it.
    """
    if isinstance(hosts, str):
        raise CAError("hosts must be a list of names, not one string")
    if not hosts:
        raise CAError(
            "no hosts given: list every DNS name and IP address agents dial "
            "(they are checked against the certificate's subjectAltName)"
        )
    _check_file_stem(name, "certificate name")
    sans: dict[str, x509.GeneralName] = {}
    for host in hosts:
        san = _parse_host(host)
        sans.setdefault(_san_key(san), san)
    first = next(iter(sans.values()))
    common_name = str(first.value)
    if len(common_name) > 64:
        common_name = "llmgw control plane"
    cert_path, key_path = _leaf_paths(ca, Path(out_dir), name)
    cert, key = _leaf(
        ca,
        common_name=common_name,
        sans=list(sans.values()),
        eku=ExtendedKeyUsageOID.SERVER_AUTH,
        days=days,
        not_before=not_before,
        not_after=not_after,
    )
    _write_leaf(cert, key, cert_path, key_path)
    return cert_path, key_path


def _check_file_stem(value: str, what: str) -> None:
    if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
        raise CAError(f"invalid {what} {value!r}: must be non-empty with no slashes")


def validate_node_id(node_id: str) -> None:
    """Refuse node ids that cannot be a certificate CN *and* a file name."""
    if not node_id:
        raise CAError("node id must not be empty")
    if len(node_id) > _MAX_NODE_ID:
        raise CAError(f"node id {node_id!r} is longer than {_MAX_NODE_ID} characters")
    if "/" in node_id or "\\" in node_id or node_id in (".", ".."):
        raise CAError(f"node id {node_id!r} must not contain slashes or be '.' or '..'")
    if not node_id.isprintable() or node_id != node_id.strip():
        raise CAError(
            f"node id {node_id!r} must be printable, without leading or trailing whitespace"
        )


def issue_agent(
    ca: CA,
    node_id: str,
    out_dir: Path,
    *,
    days: int = 825,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> tuple[Path, Path]:
    """Issue a node's client certificate: CN = ``node_id``, EKU clientAuth only.

    The control plane compares the CN with the node id the agent registers
    with, so one certificate authenticates exactly one node.  clientAuth-only
    keeps an agent's key from impersonating the control plane.
    """
    validate_node_id(node_id)
    name = _dns_name(node_id)
    sans: list[x509.GeneralName] = []
    if name is not None and not name.startswith("*"):
        sans.append(x509.DNSName(name))
    cert_path, key_path = _leaf_paths(ca, Path(out_dir), node_id)
    cert, key = _leaf(
        ca,
        common_name=node_id,
        sans=sans,
        eku=ExtendedKeyUsageOID.CLIENT_AUTH,
        days=days,
        not_before=not_before,
        not_after=not_after,
    )
    _write_leaf(cert, key, cert_path, key_path)
    return cert_path, key_path


# --------------------------------------------------------------------------- show

_EKU_NAMES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    ExtendedKeyUsageOID.CODE_SIGNING: "codeSigning",
    ExtendedKeyUsageOID.EMAIL_PROTECTION: "emailProtection",
    ExtendedKeyUsageOID.TIME_STAMPING: "timeStamping",
    ExtendedKeyUsageOID.OCSP_SIGNING: "OCSPSigning",
}


def _cn(name: x509.Name) -> str | None:
    attrs_ = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs_:
        return None
    value = attrs_[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def describe_certificate(path: Path) -> CertificateInfo:
    """Summarise a PEM certificate for ``llmgw ctl cert show``."""
    path = Path(path)
    data = _read(path, "certificate")
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise CAError(f"{path} is not a PEM certificate") from exc
    sans: list[str] = []
    try:
        san_ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        pass
    else:
        for entry in san_ext:
            if isinstance(entry, x509.DNSName):
                sans.append(f"DNS:{entry.value}")
            elif isinstance(entry, x509.IPAddress):
                sans.append(f"IP:{entry.value}")
            else:
                sans.append(f"{type(entry).__name__}:{entry.value}")
    eku: list[str] = []
    try:
        eku_ext = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        pass
    else:
        eku = [_EKU_NAMES.get(oid, oid.dotted_string) for oid in eku_ext]
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    not_before = cert.not_valid_before_utc
    not_after = cert.not_valid_after_utc
    return CertificateInfo(
        path=str(path),
        subject_cn=_cn(cert.subject),
        issuer_cn=_cn(cert.issuer),
        sans=sans,
        eku=eku,
        is_ca=is_ca,
        not_before=not_before.isoformat(),
        not_after=not_after.isoformat(),
        expired=not_after < _now(),
        serial=f"{cert.serial_number:x}",
        fingerprint_sha256=cert.fingerprint(hashes.SHA256()).hex(":").upper(),
    )

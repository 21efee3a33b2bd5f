"""TLS contexts for the agent stream (mutual TLS against the project CA).

Stdlib ``ssl`` only, so the agent and the control plane share one definition
of "what we trust": the project CA and nothing else (never the system store,
which would let any public certificate for the control plane's name in).

OpenSSL's own load errors do not say which file was wrong ("PEM lib"), so every
file is read and checked first and failures are re-raised as
``TLSConfigError`` with a message naming the file.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeAlias

__all__ = [
    "NAME_MISMATCH",
    "NOT_FROM_OUR_CA",
    "PeerCertSource",
    "TLSConfigError",
    "certificate_names",
    "client_context",
    "peer_common_name",
    "server_context",
]

StrPath: TypeAlias = str | os.PathLike[str]


class PeerCertSource(Protocol):
    """Anything with ``getpeercert()``: ssl.SSLObject, ssl.SSLSocket, trio.SSLStream."""

    def getpeercert(self) -> Any: ...


class TLSConfigError(Exception):
    """A certificate, key or CA file cannot be used; the message names the file."""


def _read_text(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise TLSConfigError(f"cannot read {what} {path}: no such file") from exc
    except PermissionError as exc:
        raise TLSConfigError(f"cannot read {what} {path}: permission denied") from exc
    except IsADirectoryError as exc:
        raise TLSConfigError(f"cannot read {what} {path}: is a directory") from exc
    except OSError as exc:
        raise TLSConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        return data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise TLSConfigError(f"{what} {path} is not PEM text (DER is not supported)") from exc


def _check_certificates(path: Path, what: str) -> ssl.SSLContext:
    """Parse the certificates in ``path`` on a scratch context; return it for inspection."""
    text = _read_text(path, what)
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise TLSConfigError(f"{what} {path} contains no PEM certificate")
    scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        scratch.load_verify_locations(cadata=text)
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"{what} {path} is not a valid PEM certificate: {_reason(exc)}"
        ) from exc
    return scratch


def _check_key(path: Path) -> None:
    text = _read_text(path, "key")
    if "ENCRYPTED PRIVATE KEY-----" in text or "Proc-Type: 4,ENCRYPTED" in text:
        raise TLSConfigError(f"key {path} is encrypted; llmgw needs an unencrypted key (mode 0600)")
    if "PRIVATE KEY-----" not in text:
        raise TLSConfigError(f"key {path} contains no PEM private key")


def _reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.args[-1]).lower().replace("_", " ")


def _no_password() -> NoReturn:
    # Without a callback OpenSSL would prompt on the terminal for a passphrase,
    # hanging a daemon; encrypted keys are refused in _check_key anyway.
    raise TLSConfigError("encrypted key")


def _load_trust(ctx: ssl.SSLContext, ca_file: Path) -> None:
    scratch = _check_certificates(ca_file, "CA certificate")
    if scratch.cert_store_stats()["x509_ca"] == 0:
        raise TLSConfigError(
            f"CA certificate {ca_file} is not a CA certificate (is it a server or agent cert?)"
        )
    try:
        ctx.load_verify_locations(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"cannot load CA certificate {ca_file}: {exc}") from exc


def _load_identity(ctx: ssl.SSLContext, cert_file: Path, key_file: Path) -> None:
    _check_certificates(cert_file, "certificate")
    _check_key(key_file)
    try:
        ctx.load_cert_chain(str(cert_file), str(key_file), password=_no_password)
    except TLSConfigError as exc:
        raise TLSConfigError(f"key {key_file} is encrypted") from exc
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSConfigError(
                f"key {key_file} does not match certificate {cert_file}: give the key written"
                " with that certificate (llmgw ctl cert writes NAME.pem and NAME-key.pem together)"
            ) from exc
        # The certificate parsed above, so what OpenSSL rejects now is the key.
        raise TLSConfigError(f"cannot load key {key_file}: {_reason(exc)}") from exc
    except OSError as exc:
        raise TLSConfigError(f"cannot load {cert_file} / {key_file}: {exc}") from exc


def _harden(ctx: ssl.SSLContext) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # Strict X.509 checks (the default from Python 3.13 on) so a certificate
    # that works here keeps working after an interpreter upgrade.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.options |= ssl.OP_NO_COMPRESSION


def server_context(ca_file: StrPath, cert_file: StrPath, key_file: StrPath) -> ssl.SSLContext:
    """Control-plane side: present our cert, *require* a client cert from the project CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_trust(ctx, Path(ca_file))
    _load_identity(ctx, Path(cert_file), Path(key_file))
    return ctx


def browser_context(cert_file: StrPath, key_file: StrPath) -> ssl.SSLContext:
    """A listener browsers reach (the web console): our cert, no client cert asked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx)
    _load_identity(ctx, Path(cert_file), Path(key_file))
    return ctx


def client_context(
    ca_file: StrPath, cert_file: StrPath, key_file: StrPath, *, check_name: bool = True
) -> ssl.SSLContext:
    """Agent side: verify the control plane's SANs against the project CA, present our cert.

    ``check_name=False`` still verifies the chain but not the name: only to read
    which names a certificate that failed the name check holds, never for a session.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname + CERT_REQUIRED
    _harden(ctx)
    ctx.check_hostname = check_name
    # Python/OpenSSL default to falling back to the subject CN when a cert has
    # no DNS SAN; turn that off so a CN-only cert fails here exactly as it does
    # for IP addresses (never matched against CN) and for Go and browsers.
    ctx.hostname_checks_common_name = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_trust(ctx, Path(ca_file))
    _load_identity(ctx, Path(cert_file), Path(key_file))
    return ctx


def peer_common_name(ssl_object: PeerCertSource) -> str | None:
    """The verified peer certificate's CN (the node id), or None.

    None when there is no verified certificate, no CN, or more than one CN:
    an ambiguous identity must not be matched against a node id.
    """
    cert = ssl_object.getpeercert()
    if not isinstance(cert, dict) or not cert:
        return None
    subject = cert.get("subject", ())
    names: list[str] = []
    for rdn in subject if isinstance(subject, tuple) else ():
        for attribute in rdn:
            if len(attribute) == 2 and attribute[0] == "commonName":
                names.append(str(attribute[1]))
    if len(names) != 1:
        return None
    return names[0]


# OpenSSL's X509_V_ERR_* codes (SSLCertVerificationError.verify_code) that mean
# "the certificate does not hold the name or address dialed" ...
NAME_MISMATCH = frozenset({62, 64})  # HOSTNAME_MISMATCH, IP_ADDRESS_MISMATCH
# ... and "it was not issued by a CA we trust": unable to get the issuer (2, 20),
# self-signed (18, 19), cannot verify the leaf's signature (21, 7).
NOT_FROM_OUR_CA = frozenset({2, 7, 18, 19, 20, 21})


def certificate_names(cert: object) -> list[str]:
    """The DNS names and IP addresses a certificate (``getpeercert()``) holds, in order."""
    if not isinstance(cert, dict):
        return []
    names: list[str] = []
    for entry in cert.get("subjectAltName", ()):
        if len(entry) != 2:
            continue
        kind, value = entry[0], str(entry[1]).strip()
        if kind == "IP Address":
            try:  # ssl spells IPv6 in full: 0:0:0:0:0:0:0:1
                value = str(ipaddress.ip_address(value))
            except ValueError:
                pass
        if kind in ("DNS", "IP Address"):
            names.append(value)
    return names

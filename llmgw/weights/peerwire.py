"""What two agents say to each other to pass weights: the requests, the answers,
and how each side knows the other is of the fleet.

Theory of operation
-------------------
One request per answer, HTTP/1.1 over mutual TLS (h11 frames it, on trio
streams), kept alive between requests:

- ``GET /v1/weights/PATH?sha256=H&size=N``: what the node holds of the file
  at ``PATH`` under its weights directory (``Holding``, JSON): its manifest,
  how many chunks from the first it can serve now (``have``), how many bytes
  it holds (its own fetch's progress) and whether it is landed. ``sha256`` and
  ``size`` name the version wanted; a node that holds another answers 404.
- The same with ``&chunk=I``: chunk ``I``'s bytes, read and checked against
  the node's manifest before the first is sent (409 when they do not match:
  the node's copy is damaged, the taker goes elsewhere; 425 when the node
  does not hold it whole yet).

Any other answer carries one line of text saying why, for the taker's log.

Identity. Both sides present their agent certificate (CN = node id), signed
by the fleet CA. The listener requires a client certificate from that CA
(``llmgw.tls.server_context``, as the control plane's stream listener does).
The taker cannot have OpenSSL check the listener's certificate: agent
certificates are for ``clientAuth`` only (so that no agent key can pass for
the control plane), and OpenSSL refuses one as a server's. So the taker's
context checks no chain, and ``PeerTrust.check`` checks the certificate the
listener presented, once the handshake (which proves the listener holds its
key) is done and before a byte is asked: signed by the fleet CA, in its
validity, ``clientAuth``, and of the node the taker meant to reach.
"""

from __future__ import annotations

import ssl
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, quote, unquote, urlsplit

import attrs
import h11
import msgspec
import trio
from cryptography import x509
from cryptography.x509.oid import NameOID
from cryptography.x509.verification import (
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from llmgw.weights.chunks import Chunks
from llmgw.weights.errors import FetchError

PREFIX = "/v1/weights/"
RECEIVE = 64 << 10  # bytes per read
MAX_HEAD = 16 << 10  # of a request or an answer's head
MAX_MANIFEST = 8 << 20  # an answer's JSON: 65 bytes a chunk, ~100k chunks

# answers
OK = 200
BAD = 400
REFUSED = 403
NOT_HERE = 404
DAMAGED = 409
TOO_EARLY = 425
BUSY = 503


class Holding(msgspec.Struct, frozen=True, kw_only=True):
    """What a node holds of a file, for a taker."""

    chunks: Chunks
    have: int  # chunks from the first it serves now
    held: int  # bytes it holds: its own fetch's progress
    landed: bool


holding_json = msgspec.json.Encoder().encode
_holding = msgspec.json.Decoder(Holding).decode


def read_holding(data: bytes) -> Holding:
    """Raises:
    ValueError: ``data`` is no ``Holding``, or one that does not hold together."""
    try:
        h = _holding(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"not an answer about a file: {exc}") from None
    if not 0 <= h.have <= len(h.chunks.hashes) or h.held < 0:
        raise ValueError(f"an answer that holds {h.have} of {len(h.chunks.hashes)} known chunks")
    return h


@attrs.frozen
class Asked:
    """A request, as the listener reads it."""

    path: PurePosixPath  # relative, under the weights directory; not yet checked
    sha256: str | None
    size: int | None
    chunk: int | None  # None: the manifest


def target(path: PurePosixPath, sha256: str | None, size: int | None, chunk: int | None) -> bytes:
    query = [f"sha256={sha256}"] if sha256 else []
    query += [f"size={size}"] if size is not None else []
    query += [f"chunk={chunk}"] if chunk is not None else []
    url = PREFIX + quote(str(path), safe="/")
    return (url + ("?" + "&".join(query) if query else "")).encode("ascii")


def parse_target(raw: bytes) -> Asked:
    """Raises:
    ValueError: not a request of this protocol (the message says why)."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("the request's target is not ASCII") from None
    parts = urlsplit(text)
    if not parts.path.startswith(PREFIX):
        raise ValueError(f"no such thing here: ask {PREFIX}PATH")
    path = unquote(parts.path[len(PREFIX) :])
    query = parse_qs(parts.query, keep_blank_values=True)
    if any(len(v) != 1 for v in query.values()) or set(query) - {"sha256", "size", "chunk"}:
        raise ValueError("the query holds other than one sha256, size and chunk")

    def number(name: str) -> int | None:
        value = query.get(name, [None])[0]
        if value is None:
            return None
        if not value.isdigit() or len(value) > 20:
            raise ValueError(f"{name} {value!r} is not a number")
        return int(value)

    sha256 = query.get("sha256", [None])[0]
    if sha256 is not None and (
        len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256)
    ):
        raise ValueError(f"sha256 {sha256!r} is not 64 lowercase hex digits")
    return Asked(PurePosixPath(path), sha256, number("size"), number("chunk"))


def check_relative(path: PurePosixPath) -> str | None:
    """Why ``path`` names no weights file a peer may have (None: it may): only a
    plain relative path, down from the weights directory, to a file that is not
    one of a fetch's own (a ``.part``, a record, a manifest: names with a leading
    dot)."""
    text = str(path)
    if not text or text == "." or "\x00" in text or "\\" in text:
        return "an empty path, or one with a NUL or a backslash"
    if path.is_absolute():
        return "an absolute path"
    for part in text.split("/"):
        if part in ("", ".", ".."):
            return f"a {part!r} part"
        if part.startswith("."):
            return f"a hidden name {part!r}"
    if path.name.endswith(".part"):
        return "a fetch's partial file"
    return None


def inside(weights_dir: Path, path: PurePosixPath) -> Path | None:
    """``path`` under ``weights_dir``, if it stays there once links are followed
    (blocking: ``resolve`` reads the disk); None when it does not."""
    root = weights_dir.resolve()
    where = (root / path).resolve()
    if not where.is_relative_to(root) or where == root:
        return None
    return where


# ---------------------------------------------------------------- h11 on trio


async def next_event(
    conn: h11.Connection, stream: trio.abc.Stream, *, max_bytes: int | None = None
) -> h11.Event | type[h11.PAUSED]:
    """The next event of ``conn``, reading ``stream`` as needed; the caller bounds
    the wait. A peer that closes yields ``ConnectionClosed``.

    Raises:
        h11.RemoteProtocolError: the peer spoke other than HTTP/1.1.
    """
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]  # (mypy does not narrow a type object)
        data = await stream.receive_some(RECEIVE if max_bytes is None else min(RECEIVE, max_bytes))
        conn.receive_data(bytes(data))


async def send(conn: h11.Connection, stream: trio.abc.Stream, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


# ---------------------------------------------------------------- identity


class PeerRefused(FetchError):
    """The peer is not the one meant, or not of the fleet: its address is wrong,
    or it is not one of ours."""


@attrs.frozen
class PeerTrust:
    """How a taker reaches its peers: ``context`` presents this node's agent
    certificate and checks no chain (``check`` does); ``ca`` is the fleet CA."""

    context: ssl.SSLContext
    ca: list[x509.Certificate]

    @classmethod
    def load(cls, ca_file: Path, cert_file: Path, key_file: Path) -> PeerTrust:
        """From the agent's own files (as ``llmgw.tls.client_context`` checks them
        when the agent starts).

        Raises:
            ValueError: a file cannot be used; the message names it.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # between our own agents, no older
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the chain is checked by ``check``, see above
        try:
            ctx.load_cert_chain(str(cert_file), str(key_file))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load {cert_file} / {key_file}: {exc}") from None
        try:
            ca = x509.load_pem_x509_certificates(Path(ca_file).read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the CA certificate {ca_file}: {exc}") from None
        return cls(ctx, ca)

    def check(self, der: bytes | None, node_id: str | None, address: str) -> str:
        """The node id of the peer that presented ``der``.

        Raises:
            PeerRefused: it is not of the fleet, or not ``node_id``.
        """
        if not der:
            raise PeerRefused(f"the peer at {address} presented no certificate")
        try:
            leaf = x509.load_der_x509_certificate(der)
        except ValueError:
            raise PeerRefused(f"the peer at {address} presented no certificate") from None
        # an agent's certificate has a DNS name only when its node id is one
        ee = ExtensionPolicy.webpki_defaults_ee().may_be_present(
            x509.SubjectAlternativeName, Criticality.AGNOSTIC, None
        )
        verifier = (
            PolicyBuilder()
            .store(Store(self.ca))
            .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=ee)
            .build_client_verifier()
        )
        try:
            verifier.verify(leaf, [])
        except VerificationError as exc:
            raise PeerRefused(
                f"the peer at {address} is not an agent of this fleet (its certificate: {exc})"
            ) from None
        names = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        cn = str(names[0].value) if len(names) == 1 else None
        if cn is None or (node_id is not None and cn != node_id):
            raise PeerRefused(
                f"the peer at {address} is {cn!r}, not {node_id!r}: is the address the"
                " control plane has for it out of date?"
            )
        return cn


def peer_name(cert: object) -> str:
    """The CN of a client's verified certificate (``getpeercert()``), for logs."""
    if isinstance(cert, dict):
        for rdn in cert.get("subject", ()):
            for attribute in rdn:
                if len(attribute) == 2 and attribute[0] == "commonName":
                    return str(attribute[1])
    return "?"
